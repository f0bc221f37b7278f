#!/usr/bin/env bash
# benchmark/gpu/sp_acceptance.sh: issue 16 item 4's in-server acceptance of the shipped draft
# head on the GPU machine, at the answer length the offline report scores (768 tokens):
# benchmark/cpu/sp_acceptance.py --workload specbench (the SpecBench-like mix, per category,
# greedy to EOS or NEW_TOKENS) with the default model's real weights, PP=2, bf16, CUDA graphs on.
# The prompts are tokenized on the CPU machine, which has the data packages:
#   .venv/bin/python benchmark/cpu/sp_acceptance.py --workload specbench --prompts 16 \
#       --export-prompt-ids .gpu/specbench16_ids.json      # then carry that file
# Needs the default model's GGUF: eval "$(bash benchmark/gpu/default_model_parts.sh join)" first.
#   PROMPT_IDS=.gpu/specbench16_ids.json NEW_TOKENS=768 TAG=run1 bash benchmark/gpu/sp_acceptance.sh
# Output: $OUT/gpu_sp_acceptance_specbench_$TAG.json and .log.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
gpu_script_env || exit $?
TAG=${TAG:-run1}
PROMPT_IDS=${PROMPT_IDS:-.gpu/specbench16_ids.json}
[ -f "$PROMPT_IDS" ] || { echo "no $PROMPT_IDS: export it on the CPU machine and carry it" >&2; exit 2; }
export SPEXIS_TEST_SERVER_ARGS="${GPU_FLAGS[*]} --dtype bfloat16 --mem-fraction-static 0.25 --max-total-tokens 65536 --cuda-graph-max-bs 64 ${EXTRA:-}"
default_model_ready || exit 5
python3 benchmark/cpu/sp_acceptance.py --workload specbench --prompt-ids "$PROMPT_IDS" \
  --new-tokens "${NEW_TOKENS:-768}" --out "$OUT/gpu_sp_acceptance_specbench_$TAG.json" \
  2>&1 | tee "$OUT/gpu_sp_acceptance_specbench_$TAG.log"
exit "${PIPESTATUS[0]}"
