#!/usr/bin/env bash
# benchmark/correctness/sp_correctness_gpu.sh: losslessness on a GPU machine. Runs the project's
# own end-to-end tests on the default model with its real weights and trained draft head:
#   * greedy equality of Spexis SP (PP=2, bundled exit-15 head) with plain SGLang (PP=1),
#     32 prompts x 64 tokens (tests/e2e/compare.py: identical token ids demanded), and the real acceptance of the head on those prompts;
#   * committed tokens per row against Eq. 2;
#   * with CUDA graphs on (the default now): SP decode ran in graphs (replay counter), and
#     stage 0's replayed forward makes exactly the drafts and length buckets of an eager server
#     (tests/e2e/test_sp_graphs.py: same verdict counts, same outputs).
# Servers get the GPU machine's required flags through SPEXIS_TEST_SERVER_ARGS, bf16 with
# SGLang's batch-invariant kernels (--enable-deterministic-inference: without them bf16 SGLang
# itself is not batch-invariant on the GPU, so PP=2 and PP=1 differ even without Spexis; float32
# has no sgl_kernel rmsnorm on the GPU) and a small memory share (three servers live at once).
# 2x H200: 32/32 prompts identical, 261 s (benchmark/README.md, "Lossless on the GPU").
# Needs the default model (python -m spexis_sglang.default_model; docs/gpu.md). With one GPU
# both PP stages share it (SPEXIS_SHARE_GPU=1: NCCL over loopback sockets, a bounded KV pool
# per rank so that the ranks' memory profiles leave room for each other).
# Output: $OUT/sp_correctness_$TAG.log (pytest -s output, acceptance lines) and the junit XML.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/../gpu/common.sh"
gpu_script_env || exit $?
DTYPE=${DTYPE:-bfloat16}
# EXTRA_SERVER_ARGS: more server flags; EXTRA_SERVER_ARGS= (empty) turns the deterministic
# kernels off (the control: bf16 flips that plain SGLang shows too)
EXTRA_SERVER_ARGS=${EXTRA_SERVER_ARGS---enable-deterministic-inference}
SHARE_ARGS=  # one GPU (SPEXIS_SHARE_GPU): a bounded KV pool per rank
if [ "$NUM_GPUS" -lt 2 ]; then
  SHARE_ARGS="--max-total-tokens 65536 --cuda-graph-max-bs 64"
fi
export SPEXIS_TEST_SERVER_ARGS="${GPU_FLAGS[*]} --dtype $DTYPE --mem-fraction-static 0.25 $SHARE_ARGS ${EXTRA_SERVER_ARGS:-}"
TAG=${TAG:-$DTYPE${EXTRA_SERVER_ARGS:+_det}_${NUM_GPUS}gpu}
T0=$SECONDS
default_model_ready || exit 5
echo "default model ready in $((SECONDS - T0)) s"
# TESTS: the pytest selection (default: the graph test first, then equality and Eq. 2)
TESTS=${TESTS:-tests/e2e/test_sp_graphs.py tests/e2e/test_sp_lossless.py::test_greedy_default_model_pp2_equals_plain_sglang}
# shellcheck disable=SC2086
python3 -m pytest -p no:cacheprovider -s -q --junitxml "$OUT/sp_correctness_$TAG.xml" $TESTS \
  2>&1 | tee "$OUT/sp_correctness_$TAG.log"
RC=${PIPESTATUS[0]}
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee -a "$OUT/sp_correctness_$TAG.log"
echo "correctness exit $RC in $((SECONDS - T0)) s" | tee -a "$OUT/sp_correctness_$TAG.log"
exit "$RC"
