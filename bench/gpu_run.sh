#!/usr/bin/env bash
# One device call for bench/gpu_coalesce.py on the H200 (the `run` tool; nothing is fetched there).
#   carry: .whl/h38 (nixl-cu13 1.5.1 cp312 unpacked without its nixl_ep extension, tar.xz, + the
#          pure-Python nixl 1.5.1 wheel) and .vllm-mini (vLLM 0.33's kv_cache_interface files).
#   run:   bash bench/gpu_run.sh   -> $OUT/coalesce.json, $OUT/log.txt
set -uo pipefail
mkdir -p /tmp/site
tar xJf .whl/h38/nixl_cu13_noep.tar.xz -C /tmp/site || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/h38/nixl-1.5.1-py3-none-any.whl || exit 2
export PYTHONPATH=/tmp/site
# the NIXL wheel's libucm_cuda needs libcudart.so.13: torch's nvidia/cu13/lib
CU=$(python3 -c "import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))")
export LD_LIBRARY_PATH="$CU:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1 HYBRIDKV_COMMIT="${HYBRIDKV_COMMIT:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import nixl._api, torch; print('nixl ok, torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 3
timeout 500 python3 bench/gpu_coalesce.py --out "$OUT" "$@" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/log.txt"
