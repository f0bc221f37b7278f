#!/usr/bin/env bash
# benchmark/serving/serving_gpu.sh: serving under load on a GPU machine (one GPU: the emulated
# box of common.sh, each PP rank an MPS client). Runs
# benchmark/serving/serving.py (one server per configuration, one after another; Poisson rate
# sweeps through SGLang's bench_serving) with the GPU flags of benchmark/gpu/common.sh, CUDA
# graphs ON for every configuration (decode graphs up to MAX_BS = --max-running-requests, which
# covers SP's batch of all running requests), the same KV budget (--max-total-tokens KV) for
# all, within BUDGET seconds.
#
# MODE=dummy (default): MODEL = an 8B-shaped config of configs/ with dummy weights; SP with an
#   untrained head and BENCHMARK forced acceptance THETA (labelled; never measured acceptance);
#   the committed lengths workload benchmark/serving/workloads/$WORKLOAD.json replayed with
#   synthetic prompts and a synthetic tokenizer over the model's vocabulary (ignore_eos: every request
#   runs to its recorded output length). sp-alpha there shows alpha's cost only: forced
#   acceptance does not depend on the draft's confidence, so dropping drafts buys nothing.
#   sp-la (not in the default CONFIGS): sp (alpha 0) with look-ahead admission fed by the
#   BENCHMARK length oracle ORACLE (--spexis-benchmark-length-oracle; default paper-l70:
#   the true remaining lengths degraded to the paper's Table 4 precision/recall; 'ours' = the
#   shipped predictor's calibration), as no length predictor exists for these shapes.
# MODE=real: the default model (SmolLM2-135M-Instruct, real weights; its GGUF joined by
#   default_model_parts.sh), bundled exit-15 head and length predictor, real acceptance, the
#   chosen alpha (the head artifact's, 0.3), prompts with text from .gpu/workloads/ (built here
#   with serving.py --export-workload ... --with-text, carried), EOS honoured: the Figure-8
#   breakdown with real acceptance and real length predictions.
#
# Env: MODE, MODEL (llama-3.1-8b), WORKLOAD (sharegpt | specbench | long, or a path),
#      CONFIGS (dummy: pp1,plain,tp,sp,sp-alpha; real: plain,sp,sp-alpha,sp-la,pp1),
#      RATES (req/s, comma list; a probe: RATES=4,1000 gives each config's burst capacity),
#      NUM_PROMPTS (requests per rate; default: the whole workload), THETA (0.76), ALPHA (0.3 /
#      auto: the head artifact's; online: the server's --spexis-alpha auto), ORACLE (dummy sp-la: paper-l70 | paper-q32 | ours | perfect | P/R), KV (140000
#      dummy / 60000 real), MAX_BS (256), BUDGET (540 s), TAG, EXTRA (more serving.py arguments).
#      Output: $OUT/serving_$TAG.json and .png.
# Commands: benchmark/README.md, "Serving under load".
# CPU dry runs (no GPU): SPEXIS_LOCAL_CPU=1 MODEL=tiny-llama RATES=2 NUM_PROMPTS=4 \
#   CONFIGS=plain,sp,sp-alpha KV=4096 MAX_BS=8 EXTRA='--max-output-len 8' OUT=/tmp/o bash benchmark/serving/serving_gpu.sh
# SPEXIS_LOCAL_CPU=1 SPEXIS_CACHE_DIR=~/.cache/spexis MODE=real CONFIGS=sp-la RATES=2 NUM_PROMPTS=3 \
#   KV=4096 MAX_BS=8 EXTRA='--max-output-len 8' OUT=/tmp/o bash benchmark/serving/serving_gpu.sh
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/../gpu/common.sh"
gpu_script_env || exit $?  # the site; one GPU: the emulated box (MPS clients)
cd "$SPEXIS_REPO"
MODE=${MODE:-dummy}
MODEL=${MODEL:-llama-3.1-8b}
WORKLOAD=${WORKLOAD:-sharegpt}
MAX_BS=${MAX_BS:-256}
BUDGET=${BUDGET:-540}
THETA=${THETA:-0.76}
TAG=${TAG:-${MODE}_${WORKLOAD##*/}}
TAG=${TAG%.json}
export OUT=${OUT:-$SPEXIS_REPO/.gpu/out}; mkdir -p "$OUT"
GRAPHS=(--max-running-requests "$MAX_BS")
[ "${SPEXIS_LOCAL_CPU:-0}" = 1 ] || GRAPHS+=(--cuda-graph-max-bs "$MAX_BS")
case $MODE in
  dummy)
    CONFIGS=${CONFIGS:-pp1,plain,tp,sp,sp-alpha}
    KV=${KV:-140000}
    ALPHA=${ALPHA:-0.3}
    [ -f "$WORKLOAD" ] || WORKLOAD=benchmark/serving/workloads/$WORKLOAD.json
    DTYPE=bfloat16; [ "${SPEXIS_LOCAL_CPU:-0}" = 1 ] && DTYPE=float32
    SERVER="${GPU_FLAGS[*]} --model-path benchmark/gpu/configs/$MODEL --load-format dummy --dtype $DTYPE
      --context-length 4096 --max-total-tokens $KV ${GRAPHS[*]}"
    ORACLE=${ORACLE:-paper-l70}
    LABEL="$MODEL dummy, forced theta $THETA,"
    case ",$CONFIGS," in *,sp-la,*) LABEL="$LABEL sp-la: BENCHMARK length oracle $ORACLE,";; esac
    SP=(--draft-head random:0 --sp-args "--spexis-benchmark-force-accept $THETA"
        --length-oracle "$ORACLE" --label "$LABEL")
    ;;
  real)
    CONFIGS=${CONFIGS:-plain,sp,sp-alpha,sp-la,pp1}
    KV=${KV:-60000}
    ALPHA=${ALPHA:-auto}
    [ -f "$WORKLOAD" ] || WORKLOAD=.gpu/workloads/${WORKLOAD}_text.json
    [ -f "$WORKLOAD" ] || { echo "no $WORKLOAD: build it with serving.py --export-workload --with-text where the data packages are" >&2; exit 3; }
    export SPEXIS_CACHE_DIR=${SPEXIS_CACHE_DIR:-/tmp/spexis-cache}
    python3 -c 'from spexis_sglang.default_model import ensure_default_model as e; print(e())' || exit 5
    DTYPE=bfloat16; [ "${SPEXIS_LOCAL_CPU:-0}" = 1 ] && DTYPE=auto
    SERVER="${GPU_FLAGS[*]} --dtype $DTYPE --max-total-tokens $KV ${GRAPHS[*]}"
    SP=(--draft-head bundled --label "default model, real weights,")
    ;;
  *) echo "MODE must be dummy or real" >&2; exit 2 ;;
esac
SERVER=$(echo $SERVER)  # one line in the result
refuse_multicast_flags $SERVER ${EXTRA:-} || exit 2
[ -n "${RATES:-}" ] || { echo "set RATES (a probe first: RATES=4,1000)" >&2; exit 2; }
NP=(); [ -n "${NUM_PROMPTS:-}" ] && NP=(--num-prompts "$NUM_PROMPTS")
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader 2>/dev/null
T0=$SECONDS
python3 benchmark/serving/serving.py --pp-size "${PP:-2}" --workload "$WORKLOAD" "${NP[@]}" \
  --configs "$CONFIGS" --rates "$RATES" --server-args "$SERVER" --alpha "$ALPHA" "${SP[@]}" \
  --time-budget "$BUDGET" --min-config-s 150 --out "$OUT/serving_$TAG.json" ${EXTRA:-}
RC=$?
echo "=== serving.sh done in $((SECONDS - T0)) s (exit $RC)"
exit $RC
