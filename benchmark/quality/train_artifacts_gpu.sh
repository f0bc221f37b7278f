#!/usr/bin/env bash
# benchmark/quality/train_artifacts_gpu.sh: the draft heads and length predictor on a GPU machine:
# `python -m spexis_sglang.train all --preset P` cut into its steps so that each part fits a
# bounded call (END_S) and keeps the GPUs busy:
#   * collect: WORKERS worker processes (--collect-worker K/N, worker K on GPU K % NGPU; more
#     workers than GPUs share one: HF generate on a 135M model is launch-bound), then a plain
#     collect merges;
#   * train: both draft exits and the length predictor(s) in parallel, each on GPU i % NGPU;
#   * calibrate, evaluate, export per length-predictor variant; check-artifacts (the shipped
#     artifacts on this run's data) and compare (new vs shipped in one report).
# PHASE=collect | train | all (default): the collect and train halves in separate calls of
# one warm machine (the work dir survives between them). Steps whose output exists are
# skipped, so a call that ran out of time is resumed by running the same PHASE again.
# With COLLECT_END_S, collect workers start no shard that would end later than that many
# seconds after this script started (left for a resumed collect call); the merge then writes
# the sets with what exists (PARTIAL in the report's data lines) so that training can go on.
# The data are the same as one `all` run makes (tests/train: parallel workers record the same
# shards); seeds are fixed. The prompt sets travel frozen (the machine has no data packages):
#   here:   python -m spexis_sglang.train prompts --preset P --prompts-file .gpu/train/prompts_P.json
#           xz -9 -k .gpu/train/prompts_P.json
#   there:  .gpu/train/prompts_P.json.xz copied over; the default model converted first
#           (python -m spexis_sglang.default_model); commands: benchmark/quality/README.md.
# Collect backend: the preset's (gpu-long: sglang) or COLLECT_BACKEND=hf|sglang. With sglang ONE
# collect process starts ONE spexis_sglang.launch_server (bfloat16, CUDA graphs, the GPU flags of
# common.sh), sends every prompt of a set as token ids in one request batch, stops the server,
# then runs the fp32 HF teacher-forced pass over length-sorted full sequences (WORKERS unused).
# PHASE=all with END_S (default 560 for PHASE=all, 0 = none): a watchdog stops whatever still
# runs END_S - 15 s after the start and packs the tarball with what finished (exit 124); the
# collect deadline then defaults to COLLECT_END_S=330 so that training gets time.
# Output: $OUT/train_artifacts.tar.gz (artifacts/, artifacts-<tag>/, results/ = quality*.*,
# timings.json, evaluation*.json, artifact_check.json, logs/). Env: PRESET (gpu), PHASE,
# DEVICE (cuda; cpu for a dry run here), WORKERS (default: the GPU count), COLLECT_END_S,
# LENGTH_VARIANTS ("tag=features[@final] ...", default "tg=tokens_generated ceil=@final";
# "@final": the length predictor reads the last hidden state after the final norm, a ceiling
# for any hidden-state predictor, evaluated but not exported; "" = none besides the preset's
# own), COLLECT_BACKEND, END_S, WORK (/tmp/spexis-train), EXTRA (more train options), PROMPTS_XZ.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/../gpu/common.sh"
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then gpu_site_env || exit $?; else export PYTHONPATH=$SPEXIS_REPO/python${PYTHONPATH:+:$PYTHONPATH}; fi
cd "$SPEXIS_REPO"
PRESET=${PRESET:-gpu}
PHASE=${PHASE:-all}
WORK=${WORK:-/tmp/spexis-train}
OUT=${OUT:-/tmp/out}
PROMPTS_XZ=${PROMPTS_XZ:-.gpu/train/prompts_$PRESET.json.xz}
[ -f "$PROMPTS_XZ" ] || [ "$PRESET" != gpu ] || PROMPTS_XZ=.gpu/train/prompts_gpu.json.xz
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
WORKERS=${WORKERS:-$((NGPU > 0 ? NGPU : 1))}
END_S=${END_S:-$([ "$PHASE" = all ] && echo 560 || echo 0)}
COLLECT_END_S=${COLLECT_END_S:-$([ "$END_S" -gt 0 ] && echo $((END_S * 59 / 100)) || echo 0)}
LENGTH_VARIANTS=${LENGTH_VARIANTS-tg=tokens_generated ceil=@final}
COLLECT_BACKEND=${COLLECT_BACKEND:-$(PYTHONPATH=$SPEXIS_REPO/python${PYTHONPATH:+:$PYTHONPATH} python3 -c "from spexis_sglang.train.pipeline import PRESETS as P; print(P['$PRESET'].get('collect_backend', 'hf'))" 2>/dev/null || echo hf)}
SHIPPED=${SHIPPED:-python/spexis_sglang/artifacts/smollm2-135m-instruct}
# the converted model under the work dir's parent: it survives between the calls with it
export SPEXIS_CACHE_DIR=${SPEXIS_CACHE_DIR:-$(dirname "$WORK")/spexis-cache}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
R=$WORK/report
mkdir -p "$WORK" "$R/logs" "$OUT"
T0=$SECONDS
START_EPOCH=$(date +%s)
case $PHASE in collect|train|all) ;; *) echo "PHASE must be collect, train or all" >&2; exit 2 ;; esac
# the hard time guard: at END_S - 15 s the watchdog stops every descendant of this script
# (steps, the collect server; by PID, deepest first) and signals it; the trap packs the tarball
MAIN_PID=$$
rm -f "$WORK/.time-guard"
on_time_out() { trap - TERM; echo "=== time guard: stopped at $((SECONDS - T0)) s; packing what finished"; finish 124; }
if [ "$END_S" -gt 0 ]; then
  trap on_time_out TERM
  (
    sleep $((END_S - 15))
    echo "=== time guard: END_S=$END_S reached, stopping the running steps" >&2
    touch "$WORK/.time-guard"
    skip=" $BASHPID $(_descendants "$BASHPID" | tr '\n' ' ') "
    kids=$(_descendants "$MAIN_PID")
    for p in $kids; do [[ "$skip" == *" $p "* ]] || kill -TERM "$p" 2>/dev/null; done
    sleep 3
    for p in $kids; do [[ "$skip" == *" $p "* ]] || kill -KILL "$p" 2>/dev/null; done
    kill -TERM "$MAIN_PID" 2>/dev/null
  ) &
  WATCHDOG=$!
fi
if [ "$PHASE" != train ]; then
  [ -f "$PROMPTS_XZ" ] || { echo "no $PROMPTS_XZ (see the header)" >&2; exit 2; }
  xz -dc "$PROMPTS_XZ" > "$WORK/prompts.json" || exit 2
fi
python3 -c 'from spexis_sglang.default_model import ensure_default_model as e; print(e())' || exit 5
echo "model ready in $((SECONDS - T0)) s; phase $PHASE, preset $PRESET, $WORKERS collect workers on $NGPU GPU(s)"

ARGS=(--preset "$PRESET" --device "$DEVICE" --work-dir "$WORK" --prompts-file "$WORK/prompts.json"
  --artifact-dir "$R/artifacts" --results-dir "$R/results" ${EXTRA:-})
# torch CPU threads per process: the cores shared by the processes that run at once (each
# would take one per core; three on 32 cores made training ~4x slower)
NCPU=$(nproc)
threads() { echo $((NCPU / $1 > 0 ? NCPU / $1 : 1)); }
# step options after ARGS: a later --artifact-dir / --results-stem wins
train() { local step=$1; shift; python3 -m spexis_sglang.train "$step" "${ARGS[@]}" "$@"; }
CKPT=$WORK/checkpoints
gpu() { [ "$DEVICE" = cuda ] && [ "$NGPU" -gt 0 ] && echo $(($1 % NGPU)) || echo ""; }
step_failed() {
  [ -f "$WORK/.time-guard" ] && { echo "$1: stopped by the time guard"; finish 124; }
  echo "FAILED: $1 (logs in $R/logs)" >&2; tail -n 30 "$R/logs/$2" >&2; finish 1; }
finish() {
  trap - TERM
  if [ -n "${WATCHDOG:-}" ] && [ "$BASHPID" = "$MAIN_PID" ]; then
    kill $(_descendants "$WATCHDOG") "$WATCHDOG" 2>/dev/null; WATCHDOG=
  fi
  cp -f "$WORK"/timings.json "$WORK"/evaluation*.json "$WORK"/artifact_check.json "$R/" 2>/dev/null
  tar -czf "$OUT/train_artifacts.tar.gz" -C "$R" .
  echo "=== train_artifacts ($PHASE) done in $((SECONDS - T0)) s (exit $1)"
  exit "$1"
}
# waits for the PIDs in pids[] (names in names[]); 124 = stopped by the collect time-out
wait_all() {
  local k rc
  for k in "${!pids[@]}"; do
    wait "${pids[$k]}"; rc=$?
    [ $rc = 0 ] || { [ $rc = 124 ] && [ "${1:-}" = collect ]; } || step_failed "${names[$k]}" "${names[$k]}.log"
    [ $rc = 124 ] && echo "${names[$k]}: stopped at the collect time limit (resume: PHASE=collect again)"
  done
}

if [ "$PHASE" != train ]; then
  COLLECT_ARGS=()
  HARD=()
  if [ "$COLLECT_END_S" -gt 0 ]; then
    COLLECT_ARGS=(--collect-deadline "$((START_EPOCH + COLLECT_END_S))")
    # a shard that overruns the estimate is cut 30 s past the limit (shards are written
    # atomically: the cut one is redone by a resumed call)
    HARD=(timeout -s TERM "$((COLLECT_END_S + 30 - (SECONDS - T0)))")
  fi
  pids=(); names=()
  if [ "$COLLECT_BACKEND" = sglang ]; then
    # one process, one server; CUDA graphs on (bfloat16: no float32 rmsnorm kernel in
    # sgl-kernel); the decode batch runs ~1,600 rows, graphs cover up to 512
    SARGS=""
    [ "$DEVICE" = cuda ] && SARGS="${GPU_FLAGS[*]} --cuda-graph-max-bs 512 --mem-fraction-static 0.8"
    WORKERS=1
    CUDA_VISIBLE_DEVICES=$(gpu 0) "${HARD[@]}" python3 -m spexis_sglang.train collect "${ARGS[@]}" \
      --collect-backend sglang "--collect-server-args=$SARGS" --threads "$NCPU" "${COLLECT_ARGS[@]}" \
      > "$R/logs/collect-0.log" 2>&1 &
    pids+=($!); names+=("collect-0")
  fi
  NW=$WORKERS; [ "$COLLECT_BACKEND" = sglang ] && NW=0
  for ((k = 0; k < NW; k++)); do
    CUDA_VISIBLE_DEVICES=$(gpu $k) "${HARD[@]}" python3 -m spexis_sglang.train collect "${ARGS[@]}" \
      --collect-worker "$k/$WORKERS" --threads "$(threads "$WORKERS")" "${COLLECT_ARGS[@]}" \
      > "$R/logs/collect-$k.log" 2>&1 &
    pids+=($!); names+=("collect-$k")
  done
  wait_all collect
  # merge: with a time limit, start no shard (deadline 1) and write the sets with what exists
  MERGE=()
  [ "$COLLECT_END_S" -gt 0 ] && MERGE=(--collect-deadline 1 --collect-allow-partial)
  CUDA_VISIBLE_DEVICES=$(gpu 0) train collect --collect-backend "$COLLECT_BACKEND" "${MERGE[@]}" > "$R/logs/collect-merge.log" 2>&1 \
    || step_failed "collect merge" collect-merge.log
  tail -n 1 "$R/logs/collect-merge.log" | cut -c1-1500
  echo "collected in $((SECONDS - T0)) s"
  du -sh "$WORK/data" 2>/dev/null
fi
[ "$PHASE" = collect ] && finish 0

for s in train val sharegpt_test specbench; do
  [ -f "$WORK/data/$s/meta.json" ] || { echo "no $WORK/data/$s/meta.json: run PHASE=collect first" >&2; finish 2; }
done
# a partial training set trains (the report says PARTIAL); partial evaluation sets do not
python3 - "$WORK/data" <<'PY' || finish 2
import json, os, sys
bad = []
for s in sorted(os.listdir(sys.argv[1])):
    p = os.path.join(sys.argv[1], s, "meta.json")
    if os.path.isfile(p):
        m = json.load(open(p))
        miss = m.get("missing_shards", 0)
        print(f"{s}: {len(m['sequences'])} sequences, {m['n_tokens']} tokens, {miss} of {m['n_shards']} shards missing")
        if (miss or not m["sequences"]) and s != "train":
            bad.append(s)
if bad:  # evaluate / check-artifacts skip them (pipeline.usable_eval_set)
    print(f"WARNING: evaluation sets {bad} are partial or empty and are skipped; "
          "resume with PHASE=collect to score them")
PY
EXITS=$(python3 -c "from spexis_sglang.train.pipeline import make_config as m; print(' '.join(map(str, m('$PRESET', model_path='-', work_dir='-').exits)))")
# length-predictor variants: "" = the preset's own features, then tag=features from LENGTH_VARIANTS
VARIANTS=("")
for v in $LENGTH_VARIANTS; do VARIANTS+=("$v"); done
vtag() { echo "${1%%=*}"; }
vfinal() { [[ "$1" == *@final ]]; }
vargs() {  # the train options of a variant (tag=features[@final])
  [ -z "$1" ] && return 0
  local f=${1#*=}; f=${f%@final}
  echo "--length-tag ${1%%=*} --length-features=$f --results-stem quality_${1%%=*} --artifact-dir $R/artifacts-${1%%=*}"
  vfinal "$1" && echo " --length-source final"
}
# a step whose checkpoint exists is not run again (a second call resumes after a time-out)
TODO=()
for ex in $EXITS; do [ -f "$CKPT/draft-exit$ex.pt" ] || TODO+=("train-draft-$ex"); done
for v in "${VARIANTS[@]}"; do
  t=$(vtag "$v"); [ -f "$CKPT/length${t:+-$t}.pt" ] || TODO+=("train-length${t:+-$t}")
done
pids=(); names=()
i=0
for name in "${TODO[@]}"; do
  case $name in
    train-draft-*) cmd=(train-draft --exits "${name#train-draft-}") ;;
    train-length) cmd=(train-length) ;;
    train-length-*)
      for v in "${VARIANTS[@]}"; do [ "$(vtag "$v")" = "${name#train-length-}" ] && cmd=(train-length $(vargs "$v")); done ;;
  esac
  CUDA_VISIBLE_DEVICES=$(gpu $i) train "${cmd[@]}" --threads "$(threads ${#TODO[@]})" \
    > "$R/logs/$name.log" 2>&1 &
  pids+=($!); names+=("$name"); i=$((i + 1))
done
wait_all
echo "trained in $((SECONDS - T0)) s"
# per variant: calibrate then evaluate (the variants and the shipped check side by side)
n=$((${#VARIANTS[@]} + 1))
pids=(); names=(); i=0
for v in "${VARIANTS[@]}"; do
  t=$(vtag "$v"); name=evaluate${t:+-$t}
  (CUDA_VISIBLE_DEVICES=$(gpu $i) train calibrate $(vargs "$v") --threads "$(threads $n)" \
    && CUDA_VISIBLE_DEVICES=$(gpu $i) train evaluate $(vargs "$v") --threads "$(threads $n)") \
    > "$R/logs/$name.log" 2>&1 &
  pids+=($!); names+=("$name"); i=$((i + 1))
done
CUDA_VISIBLE_DEVICES=$(gpu $i) train check-artifacts --artifact-dir "$SHIPPED" --threads "$(threads $n)" \
  > "$R/logs/check-artifacts.log" 2>&1 &
pids+=($!); names+=(check-artifacts)
wait_all
for v in "${VARIANTS[@]}"; do
  t=$(vtag "$v")
  vfinal "$v" && continue  # the ceiling reads 'final': evaluated, not exported
  CUDA_VISIBLE_DEVICES=$(gpu 0) train export $(vargs "$v") > "$R/logs/export${t:+-$t}.log" 2>&1 \
    || step_failed "export $t" "export${t:+-$t}.log"
done
train compare > "$R/logs/compare.log" 2>&1 || step_failed compare compare.log
grep -h "exit .*: acceptance" "$R"/logs/evaluate*.log | cut -c1-300
cat "$R"/results/quality_compare.md 2>/dev/null | head -60
finish 0
