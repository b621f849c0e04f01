#!/usr/bin/env bash
# Set up (idempotent) and run every test: unit (pinned to vLLM's real
# KVCacheManager, real mooncake_master) and e2e. Fails on any failure and on
# zero collected tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log="$(mktemp)"
if ! bash scripts/setup.sh >"$log" 2>&1; then
    grep -v "is ignored: it is neither" "$log" | tail -40 >&2
    echo "setup failed (full log: $log)" >&2
    exit 1
fi
grep -v "is ignored: it is neither" "$log" | tail -3
export VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1
set +e
.venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
