#!/usr/bin/env bash
# benchmark/gpu/train_throughput.sh: how long training a draft head takes for an 8B model on
# one H200 -- throughput (tokens/s) and peak memory of each training step (answer generation
# with HF generate, collect's teacher-forced pass, draft-head training in bf16, length
# predictor) for a Llama-3.1-8B-shaped model with DUMMY (random) weights, which cost what real
# ones cost (benchmark/gpu/train_throughput.py). About 3-4 minutes on one H200.
#
#   bash benchmark/gpu/train_throughput.sh                      # the GPU machine (one GPU)
#   SPEXIS_LOCAL_CPU=1 bash benchmark/gpu/train_throughput.sh   # CPU dry run, tiny config
#
# Env: CONFIG (benchmark/gpu/configs/llama-3.1-8b; CPU: .../tiny-llama), TAG (llama8b),
#      EXTRA (more train_throughput.py options). Output: $OUT/gpu_train_throughput_$TAG.json
#      and $OUT/train_throughput_$TAG.log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
gpu_script_env || exit $?
TAG=${TAG:-llama8b}
if [ "${SPEXIS_LOCAL_CPU:-0}" = 1 ]; then
  CONFIG=${CONFIG:-benchmark/gpu/configs/tiny-llama}
  SIZES=(--device cpu --dtype float32 --threads 1 --gen-batch 4 --gen-prompt-len 16
         --gen-new-tokens 8 --tf-batch 4 --tf-seq-len 64 --tf-repeats 2 --draft-seqs 8
         --draft-seq-len 64 --draft-batch-tokens 256)
else
  CONFIG=${CONFIG:-benchmark/gpu/configs/llama-3.1-8b}
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  # 256 sequences x 1024 tokens of draft training: ~260k tokens, the gpu preset's batch budget
  SIZES=(--device cuda --dtype bfloat16)
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
fi
JSON=$OUT/gpu_train_throughput_$TAG.json
# the whole run stays inside one 10-minute device call
timeout 540 python3 benchmark/gpu/train_throughput.py --config "$CONFIG" "${SIZES[@]}" \
  --out "$JSON" ${EXTRA:-} 2>&1 | tee "$OUT/train_throughput_$TAG.log" | grep -v 'it/s\]\|batch/s\]'
rc=${PIPESTATUS[0]}
echo "exit $rc; $JSON"
exit "$rc"
