#!/usr/bin/env bash
# benchmark/decode/loop_overhead_gpu.sh: stage 0's loop CPU time in the regime users serve in:
# benchmark/decode/sp_loop_overhead.py (stock SGLang PP=2 and Spexis SP, tiny random Llama, phase
# timers on stage 0) on the GPU machine with CUDA graphs on for both servers. With one GPU both
# stages share it (SPEXIS_SHARE_GPU=1, NCCL over loopback): the GPU times then mean nothing, but
# stage 0's scheduling and result processing are host CPU work, each stage on its own core.
# The graph replay counter of every SP record shows that decode ran in graphs.
# ONLY=sp or stock: one of the two servers. SP_VARIANTS="NAME:VAR=VALUE,... NAME:..." runs one SP
# server per variant, with those environment variables, side by side (e.g. the fused kernels
# against PyTorch's ops: "fused:SPEXIS_DRAFT_FUSED=1,SPEXIS_ROWS_FUSED=1
# torch-ops:SPEXIS_DRAFT_FUSED=0,SPEXIS_ROWS_FUSED=0"). Output: $OUT/gpu_sp_loop_overhead.json and .log.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/../gpu/common.sh"
gpu_script_env || exit $?
BATCHES=${BATCHES:-64 256 512}
VARIANT_ARGS=()
for v in ${SP_VARIANTS:-}; do VARIANT_ARGS+=(--sp-variant "$v"); done
# the tiny model is made from the default model's tokenizer, which this machine has only once
# the default model is there: make it where it is (a run of sp_loop_overhead.py leaves it in
# /tmp) and copy it: cp -r /tmp/spexis-tiny-llama-2l-v2048 .gpu/tiny/
[ -d .gpu/tiny ] && cp -r .gpu/tiny/spexis-tiny-llama-* "${TMPDIR:-/tmp}/"
# long answers (the tiny model holds 2048 positions): a GPU iteration takes milliseconds, and
# the steady window must not run out of tokens
# shellcheck disable=SC2086
python3 benchmark/decode/sp_loop_overhead.py --batches $BATCHES --new-tokens "${NEW_TOKENS:-2000}" \
  --dtype bfloat16 --min-window-s "${WINDOW_S:-5}" --poll-s 0.5 ${ONLY:+--only $ONLY} ${VARIANT_ARGS[@]+"${VARIANT_ARGS[@]}"} \
  --server-args "${GPU_FLAGS[*]} --cuda-graph-max-bs 512 --mem-fraction-static 0.3 ${EXTRA:-}" \
  --out "$OUT/gpu_sp_loop_overhead.json" 2>&1 | tee "$OUT/gpu_sp_loop_overhead.log"
exit "${PIPESTATUS[0]}"
