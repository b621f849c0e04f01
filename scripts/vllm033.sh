#!/usr/bin/env bash
# Put vLLM 0.33.0's pure Python in .cache/vllm-0.33.0 and print that folder.
#
# Why: hybridkv supports vLLM 0.32 and 0.33, but 0.33 is a CUDA build (it pins
# torch 2.14 CUDA, 9.4 GB installed) and this CI machine has no GPU. Its
# scheduler-side code is pure Python and runs over the CPU venv's torch, so
# scripts/test.sh runs the unit suite a second time with this folder first on
# PYTHONPATH. Only `vllm/` is unpacked, without the wheel's CUDA extension
# modules (*.so, 664 MB): they cannot load without libcudart, and 0.33 treats a
# missing extension the same way (`No module named 'vllm._C'`).
#
# The wheel comes from `pip download --no-deps vllm==0.33.0` with its sha256
# pinned (--require-hashes). A copy already on disk (HYBRIDKV_VLLM033_WHEELS, a
# folder; default /work/wheels033) is used as a local source, so nothing is
# fetched when it is there. Reuse: a second run finds the stamp and returns at
# once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION=0.33.0
SHA256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
DEST="$ROOT/.cache/vllm-$VERSION"
STAMP="$DEST/.unpacked-$SHA256"
LOCAL="${HYBRIDKV_VLLM033_WHEELS:-/work/wheels033}"
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
    echo "[vllm033] using the local wheel in $LOCAL" >&2
else
    echo "[vllm033] downloading vllm==$VERSION (~336 MB) from the package index" >&2
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
print(f"[vllm033] unpacked {len(members)} files of vllm/ (no *.so)", file=sys.stderr)
PY
rm -rf "$DEST"
mv "$tmp" "$DEST"
touch "$STAMP"
echo "$DEST"
