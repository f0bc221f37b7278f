#!/usr/bin/env bash
# build_site.sh: rebuild, from PyPI, the pre-installed SGLang 0.5.17 "site" that the
# offline H200 machines use (one tar.xz that is extracted there and put on PYTHONPATH).
#
#   usage: bash benchmark/gpu/offline_site/build_site.sh OUTPUT.tar.xz [WORKDIR]
#   e.g.   bash benchmark/gpu/offline_site/build_site.sh .gpu/site.tar.xz
#
# Runs on an x86_64 Linux machine with Python >= 3.9 (any minor version: the wheels are
# fetched for CPython 3.12 explicitly), python3-venv, GNU tar, xz, binutils (readelf, strip) and
# access to PyPI (the download step honours pip's configuration, e.g. PIP_INDEX_URL or a mirror; the
# pinned hashes make sure the files are PyPI's). Needs about 3 GB of free disk in WORKDIR: the
# sglang-kernel wheel (365 MiB) unpacks to 1.2 GB before it is slimmed. Took 9 min on a
# busy 2-core machine (8 min of CPU time), almost all of it `xz -9e`.
#
# Steps:
#   1. a throw-away venv with pinned pip and wheel (the build does not depend on the
#      machine's own pip);
#   2. pip download of every wheel in requirements.txt for cp312 / manylinux x86_64,
#      --no-deps and --require-hashes, so exactly the files listed there;
#   3. slim two wheels with `wheel unpack` -> delete -> `wheel pack` (name, version and
#      tags unchanged, RECORD regenerated):
#        sglang-kernel: keep the python files, spatial_ops and sm90/common_ops; drop
#          flash_ops (FA3, 1.1 GB), sm100/, infllm_ops and flashmla_ops. Result: works on
#          sm_90 (H100/H200) only, and --attention-backend fa3 is unavailable;
#        xgrammar: drop the static library xgrammar/lib/libxgrammar.a;
#   4. pip install --no-deps --no-index --target SITE for cp312 (no .pyc compiled: the
#      machine's Python writes its own);
#   5. drop SITE/bin and SITE/share and their RECORD lines (console scripts whose shebang
#      names the build venv's Python, and a man page; nothing uses them under
#      PYTHONPATH) and zstandard's unused cffi backend, strip debug information from the
#      shared libraries that carry it (RECORD rehashed), check the result (never drop a
#      RECORD file: tvm-ffi locates xgrammar's bindings through xgrammar's RECORD);
#   6. tar (sorted, fixed owner and mtime) | xz -9e -T2, then print size and sha256.
#      xz's multi-threaded mode cuts the input into fixed 192 MiB blocks, so its output
#      does not depend on the machine's core count: with the same xz version, two builds
#      give byte-identical tarballs.
#
# Environment knobs (all optional):
#   PYTHON=python3          interpreter used to create the build venv
#   KEEP_WORK=1             keep the temporary WORKDIR (a WORKDIR given as $2 is always kept)
#   SOURCE_DATE_EPOCH=...   mtime stamped on every file in the tarball
#   PIP_NO_CACHE_DIR=1 or PIP_CACHE_DIR=...   usual pip cache control
set -euo pipefail
umask 022
export LC_ALL=C

# ---- pins for the build tools and the target -----------------------------------------
PIP_VERSION=25.3
WHEEL_VERSION=0.48.0
PACKAGING_VERSION=25.0          # needed by wheel >= 0.46
MAX_BYTES=$((60 * 1024 * 1024)) # the tarball travels in a 64 MiB carry with the repo
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1767225600}   # 2026-01-01T00:00:00Z
# Target: CPython 3.12 on manylinux x86_64. The GPU image has glibc 2.39; sglang's wheel
# needs manylinux_2_34. pip matches manylinux_2_N tags exactly, so every N used by a
# pinned wheel is named (manylinux2014 also admits manylinux2010/manylinux1 wheels).
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REQ="$HERE/requirements.txt"
OUT_ARG=${1:?usage: $0 OUTPUT.tar.xz [WORKDIR]}
[ -f "$REQ" ] || { echo "missing $REQ" >&2; exit 2; }
for t in tar xz sha256sum readelf strip; do command -v $t >/dev/null || { echo "need $t" >&2; exit 2; }; done
mkdir -p "$(dirname "$OUT_ARG")"
OUT_TAR="$(cd "$(dirname "$OUT_ARG")" && pwd)/$(basename "$OUT_ARG")"

if [ -n "${2:-}" ]; then
  WORK=$2; KEEP_WORK=1
  mkdir -p "$WORK"
  [ -z "$(ls -A "$WORK")" ] || { echo "WORKDIR $WORK is not empty; give a new or empty one" >&2; exit 2; }
  WORK=$(cd "$WORK" && pwd)
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-site-build.XXXXXX")
fi
cleanup() {
  local rc=$?
  if [ "${KEEP_WORK:-0}" = 1 ] || [ $rc -ne 0 ]; then echo "work dir kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

T0=$SECONDS
step() { printf '\n== [%4ds] %s\n' $((SECONDS - T0)) "$*"; }

# ---- 1. build venv ---------------------------------------------------------------------
step "build venv (pip $PIP_VERSION, wheel $WHEEL_VERSION)"
"${PYTHON:-python3}" -c 'import sys; assert sys.version_info >= (3, 9), sys.version' \
  || { echo "need Python >= 3.9 to run the build" >&2; exit 2; }
"${PYTHON:-python3}" -m venv "$WORK/venv" \
  || { echo "python -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 2; }
VPY="$WORK/venv/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check --no-input)
"${PIP[@]}" install -q "pip==$PIP_VERSION"
"${PIP[@]}" install -q "wheel==$WHEEL_VERSION" "packaging==$PACKAGING_VERSION"
"${PIP[@]}" --version

# ---- 2. download the pinned wheels -----------------------------------------------------
step "download $(grep -cE '^[A-Za-z0-9]' "$REQ") pinned wheels for cp312 / manylinux x86_64"
grep -oE '^[A-Za-z0-9][A-Za-z0-9._-]*==[^[:space:]]+' "$REQ" > "$WORK/pins.txt"
N=$(wc -l < "$WORK/pins.txt")
"${PIP[@]}" download -q --progress-bar off --no-deps --require-hashes "${TARGET[@]}" \
  -d "$WORK/pypi" -r "$REQ"
[ "$(ls "$WORK"/pypi/*.whl | wc -l)" -eq "$N" ] || { echo "expected $N wheels in $WORK/pypi" >&2; exit 1; }
du -sh "$WORK/pypi"

# ---- 3. slim sglang-kernel and xgrammar -----------------------------------------------
mkdir -p "$WORK/final"
# repack WHEEL KEEP_REGEX DROP_REGEX: unpack, delete the files whose path (relative to the
# unpacked tree) matches DROP_REGEX but not KEEP_REGEX, drop empty directories, pack again.
repack() {
  local whl=$1 keep=$2 drop=$3 tree="$WORK/unpack" root
  rm -rf "$tree"; mkdir -p "$tree"
  "$VPY" -m wheel unpack -d "$tree" "$whl" >/dev/null
  root=$(echo "$tree"/*/); root=${root%/}
  ( cd "$root"
    find . -type f | sed 's|^\./||' | grep -E "$drop" | grep -vE "$keep" | sort > "$WORK/dropped.txt" || true
    [ -s "$WORK/dropped.txt" ] || { echo "nothing to drop in $(basename "$whl")" >&2; exit 1; }
    while read -r f; do printf '   drop %10d  %s\n' "$(stat -c %s "$f")" "$f"; rm -f "$f"; done < "$WORK/dropped.txt"
    find . -mindepth 1 -type d -empty -delete )
  "$VPY" -m wheel pack -d "$WORK/final" "$root" >/dev/null
  rm -rf "$tree"
  [ -f "$WORK/final/$(basename "$whl")" ] || { echo "repacked wheel of $(basename "$whl") got another name" >&2; exit 1; }
  printf '   %s: %d -> %d bytes\n' "$(basename "$whl")" "$(stat -c %s "$whl")" "$(stat -c %s "$WORK/final/$(basename "$whl")")"
}
step "slim sglang-kernel to sm90 (keep python, spatial_ops, sm90/common_ops)"
KW=$(ls "$WORK"/pypi/sglang_kernel-0.4.5-*.whl)
repack "$KW" '^sgl_kernel/(spatial_ops\.abi3\.so|sm90/common_ops\.abi3\.so)$' '^sgl_kernel/.*\.so$'
step "slim xgrammar (drop the static library)"
XW=$(ls "$WORK"/pypi/xgrammar-0.2.1-*.whl)
repack "$XW" '^$' '^xgrammar/lib/libxgrammar\.a$'
for w in "$WORK"/pypi/*.whl; do
  [ "$w" = "$KW" ] || [ "$w" = "$XW" ] || cp "$w" "$WORK/final/"
done

# ---- 4. install into the site directory -----------------------------------------------
step "pip install --target (cp312, no deps, no index, no .pyc)"
SITE="$WORK/site"
# Isolated from pip config files and PIP_* variables: a find-links or index set there
# could offer the unslimmed wheels of the same name and version.
PIP_CONFIG_FILE=/dev/null "${PIP[@]}" --isolated install -q --no-deps --no-index \
  --find-links "$WORK/final" "${TARGET[@]}" --no-compile --root-user-action=ignore \
  --target "$SITE" -r "$WORK/pins.txt"

# ---- 5. tidy and check ----------------------------------------------------------------
step "tidy and check the site"
rm -rf "$SITE/bin" "$SITE/share"
# ... and their lines in RECORD: the scripts' hashes depend on the build venv's path.
sed -i -E '/^(\.\.\/)+(bin|share)\//d' "$SITE"/*.dist-info/RECORD
# zstandard's cffi backend (12 MB; the C backend, which zstandard imports first, stays) and its
# RECORD line. Keep every other RECORD whole: tvm-ffi finds xgrammar's library through it.
rm -f "$SITE"/zstandard/_cffi.*.so
sed -i -E '/^zstandard\/_cffi\./d' "$SITE"/zstandard-*.dist-info/RECORD
# sglang's diffusion server (sglang.multimodal_gen, 27 MB: nothing under sglang.srt imports it)
# and the C sources of tvm-ffi's bundled libbacktrace (its built library stays), with their
# RECORD lines: the tarball and the repository must fit one device call's 64 MiB together.
rm -rf "$SITE/sglang/multimodal_gen" "$SITE/tvm_ffi/3rdparty/libbacktrace"
sed -i -E '/^sglang\/multimodal_gen\//d' "$SITE"/sglang-*.dist-info/RECORD
sed -i -E '/^tvm_ffi\/3rdparty\/libbacktrace\//d' "$SITE"/*tvm_ffi*.dist-info/RECORD
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
# Debug information out of the shared libraries that ship it (xgrammar's bindings 53 -> 3 MB,
# zstandard's C backend 12 -> 1 MB; ~10 MB of the tarball), their RECORD lines rehashed. Code,
# symbols and every other section stay (`strip --strip-debug`).
find "$SITE" -name '*.so*' -type f | sort | while read -r so; do
  readelf -S "$so" 2>/dev/null | grep -q '\.debug_info' || continue
  before=$(stat -c %s "$so"); strip --strip-debug "$so"
  printf '   strip %10d -> %9d  %s\n' "$before" "$(stat -c %s "$so")" "${so#"$SITE"/}"
  echo "${so#"$SITE"/}" >> "$WORK/stripped.txt"
done
"$VPY" - "$SITE" "$WORK/stripped.txt" <<'PY'
import base64, csv, hashlib, io, pathlib, sys
site, stripped = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
todo = set(stripped.read_text().split()) if stripped.exists() else set()
for record in site.glob("*.dist-info/RECORD"):
    rows = list(csv.reader(io.StringIO(record.read_text(encoding="utf-8"))))
    hit = [r for r in rows if r and r[0] in todo]
    for r in hit:
        data = (site / r[0]).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        r[1:3] = [f"sha256={digest}", str(len(data))]
        todo.discard(r[0])
    if hit:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows)
        record.write_text(out.getvalue(), encoding="utf-8")
assert not todo, f"stripped files in no RECORD: {sorted(todo)}"
PY
"$VPY" - "$SITE" "$WORK/pins.txt" <<'PY'
import email.parser, pathlib, sys
from packaging.utils import canonicalize_name
site, pins = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
want = {}
for line in pins.read_text().split():
    n, v = line.split("==")
    want[canonicalize_name(n)] = v
have = {}
for d in site.glob("*.dist-info"):
    meta = email.parser.Parser().parsestr((d / "METADATA").read_text(encoding="utf-8"), headersonly=True)
    have[canonicalize_name(meta["Name"])] = meta["Version"]
assert have == want, f"installed != pinned: {set(have.items()) ^ set(want.items())}"
must = ["sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/spatial_ops.abi3.so",
        "flashinfer/data/csrc/norm.cu", "flashinfer/data/include", "flashinfer/data/cutlass",
        "flashinfer/data/cccl", "sglang/launch_server.py", "xgrammar/libxgrammar_bindings.so"]
never = ["torch", "triton", "numpy", "sgl_kernel/sm100", "sgl_kernel/flash_ops.abi3.so",
         "xgrammar/lib/libxgrammar.a", "bin"]
missing = [p for p in must if not (site / p).exists()]
extra = [p for p in never if (site / p).exists()]
assert not missing and not extra, f"missing: {missing}  unexpected: {extra}"
print(f"   {len(have)} distributions, all pinned versions present; sm90 kernel and flashinfer/data present")
PY
echo "   $(find "$SITE" -type f | wc -l) files, $(du -sm "$SITE" | cut -f1) MB unpacked"

# ---- 6. tarball -------------------------------------------------------------------------
step "tar | xz -9e -T2 (reproducible; the slow step)"
tar --sort=name --format=gnu --owner=0 --group=0 --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" \
    -C "$SITE" -cf - . | xz -9e -T2 -c > "$OUT_TAR.partial"
mv -f "$OUT_TAR.partial" "$OUT_TAR"
SIZE=$(stat -c %s "$OUT_TAR")
SHA=$(sha256sum "$OUT_TAR" | cut -d' ' -f1)
echo "$SHA  $(basename "$OUT_TAR")" > "$OUT_TAR.sha256"

step "done"
echo "tarball: $OUT_TAR"
echo "size:    $SIZE bytes ($(awk -v s="$SIZE" 'BEGIN{printf "%.1f", s/1048576}') MiB)"
echo "sha256:  $SHA"
echo "time:    $((SECONDS - T0)) s"
if [ "$SIZE" -gt "$MAX_BYTES" ]; then
  echo "ERROR: larger than $((MAX_BYTES / 1048576)) MiB; it will not fit in a 64 MiB carry with the repo" >&2
  exit 1
fi
# what travels to the device machine: the repository's tracked files and this tarball, 64 MiB
REPO_DIR=$(cd "$HERE/../../.." && pwd)
if git -C "$REPO_DIR" rev-parse --git-dir >/dev/null 2>&1; then
  TRACKED=$(git -C "$REPO_DIR" ls-files -z | (cd "$REPO_DIR" && xargs -0 stat -c %s 2>/dev/null) | awk '{s += $1} END {print s + 0}')
  LEFT=$((64 * 1048576 - TRACKED - SIZE))
  echo "carry:   repository $TRACKED bytes + tarball = $((TRACKED + SIZE)) bytes, $LEFT bytes left of 64 MiB"
  if [ "$LEFT" -lt 0 ]; then
    echo "ERROR: the repository and the tarball together exceed the device's 64 MiB carry" >&2
    exit 1
  fi
fi
