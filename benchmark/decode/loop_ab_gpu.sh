#!/usr/bin/env bash
# benchmark/decode/loop_ab_gpu.sh: the SP loop's stage-0 CPU time, an older srt/ against the working
# tree's, alternating in one invocation (old, new, old, new, ...), SP only. A GPU host's speed
# drifts from one invocation to the next (and within one): only runs of one invocation
# compare, and the 'forced' phase (the same code in both) shows the drift.
#
#   here:   rm -rf .gpu/old && mkdir -p .gpu/old && git archive REV python/spexis_sglang/srt | tar -x -C .gpu/old
#   then:   PAIRS="1 2" B=256 bash benchmark/decode/loop_ab_gpu.sh   (the tiny model in .gpu/tiny)
# Output: $OUT/ab_{old,new}N.json and a line per run.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/../gpu/common.sh"
gpu_script_env || exit $?
OLD_SRC=${OLD_SRC:-.gpu/old}
[ -d .gpu/tiny ] && cp -r .gpu/tiny/spexis-tiny-llama-* "${TMPDIR:-/tmp}/"
OLD_PY=${TMPDIR:-/tmp}/spexis-old-python
rm -rf "$OLD_PY" && cp -r python "$OLD_PY" && rm -rf "$OLD_PY/spexis_sglang/srt" \
  && cp -r "$OLD_SRC/python/spexis_sglang/srt" "$OLD_PY/spexis_sglang/srt" || exit 4
BASE=$PYTHONPATH
for i in ${PAIRS:-1 2}; do
  for v in old new; do
    if [ "$v" = old ]; then export PYTHONPATH=$OLD_PY:$BASE; else export PYTHONPATH=$BASE; fi
    python3 benchmark/decode/sp_loop_overhead.py --only sp --batches "${B:-256}" --new-tokens 2000 \
      --dtype bfloat16 --min-window-s 5 --poll-s 0.5 \
      --server-args "${GPU_FLAGS[*]} --cuda-graph-max-bs 512 --mem-fraction-static 0.3" \
      --out "$OUT/ab_$v$i.json" > "$OUT/ab_$v$i.log" 2>&1
    python3 - "$OUT/ab_$v$i.json" "$v" "$i" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    phases = " ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_per_iteration"].items())
    print(sys.argv[2], sys.argv[3], r["B"], f"sched+proc {r['cpu_sched_proc_ms_per_iteration']:.3f}", phases)
PY
  done
done
