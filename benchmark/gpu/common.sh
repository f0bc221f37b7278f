# benchmark/gpu/common.sh: shared helpers for the GPU scripts (source it; bash only).
#
#   source benchmark/gpu/common.sh
#   gpu_site_env              # extract .gpu/site.tar.xz once, export PYTHONPATH & JIT caches
#   gpu_script_env            # the above, then cd to the repository, $OUT, NUM_GPUS; one GPU: MPS
#   mps_start / mps_stop      # the MPS daemon (gpu_script_env starts it for SPEXIS_SHARE_GPU=mps)
#   default_model_ready       # the default model converted from the GGUF joined on this machine
#   server_start LOG ARGS...  # python3 -m spexis_sglang.launch_server + required GPU flags; sets SP
#   server_wait PORT [TIMEOUT]# wait for /health_generate while checking that $SP is alive
#   server_stop               # SIGTERM the server (it stops its children), then SIGKILL leftovers
#
# The site prefix is the one of docs/gpu.md's offline-site appendix ("README §N" below: its
# sections); PYTHONPATH also gets the
# repository's python/ dir (spexis_sglang is not pip-installed on the GPU machine).
# NVLink multicast stays off (README §4): flags that could enable it are refused.

SPEXIS_REPO=${SPEXIS_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# Required on the offline H200 machines (README §3), one line in gpu_flags.txt (read by the
# Python benchmarks too). CUDA graphs stay on (seen working 2026-12-01); custom all-reduce
# too, unless it was seen failing there.
read -ra GPU_FLAGS < "$SPEXIS_REPO/benchmark/gpu/gpu_flags.txt"
# SPEXIS_LOCAL_CPU=1: dry run of the scripts on a CPU machine (no site, no GPU flags; the
# launcher then picks its CPU defaults). Never set on the GPU machine.
if [ "${SPEXIS_LOCAL_CPU:-0}" = 1 ]; then GPU_FLAGS=(); fi

gpu_site_env() {
  local G=$SPEXIS_REPO/.gpu T0=$SECONDS
  if [ "${SPEXIS_LOCAL_CPU:-0}" = 1 ]; then
    export PYTHONPATH="$SPEXIS_REPO/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    return 0
  fi
  if [ -f "$G/site.tar.xz" ] && [ "$(sha256sum < "$G/site.tar.xz")" != "$(cat "$G/site/.stamp" 2>/dev/null)" ]; then
    echo "extracting $G/site.tar.xz ..."
    rm -rf "$G/site" && mkdir -p "$G/site" && tar -xJf "$G/site.tar.xz" -C "$G/site" \
      && sha256sum < "$G/site.tar.xz" > "$G/site/.stamp" || { echo "extraction failed" >&2; return 3; }
    echo "extracted in $((SECONDS - T0)) s"
  fi
  [ -f "$G/site/.stamp" ] || { echo "no SGLang site in $G: carry .gpu/site.tar.xz in this call" >&2; return 3; }
  export PYTHONPATH="$G/site:$SPEXIS_REPO/python${PYTHONPATH:+:$PYTHONPATH}"
  export CUDA_HOME=/usr/local/cuda-13.0 TVM_FFI_CACHE_DIR="$G/jit/tvm-ffi" \
         FLASHINFER_WORKSPACE_BASE="$G/jit" PYTHONUNBUFFERED=1
  : "${NCCL_NVLS_ENABLE:=0}"; export NCCL_NVLS_ENABLE
  [ "$NCCL_NVLS_ENABLE" = 0 ] || { echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE: leave it 0" >&2; return 2; }
  return 0
}

# gpu_script_env: what every GPU script does first: the site, the repository as the working
# directory, $OUT (default /tmp/out), NUM_GPUS, and with one GPU all PP stages on it: by default
# an emulated multi-GPU box (SPEXIS_SHARE_GPU=mps: an MPS daemon started here and stopped when
# the script exits, each rank a client with its share of the SMs, kernels of the ranks at
# once; NCCL over loopback sockets; srt/hooks.share_one_gpu). SPEXIS_SHARE_GPU=1 instead: plain
# sharing, the ranks take turns (correctness runs only: such timings say nothing).
gpu_script_env() {
  gpu_site_env || return $?
  cd "$SPEXIS_REPO" || return 3
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  NUM_GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$NUM_GPUS" = 1 ]; then
    export SPEXIS_SHARE_GPU=${SPEXIS_SHARE_GPU:-mps}
    # gloo (SGLang's CPU group) on loopback, for every server (share_one_gpu sets it as well)
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
    if [ "$SPEXIS_SHARE_GPU" = mps ]; then mps_start || return 4; trap mps_stop EXIT; fi
  fi
  return 0
}

# mps_start / mps_stop: the NVIDIA MPS control daemon of this machine (runs as any user; the
# control binary is not on PATH there). Every CUDA process started after mps_start with these
# variables is an MPS client.
MPS_CONTROL=${MPS_CONTROL:-$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)}
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mps-pipe}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/mps-log}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if [ -S "$CUDA_MPS_PIPE_DIRECTORY/control" ] && echo get_server_list | "$MPS_CONTROL" >/dev/null 2>&1; then
    echo "MPS daemon already running"; return 0
  fi
  "$MPS_CONTROL" -d || { echo "MPS daemon did not start ($MPS_CONTROL)" >&2; return 1; }
  sleep 1
  echo "MPS daemon started (each PP rank a client with its share of the SMs)"
}
mps_stop() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  echo quit | "$MPS_CONTROL" >/dev/null 2>&1 && echo "MPS daemon stopped"
  return 0
}

# default_model_ready: the default model converted under $SPEXIS_CACHE_DIR (default
# /tmp/spexis-cache) from the GGUF that default_model_parts.sh joined; prints its directory
default_model_ready() {
  export SPEXIS_CACHE_DIR=${SPEXIS_CACHE_DIR:-/tmp/spexis-cache}
  python3 -c 'from spexis_sglang.default_model import ensure_default_model as e; print(e())'
}

refuse_multicast_flags() {
  local a
  for a in "$@"; do
    case "$a" in
      *nvls*|*symm-mem*|*symm_mem*|*mnnvl*)
        echo "refusing '$a': it can enable NVLink multicast, which must stay off here" >&2; return 2 ;;
    esac
  done
}

# server_start LOG ARGS... : starts the server in the background; sets SP (its PID).
server_start() {
  local log=$1; shift
  refuse_multicast_flags "$@" || return 2
  echo "+ python3 -m spexis_sglang.launch_server ${GPU_FLAGS[*]} $*" | tee -a "$log"
  python3 -m spexis_sglang.launch_server "${GPU_FLAGS[@]}" "$@" >> "$log" 2>&1 &
  SP=$!
  echo "server pid $SP, log $log"
}

# server_wait PORT [TIMEOUT_S]: 0 when healthy, 1 when the server died or timed out.
server_wait() {
  local port=$1 limit=${2:-420}
  python3 - "$SP" "$port" "$limit" <<'PY'
import os, sys, time, urllib.request
pid, port, limit = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
t0 = time.time()
while time.time() - t0 < limit:
    try:
        os.kill(pid, 0)
        if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            raise OSError
    except OSError:
        print(f"server process {pid} DIED after {time.time() - t0:.0f} s"); sys.exit(1)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=30) as r:
            if r.status == 200:
                print(f"server healthy after {time.time() - t0:.0f} s"); sys.exit(0)
    except Exception:
        pass
    time.sleep(2)
print(f"server NOT healthy after {limit:.0f} s"); sys.exit(1)
PY
}

_descendants() { local c; for c in $(pgrep -P "$1" 2>/dev/null); do echo "$c"; _descendants "$c"; done; }

# server_stop: SIGTERM the server (launch_server shuts its children down), wait up to 30 s,
# then SIGKILL the server and the descendants it had.
server_stop() {
  [ -n "${SP:-}" ] || return 0
  if kill -0 "$SP" 2>/dev/null; then
    local kids p; kids=$(_descendants "$SP")
    kill -TERM "$SP" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$SP" 2>/dev/null || break; sleep 1; done
    for p in "$SP" $kids; do kill -0 "$p" 2>/dev/null && kill -KILL "$p" 2>/dev/null; done
  fi
  wait "$SP" 2>/dev/null
  echo "server $SP stopped"
  SP=
}
