#!/usr/bin/env bash
# vLLM 0.33's pure Python for the scheduler-side test pass (scripts/vllm_python.sh says how);
# $HYBRIDKV_VLLM033_WHEELS names a folder holding the wheel already.
exec bash "$(dirname "${BASH_SOURCE[0]}")/vllm_python.sh" 0.33.0 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa "${HYBRIDKV_VLLM033_WHEELS:-/work/wheels033}"
