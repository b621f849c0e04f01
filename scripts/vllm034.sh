#!/usr/bin/env bash
# vLLM 0.34's pure Python for the scheduler-side test pass (scripts/vllm_python.sh says how);
# $HYBRIDKV_VLLM034_WHEELS names a folder holding the wheel already.
exec bash "$(dirname "${BASH_SOURCE[0]}")/vllm_python.sh" 0.34.0 79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2 "${HYBRIDKV_VLLM034_WHEELS:-/work/wheels034}"
