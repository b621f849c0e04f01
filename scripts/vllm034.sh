#!/usr/bin/env bash
# Put vLLM 0.34.0's pure Python in .cache/vllm-0.34.0 and print that folder.
#
# Why: vLLM 0.34 is a CUDA build (it pins torch 2.14 CUDA, as 0.33 does) and
# this CI machine has no GPU. Its scheduler-side code is pure Python and runs
# over the CPU venv's torch, so scripts/test.sh runs a list of unit tests a
# third time with this folder first on PYTHONPATH. Only `vllm/` is unpacked,
# without the wheel's CUDA extension modules (*.so): they cannot load without
# libcudart, and vLLM treats a missing extension the same way
# (`No module named 'vllm._C'`).
#
# The wheel comes from `pip download --no-deps vllm==0.34.0` (239 MB, x86_64)
# with its sha256 pinned (--require-hashes). A copy already on disk
# (HYBRIDKV_VLLM034_WHEELS, a folder; default /work/wheels034) is used as a
# local source, so nothing is fetched when it is there; a wheel already in
# .cache/wheels is reused by pip. Reuse: a second run finds the stamp and
# returns at once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION=0.34.0
SHA256=79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2
DEST="$ROOT/.cache/vllm-$VERSION"
STAMP="$DEST/.unpacked-$SHA256"
LOCAL="${HYBRIDKV_VLLM034_WHEELS:-/work/wheels034}"
PY="$ROOT/.venv/bin/python"

if [ -f "$STAMP" ] && [ -f "$DEST/vllm/__init__.py" ]; then
    echo "$DEST"
    exit 0
fi

WHEELS="$ROOT/.cache/wheels"
mkdir -p "$WHEELS"
req="$(mktemp)"
trap 'rm -f "$req"' EXIT
echo "vllm==$VERSION --hash=sha256:$SHA256" >"$req"
src=()
if ls "$LOCAL"/vllm-"$VERSION"-*.whl >/dev/null 2>&1; then
    src=(--no-index --find-links "$LOCAL")
    echo "[vllm034] using the local wheel in $LOCAL" >&2
elif ls "$WHEELS"/vllm-"$VERSION"-*.whl >/dev/null 2>&1; then
    src=(--no-index --find-links "$WHEELS")
    echo "[vllm034] using the wheel already in $WHEELS" >&2
else
    echo "[vllm034] downloading vllm==$VERSION (~239 MB) from the package index" >&2
fi
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
    --require-hashes -r "$req" -d "$WHEELS" "${src[@]}" >&2
wheel="$(ls "$WHEELS"/vllm-"$VERSION"-*.whl | head -1)"

tmp="$DEST.partial"
rm -rf "$tmp"
mkdir -p "$tmp"
"$PY" - "$wheel" "$tmp" <<'PY'
import sys
import zipfile

wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.startswith("vllm/") and not m.endswith(".so")]
    z.extractall(out, members)
print(f"[vllm034] unpacked {len(members)} files of vllm/ (no *.so)", file=sys.stderr)
PY
rm -rf "$DEST"
mv "$tmp" "$DEST"
touch "$STAMP"
echo "$DEST"
