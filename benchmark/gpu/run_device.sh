#!/usr/bin/env bash
# benchmark/gpu/run_device.sh: the smoke test and the decode-throughput sweep in one go, for
# any GPU count, within BUDGET seconds.
#   1. foundation smoke: the SmolLM2-135M config with dummy weights served through
#      spexis_sglang.launch_server, one /generate each for PP=1, and with 2+ GPUs also
#      --pp-size 2 and --tp-size 2                -> $OUT/foundation_smoke.json, smoke_logs.tar.gz
#   2. decode throughput for $MODELS within what is left of $BUDGET
#      (decode_throughput.py; configurations needing more GPUs than present are "not run")
#                                                  -> $OUT/decode_throughput.json, profile_*.json,
#                                                     server_logs.tar.gz
# With run.log that is at most 8 files in $OUT for one model (OUT defaults to /tmp/out).
#
# One GPU, about 7-8 minutes (the first server start JIT-compiles kernels):
#   OUT=/tmp/out bash benchmark/gpu/run_device.sh 2>&1 | tee /tmp/out/run.log
# Two GPUs: 7 servers per model take longer than the default BUDGET; split them, e.g.
#   KINDS=pp1,pp,tp MODELS=llama-3.1-8b bash benchmark/gpu/run_device.sh         # + smoke
#   SMOKE= KINDS=sp MODELS=llama-3.1-8b bash benchmark/gpu/run_device.sh         # 3 SP servers
#
# Env: BUDGET (s for the whole script, default 500), MODELS (default "llama-3.1-8b qwen3-8b"),
#      KINDS (pp1,pp,tp,sp), THETAS (0.6,0.76,0.9), BATCHES (16,32,64,128,256,512),
#      SMOKE (variants among "pp1 pp2 tp2"; default pp1, plus pp2 tp2 with 2+ GPUs; empty = none),
#      NUM_GPUS (default: nvidia-smi -L count), EXTRA (more decode_throughput.py arguments).
# CPU dry run of the whole script (no GPU): SPEXIS_LOCAL_CPU=1 NUM_GPUS=1 MODELS=tiny-llama \
#   BATCHES=2,4 EXTRA="--local-cpu --dtype float32 --input-len 16 --output-len 40 --short-output-len 8" \
#   OUT=/tmp/o bash benchmark/gpu/run_device.sh
set -uo pipefail
T0=$SECONDS
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
BUDGET=${BUDGET:-500}
MODELS=${MODELS:-llama-3.1-8b qwen3-8b}
KINDS=${KINDS:-pp1,pp,tp,sp}
THETAS=${THETAS:-0.6,0.76,0.9}
BATCHES=${BATCHES:-16,32,64,128,256,512}
export OUT=${OUT:-$SPEXIS_REPO/.gpu/out}; mkdir -p "$OUT"

gpu_site_env || exit $?
NGPU=${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')}
nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv,noheader
if [ -z "${SMOKE+x}" ]; then SMOKE=pp1; [ "$NGPU" -ge 2 ] && SMOKE="pp1 pp2 tp2"; fi

if [ -n "$SMOKE" ]; then
  SM=/tmp/spexis-smoke-$$; rm -rf "$SM"; mkdir -p "$SM"
  for v in $SMOKE; do
    case $v in pp1) A=();; pp2) A=(--pp-size 2);; tp2) A=(--tp-size 2);; *) echo "unknown SMOKE variant $v"; continue;; esac
    echo "=== foundation smoke $v ($((SECONDS - T0)) s)"
    OUT=$SM TAG=smoke-$v PORT=30000 HEALTH_TIMEOUT=300 bash "$HERE/smoke.sh" "$HERE/configs/smollm2-135m" \
      --load-format dummy --mem-fraction-static 0.3 "${A[@]}"
    echo "=== smoke $v exit $? ($((SECONDS - T0)) s)"
  done
  python3 - "$SM" "$OUT/foundation_smoke.json" "$NGPU" <<'PY'
import glob, json, os, sys
sm, out, ngpu = sys.argv[1], sys.argv[2], int(sys.argv[3])
res = {"num_gpus": ngpu, "launcher": "python3 -m spexis_sglang.launch_server", "variants": {}}
for p in sorted(glob.glob(os.path.join(sm, "smoke-*-response.json"))):
    tag = os.path.basename(p)[len("smoke-"):-len("-response.json")]
    rec = json.load(open(p))
    log = p.replace("-response.json", "-server.log")
    try:
        rec["server_log_tail"] = open(log, errors="replace").read().splitlines()[-25:]
    except OSError:
        pass
    res["variants"][tag] = rec
json.dump(res, open(out, "w"), indent=1)
print("foundation smoke:", {k: v.get("ok") for k, v in res["variants"].items()})
PY
  tar -czf "$OUT/smoke_logs.tar.gz" -C "$SM" . && rm -rf "$SM"
fi

LEFT=$((BUDGET - (SECONDS - T0)))
MARGS=(); for m in $MODELS; do MARGS+=(--model "$m"); done
echo "=== decode throughput, $LEFT s left"
python3 "$HERE/decode_throughput.py" "${MARGS[@]}" --kinds "$KINDS" --thetas "$THETAS" \
  --batches "$BATCHES" --time-budget "$LEFT" --min-server-s 100 --min-batch-s 12 --out "$OUT" \
  --num-gpus "$NGPU" ${EXTRA:-}
RC=$?
echo "=== done in $((SECONDS - T0)) s (throughput exit $RC)"
exit $RC
