#!/usr/bin/env bash
# Usage: vllm_python.sh VERSION SHA256 [LOCAL_WHEEL_DIR]
# Put vLLM VERSION's pure Python in .cache/vllm-VERSION and print that folder.
#
# Why: vLLM's PyPI wheels are CUDA builds (torch 2.14 CUDA) and the CI machine has no GPU.
# Their scheduler-side code is pure Python and runs over the CPU venv's torch, so
# scripts/test.sh runs unit tests again with this folder first on PYTHONPATH. Only `vllm/`
# is unpacked, without the wheel's CUDA extension modules (*.so): they cannot load without
# libcudart, and vLLM treats a missing extension the same way (`No module named 'vllm._C'`).
#
# The wheel comes from `pip download --no-deps vllm==VERSION` with its sha256 pinned
# (--require-hashes). A copy in LOCAL_WHEEL_DIR, or already in .cache/wheels, is used as a
# local source, so nothing is fetched when it is there. A second run finds the stamp and
# returns at once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="$1"
SHA256="$2"
TAG="vllm${VERSION%.*}"; TAG="${TAG//./}"  # vllm033, vllm034
DEST="$ROOT/.cache/vllm-$VERSION"
STAMP="$DEST/.unpacked-$SHA256"
LOCAL="${3:-}"
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
if [ -n "$LOCAL" ] && ls "$LOCAL"/vllm-"$VERSION"-*.whl >/dev/null 2>&1; then
    src=(--no-index --find-links "$LOCAL")
    echo "[$TAG] using the local wheel in $LOCAL" >&2
elif ls "$WHEELS"/vllm-"$VERSION"-*.whl >/dev/null 2>&1; then
    src=(--no-index --find-links "$WHEELS")
    echo "[$TAG] using the wheel already in $WHEELS" >&2
else
    echo "[$TAG] downloading vllm==$VERSION from the package index" >&2
fi
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
    --require-hashes -r "$req" -d "$WHEELS" "${src[@]}" >&2
wheel="$(ls "$WHEELS"/vllm-"$VERSION"-*.whl | head -1)"

tmp="$DEST.partial"
rm -rf "$tmp"
mkdir -p "$tmp"
"$PY" - "$wheel" "$tmp" "$TAG" <<'PY'
import sys
import zipfile

wheel, out, tag = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.startswith("vllm/") and not m.endswith(".so")]
    z.extractall(out, members)
print(f"[{tag}] unpacked {len(members)} files of vllm/ (no *.so)", file=sys.stderr)
PY
rm -rf "$DEST"
mv "$tmp" "$DEST"
touch "$STAMP"
echo "$DEST"
