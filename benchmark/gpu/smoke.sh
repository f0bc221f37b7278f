#!/usr/bin/env bash
# benchmark/gpu/smoke.sh: on a GPU machine, serve MODEL through
# `python3 -m spexis_sglang.launch_server` (SGLang, or the offline site of docs/gpu.md, + this
# repo's python/), wait for /health_generate while checking the server's PID, send one
# /generate, record the answer and /server_info's Spexis counters, stop the server.
#
#   bash benchmark/gpu/smoke.sh MODEL_DIR [extra launch_server args...]
#   e.g. bash benchmark/gpu/smoke.sh benchmark/gpu/configs/smollm2-135m --load-format dummy --mem-fraction-static 0.3
#        bash benchmark/gpu/smoke.sh benchmark/gpu/configs/smollm2-135m --load-format dummy --pp-size 2   # 2 GPUs
#        bash benchmark/gpu/smoke.sh benchmark/gpu/configs/smollm2-135m --load-format dummy --tp-size 2   # 2 GPUs
#
# Env (optional): PORT=30000 HEALTH_TIMEOUT=420 PROMPT=... MAX_NEW_TOKENS=16
#                 TAG=smoke (file names: $OUT/$TAG-server.log, $OUT/$TAG-response.json)
# Exit: 0 /generate answered; 1 server died / not healthy / request failed; 2 bad args; 3 no site.
set -uo pipefail
T0=$SECONDS
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[ $# -ge 1 ] || { echo "usage: bash benchmark/gpu/smoke.sh MODEL_DIR [extra launch_server args...]" >&2; exit 2; }
MODEL=$1; shift
PORT=${PORT:-30000}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-420}
PROMPT=${PROMPT:-The capital of France is}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-16}
TAG=${TAG:-smoke}
LOGDIR=${OUT:-$SPEXIS_REPO/.gpu}; mkdir -p "$LOGDIR"
LOG="$LOGDIR/$TAG-server.log"; RESP="$LOGDIR/$TAG-response.json"
: > "$LOG"

refuse_multicast_flags "$@" || exit 2
gpu_site_env || exit $?
[ "${SPEXIS_LOCAL_CPU:-0}" = 1 ] || [ -e "$CUDA_HOME/lib64/libcudart.so" ] || echo "warning: $CUDA_HOME/lib64/libcudart.so not found; JIT linking may fail" >&2

nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
[ "${SPEXIS_LOCAL_CPU:-0}" = 1 ] || python3 -c "import sys,torch,sglang,sgl_kernel,flashinfer,transformers,spexis_sglang; print('python', sys.version.split()[0], '| torch', torch.__version__, '| sglang', sglang.__version__, '| flashinfer', flashinfer.__version__, '| transformers', transformers.__version__, '| GPUs', torch.cuda.device_count(), torch.cuda.get_device_capability())" \
  || { echo "import check failed" >&2; exit 3; }

trap server_stop EXIT
server_start "$LOG" --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" "$@" || exit 2
server_wait "$PORT" "$HEALTH_TIMEOUT"; READY=$?
READY_S=$((SECONDS - T0))
if [ $READY -ne 0 ]; then
  echo "---- last lines of $LOG"; tail -n 40 "$LOG"
  python3 - "$RESP" "$MODEL" "$*" <<'PY'
import json, sys
json.dump({"ok": False, "stage": "start-up", "model": sys.argv[2], "args": sys.argv[3]}, open(sys.argv[1], "w"), indent=1)
PY
  exit 1
fi

python3 - "$PORT" "$PROMPT" "$MAX_NEW_TOKENS" "$MODEL" "$RESP" "$READY_S" "$*" <<'PY'
import json, os, sys, time, urllib.request
port, prompt, n, model, resp_path, ready_s, args = sys.argv[1:8]
n = int(n)
base = f"http://127.0.0.1:{port}"
skip_tok = "--skip-tokenizer-init" in args.split() or not os.path.isfile(os.path.join(model, "tokenizer.json"))
body = {"sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
if skip_tok:
    body["input_ids"] = [1, 2, 3, 4, 5, 6, 7, 8]
else:
    body["text"] = prompt
def post(path, obj, timeout=300):
    req = urllib.request.Request(base + path, data=json.dumps(obj).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
rec = {"ok": False, "model": model, "args": args, "ready_after_s": int(ready_s), "request": body}
try:
    t = time.time()
    out = post("/generate", body)
    rec["generate_s"] = round(time.time() - t, 3)
    rec["response"] = out
    meta = out.get("meta_info", {})
    rec["ok"] = meta.get("completion_tokens") == n
    with urllib.request.urlopen(base + "/server_info", timeout=60) as r:
        info = json.loads(r.read())
    st = (info.get("internal_states") or [{}])[0]
    rec["spexis"] = st.get("spexis")
    rec["max_total_num_tokens"] = st.get("max_total_num_tokens", info.get("max_total_num_tokens"))
    rec["server_args"] = {k: info.get(k) for k in ("tp_size", "pp_size", "attention_backend", "load_format", "mem_fraction_static", "dtype")}
    print(f"/generate in {rec['generate_s']:.2f} s: prompt_tokens={meta.get('prompt_tokens')} completion_tokens={meta.get('completion_tokens')}")
    print("text:", json.dumps(out.get("text")) if "text" in out else out.get("output_ids"))
    print("spexis counters present:", rec["spexis"] is not None)
except Exception as e:
    rec["error"] = repr(e)
    print("request FAILED:", repr(e))
json.dump(rec, open(resp_path, "w"), indent=1)
sys.exit(0 if rec["ok"] else 1)
PY
RC=$?
[ $RC -eq 0 ] || { echo "---- last lines of $LOG"; tail -n 40 "$LOG"; }
grep -E "Traceback|Error" "$LOG" | grep -vE "helion|openai_harmony|Ignore import error" | head -5
server_stop; trap - EXIT
echo "total $((SECONDS - T0)) s, response in $RESP"
exit $RC
