#!/usr/bin/env bash
# benchmark/gpu/train_artifacts.sh: issue #4's shipped artifacts on the GPU machine, i.e.
# `python -m spexis_sglang.train all --preset gpu` cut into its steps so that it fits one
# 10-minute device call and uses every GPU:
#   * collect: one worker process per GPU (--collect-worker K/N), then a plain collect merges;
#   * train-draft: one exit layer per GPU, in parallel (train-length beside the first);
#   * calibrate, evaluate, export.
# The data are the same as one `all` run makes (tests/train: parallel workers record the same
# shards); seeds are fixed. The prompt sets travel frozen (the machine has no data packages):
#   here:   python -m spexis_sglang.train prompts --preset gpu --prompts-file .gpu/train/prompts_gpu.json
#           xz -9 -k .gpu/train/prompts_gpu.json
#   there:  carry .gpu/train/prompts_gpu.json.xz; the default model's GGUF joined first
#           (benchmark/gpu/default_model_parts.sh join).
# Output: $OUT/train_artifacts.tar.gz (artifacts/, results/ = quality.*, timings.json,
# evaluation.json, logs/). Env: PRESET (gpu), DEVICE (cuda; cpu for a dry run here),
# WORKERS (default: the GPU count), WORK (/tmp/spexis-train), EXTRA (more train options).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then gpu_site_env || exit $?; else export PYTHONPATH=$SPEXIS_REPO/python${PYTHONPATH:+:$PYTHONPATH}; fi
cd "$SPEXIS_REPO"
PRESET=${PRESET:-gpu}
WORK=${WORK:-/tmp/spexis-train}
OUT=${OUT:-/tmp/out}
PROMPTS_XZ=${PROMPTS_XZ:-.gpu/train/prompts_gpu.json.xz}
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
WORKERS=${WORKERS:-$((NGPU > 0 ? NGPU : 1))}
R=$WORK/report
mkdir -p "$WORK" "$R/logs" "$OUT"
T0=$SECONDS
[ -f "$PROMPTS_XZ" ] || { echo "no $PROMPTS_XZ (see the header)" >&2; exit 2; }
xz -dc "$PROMPTS_XZ" > "$WORK/prompts.json" || exit 2
python3 -c 'from spexis_sglang.default_model import ensure_default_model as e; print(e())' || exit 5
echo "model ready in $((SECONDS - T0)) s; $WORKERS collect workers"

ARGS=(--preset "$PRESET" --device "$DEVICE" --work-dir "$WORK" --prompts-file "$WORK/prompts.json"
  --artifact-dir "$R/artifacts" --results-dir "$R/results" ${EXTRA:-})
# torch CPU threads per process: the cores shared by the processes that run at once (each
# would take one per core; three on 32 cores made training ~4x slower in session 3)
NCPU=$(nproc)
threads() { echo $((NCPU / $1 > 0 ? NCPU / $1 : 1)); }
train() { python3 -m spexis_sglang.train "$@" "${ARGS[@]}"; }
CKPT=$WORK/checkpoints
gpu() { [ "$DEVICE" = cuda ] && echo $(($1 % WORKERS)) || echo ""; }
step_failed() { echo "FAILED: $1 (logs in $R/logs)" >&2; tail -n 30 "$R/logs/$2" >&2; finish 1; }
finish() {
  cp -f "$WORK/timings.json" "$WORK/evaluation.json" "$R/" 2>/dev/null
  tar -czf "$OUT/train_artifacts.tar.gz" -C "$R" .
  echo "=== train_artifacts done in $((SECONDS - T0)) s (exit $1)"
  exit "$1"
}

pids=()
for ((k = 0; k < WORKERS; k++)); do
  CUDA_VISIBLE_DEVICES=$(gpu $k) train collect --collect-worker "$k/$WORKERS" \
    --threads "$(threads "$WORKERS")" > "$R/logs/collect-$k.log" 2>&1 &
  pids+=($!)
done
for k in "${!pids[@]}"; do wait "${pids[$k]}" || step_failed "collect worker $k" "collect-$k.log"; done
train collect > "$R/logs/collect-merge.log" 2>&1 || step_failed "collect merge" collect-merge.log
echo "collected in $((SECONDS - T0)) s"

EXITS=$(python3 -c "from spexis_sglang.train.pipeline import make_config as m; print(' '.join(map(str, m('$PRESET', model_path='-', work_dir='-').exits)))")
# a step whose checkpoint exists is not run again (a second call resumes after a time-out)
TODO=()
for ex in $EXITS; do [ -f "$CKPT/draft-exit$ex.pt" ] || TODO+=("train-draft-$ex"); done
[ -f "$CKPT/length.pt" ] || TODO+=(train-length)
pids=(); names=()
i=0
for name in "${TODO[@]}"; do
  case $name in
    train-draft-*) cmd=(train-draft --exits "${name#train-draft-}") ;;
    *) cmd=(train-length) ;;
  esac
  CUDA_VISIBLE_DEVICES=$(gpu $i) train "${cmd[@]}" --threads "$(threads ${#TODO[@]})" \
    > "$R/logs/$name.log" 2>&1 &
  pids+=($!); names+=("$name"); i=$((i + 1))
done
for k in "${!pids[@]}"; do wait "${pids[$k]}" || step_failed "${names[$k]}" "${names[$k]}.log"; done
echo "trained in $((SECONDS - T0)) s"
for s in calibrate evaluate export; do
  CUDA_VISIBLE_DEVICES=$(gpu 0) train $s > "$R/logs/$s.log" 2>&1 || step_failed $s $s.log
done
tail -n 3 "$R/logs/evaluate.log"
finish 0
