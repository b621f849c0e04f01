"""Lets vLLM 0.34's x86 Triton refusal pass in the scheduler-side test pass, in every process.

Python imports ``sitecustomize`` at start-up from ``sys.path``; scripts/test.sh's vLLM 0.34
pass puts this folder on ``PYTHONPATH`` and sets ``HYBRIDKV_SCHEDULER_ONLY_CPU=1``, so pytest
AND the child processes tests start (forkserver children, servers) get it.

vLLM 0.34's ``CpuPlatform.check_and_update_config`` raises "vLLM on x86 CPUs requires Triton
(triton-cpu)" because its CPU model runner compiles Triton kernels. These tests build
``VllmConfig`` objects but never run a model, so while that one check runs
``vllm.triton_utils.HAS_TRITON`` reads True; the rest of the check, and everything after it,
sees the real value, and no engine can start (no ``vllm._C``, no Triton). The patch is applied
when ``vllm.platforms.cpu`` is first imported (a one-shot import hook): nothing is imported
early.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

SCHEDULER_ONLY_CPU = os.environ.get("HYBRIDKV_SCHEDULER_ONLY_CPU") == "1"
_TARGET = "vllm.platforms.cpu"


def patch(cpu_module: ModuleType) -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` (idempotent)."""
    platform = cpu_module.CpuPlatform
    check = platform.check_and_update_config.__func__
    if getattr(check, "scheduler_only", False):
        return

    @functools.wraps(check)
    def scheduler_only_check(cls: Any, vllm_config: Any) -> Any:
        import vllm.triton_utils as triton_utils  # lazily, as vLLM's own check does

        if triton_utils.HAS_TRITON:
            return check(cls, vllm_config)
        triton_utils.HAS_TRITON = True
        try:
            return check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    scheduler_only_check.scheduler_only = True  # type: ignore[attr-defined]
    platform.check_and_update_config = classmethod(scheduler_only_check)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding us
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if SCHEDULER_ONLY_CPU:
    if _TARGET in sys.modules:
        patch(sys.modules[_TARGET])
    else:
        sys.meta_path.insert(0, _PatchOnImport())
