#!/usr/bin/env bash
# benchmark/acceptance/sp_acceptance_gpu.sh: the shipped draft head's acceptance in the server
# on a GPU machine, at the answer length the offline report scores (768 tokens):
# benchmark/acceptance/sp_acceptance.py --workload specbench (the SpecBench-like mix, per category,
# greedy to EOS or NEW_TOKENS) with the default model's real weights, PP=2, bf16, CUDA graphs on.
# The prompts are tokenized where the data packages are installed (the project's CPU venv):
#   .venv/bin/python benchmark/acceptance/sp_acceptance.py --workload specbench --prompts 16 \
#       --export-prompt-ids .gpu/specbench16_ids.json      # copy it to the GPU machine
# Needs the default model (python -m spexis_sglang.default_model; docs/gpu.md).
#   PROMPT_IDS=.gpu/specbench16_ids.json NEW_TOKENS=768 TAG=specbench768 bash benchmark/acceptance/sp_acceptance_gpu.sh
# Output: $OUT/gpu_sp_acceptance_specbench_$TAG.json and .log.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/../gpu/common.sh"
gpu_script_env || exit $?
TAG=${TAG:-specbench}
PROMPT_IDS=${PROMPT_IDS:-.gpu/specbench16_ids.json}
[ -f "$PROMPT_IDS" ] || { echo "no $PROMPT_IDS: export it with sp_acceptance.py --export-prompt-ids" >&2; exit 2; }
export SPEXIS_TEST_SERVER_ARGS="${GPU_FLAGS[*]} --dtype bfloat16 --mem-fraction-static 0.25 --max-total-tokens 65536 --cuda-graph-max-bs 64 ${EXTRA:-}"
default_model_ready || exit 5
python3 benchmark/acceptance/sp_acceptance.py --workload specbench --prompt-ids "$PROMPT_IDS" \
  --new-tokens "${NEW_TOKENS:-768}" --out "$OUT/gpu_sp_acceptance_specbench_$TAG.json" \
  2>&1 | tee "$OUT/gpu_sp_acceptance_specbench_$TAG.log"
exit "${PIPESTATUS[0]}"
