#!/usr/bin/env bash
# Per-stage decode times with CUDA graphs on one H200: the pipeline simulator's calibration.
#
#   run(kind="nvidia-h200", carry=[".gpu/site.tar.xz"], timeout_s=600,
#       command="bash benchmark/gpu/stage_times.sh")
#
# Llama-3.1-8B- and Qwen3-8B-shaped stages (16/18 layers, then 8/9 layers) with embedding,
# LM head and sampling, dummy weights, bf16, triton attention, graphs captured for
# B = 1..512; contexts 128..8192 (B x ctx <= 256K tokens); then NCCL p2p between two
# processes on the GPU over loopback sockets (the emulated box's link). Stops starting new
# stages when BUDGET seconds (default 430) are spent. $OUT gets stage_times.json and one log
# per stage. Afterwards, here: copy stage_times.json to benchmark/results/gpu/stage_times_h200.json
# and run python benchmark/sim/calibrate.py && python benchmark/sim/validate.py.
# SPEXIS_LOCAL_CPU=1: dry run on a CPU machine (tiny config, no site).
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
gpu_script_env || exit $?
EXTRA=()
if [ "${SPEXIS_LOCAL_CPU:-0}" = 1 ]; then EXTRA+=(--cpu-dry-run); fi
python3 benchmark/gpu/stage_times.py --p2p --budget-s "${BUDGET:-430}" --out "$OUT" "${EXTRA[@]}" "$@" \
  2>&1 | tee "$OUT/stage_times.log"
