#!/usr/bin/env bash
# benchmark/gpu/pipeline_box.sh: SP against stock PP on the emulated two-GPU box (one H200 split
# by NVIDIA MPS: each PP rank a client with half the SMs, both ranks' kernels at once; they
# share the GPU's memory bandwidth, which two GPUs would not). Steps (STEPS, default all):
#   probe     benchmark/gpu/transport_probe.py: one message between two ranks by size, NCCL over
#             loopback sockets (what two ranks on one GPU use by default) against CUDA IPC
#             (SPEXIS_PP_TRANSPORT=ipc, srt/stage_link.py) and gloo metadata
#   equality  benchmark/gpu/sp_equality_dummy.py: greedy SP (untrained head: nearly every row
#             redone on the device) equals plain SGLang, dummy weights, deterministic kernels
#   decode    benchmark/gpu/decode_throughput.py for $MODELS: $KINDS at $BATCHES (and
#             $EXTRA_INPUT sweeps on the same servers), Θ = $THETAS, one KV budget, graphs on;
#             the table of pipeline_ratio.py last (SP/PP beside the ideal ratio);
#             PROFILE_BATCHES=B1,B2: each server's torch.profiler trace at these B as well
#             (timeline.py summarises every rank's host steps and device gaps per forward:
#             timeline.json; the traces in traces.tar.gz, for https://ui.perfetto.dev)
# SPEXIS_PHASE_TIMERS=1 times stock PP's loop by phase too (a few µs per step): stage 0's in
# each point's stock_phase_ms_per_iteration; every later rank's, stock and SP, in later_stages.
# TRANSPORT=ipc (default; the same link for stock PP and SP), packed (stage_link.PackedLink:
# one NCCL send a message, its layout over a local pipe) or nccl (SGLang's own). The IPC
# transport is used only if the probe's IPC round trip worked on this machine (else NCCL, said so).
# Output under $OUT: transport_probe.json, sp_equality_dummy.json, decode_throughput.json,
# server_logs.tar.gz, pipeline_box.log (tee it there).
#   run(carry=[".gpu/site.tar.xz"], timeout_s=600,
#       command="set -o pipefail; bash benchmark/gpu/pipeline_box.sh 2>&1 | tee $OUT/pipeline_box.log")
set -uo pipefail
T0=$SECONDS
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
gpu_script_env || exit $?
STEPS=${STEPS:-probe equality decode}
TRANSPORT=${TRANSPORT:-ipc}
MODELS=${MODELS:-llama-3.1-8b}
KINDS=${KINDS:-pp1,pp,ppa,sp,spauto}
THETAS=${THETAS:-0.76,0.6}
BATCHES=${BATCHES:-16,32,64,128,256,512}
BUDGET=${BUDGET:-480}
echo "GPUs: $NUM_GPUS, share mode ${SPEXIS_SHARE_GPU:-none}, transport $TRANSPORT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [[ " $STEPS " == *" probe "* ]]; then
  echo "=== probe ($((SECONDS - T0)) s)"
  timeout 240 python3 "$HERE/transport_probe.py" --out "$OUT/transport_probe.json"
  if [ "$TRANSPORT" = ipc ] && ! python3 -c "import json,sys; d=json.load(open('$OUT/transport_probe.json')); sys.exit('ipc' not in d['one_way_s'])"; then
    echo "CUDA IPC failed in the probe: NCCL over sockets instead"; TRANSPORT=nccl
  fi
fi
export SPEXIS_PP_TRANSPORT=$TRANSPORT  # nccl: SGLang's own for SP too (its default: packed)

RC=0
if [[ " $STEPS " == *" equality "* ]]; then
  echo "=== equality ($((SECONDS - T0)) s)"
  timeout 400 python3 "$HERE/sp_equality_dummy.py" --model "${EQ_MODEL:-llama-3.1-8b}" \
    --out "$OUT/sp_equality_dummy.json" || RC=1
fi

if [[ " $STEPS " == *" decode "* ]]; then
  LEFT=$((BUDGET - (SECONDS - T0)))
  echo "=== decode throughput, $LEFT s left ($((SECONDS - T0)) s)"
  MARGS=(); for m in $MODELS; do MARGS+=(--model "$m"); done
  XARGS=(); for x in ${EXTRA_INPUT:-}; do XARGS+=(--extra-input "$x"); done
  # graphs for exactly the batches measured (SP: B rows, stock PP: B/2 a micro-batch) and a
  # few small ones: capturing every bucket up to 512 took ~40 s per rank at start-up
  XARGS+=(--server-arg=--cuda-graph-bs); for b in ${GRAPH_BS:-1 2 4 8 16 32 64 128 256 512}; do XARGS+=("--server-arg=$b"); done
  if [ -n "${PROFILE_BATCHES:-}" ]; then XARGS+=(--torch-profile-batches "$PROFILE_BATCHES"); fi
  # shellcheck disable=SC2086
  python3 "$HERE/decode_throughput.py" "${MARGS[@]}" --kinds "$KINDS" --thetas "$THETAS" \
    --batches "$BATCHES" "${XARGS[@]}" --stages 2 --num-gpus 2 --time-budget "$LEFT" \
    --min-server-s 70 --min-batch-s 8 --max-total-tokens "${KV:-160000}" \
    --context-length "${CONTEXT:-4096}" --out "$OUT" ${EXTRA:-} || RC=1
  rm -f "$OUT"/profile_*.json  # the planner's input: not needed from this box
  if [ -d "$OUT/traces" ]; then
    python3 "$HERE/timeline.py" "$OUT/traces" --out "$OUT/timeline.json"
    tar -C "$OUT" -czf "$OUT/traces.tar.gz" traces && rm -rf "$OUT/traces"
  fi
fi
echo "=== done in $((SECONDS - T0)) s (exit $RC)"
exit $RC
