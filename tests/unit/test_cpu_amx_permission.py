"""Both connectors' workers hold the AMX tile permission before their first forward.

Why (cpu_amx.allow_amx): Linux SIGILLs a process whose first AMX instruction comes before
it asked for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM); oneDNN asks on its first bf16
matmul, vLLM 0.32's CPU attention does not, and a restarted P/D prefill whose first request was
a store hit of all but the last prompt token died of it (bench/soak.py --pd). Checked in a
fresh process (the permission is per process and cannot be dropped again), through the real
syscall that reads it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
def held():
    v = ctypes.c_uint64(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(v)) == 0  # arch_prctl(ARCH_GET_XCOMP_PERM)
    return bool(v.value & (1 << 18))  # XFEATURE_XTILEDATA
import torch
from hybridkv.connector.cpu_amx import allow_amx
before = held()
got = allow_amx()
print(before, got, held())
"""


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _has_amx(),
    reason="needs a Linux x86 CPU with AMX (the permission exists only there)",
)
def test_allow_amx_takes_the_tile_permission_a_fresh_worker_lacks():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # A fresh process (torch imported, no matmul yet) lacks it; allow_amx takes it.
    assert out.stdout.split()[-3:] == ["False", "True", "True"], out.stdout


def test_both_connectors_take_it_in_their_worker_init():
    """The call sits in each connector's worker branch, before the worker is built: a
    store-only server's first forward can be one token too (a full store hit)."""
    import inspect

    from hybridkv.connector import cpu_amx, pd_connector, store_connector

    for module in (pd_connector, store_connector):
        assert module.allow_amx is cpu_amx.allow_amx
        init = inspect.getsource(
            module.HybridPDConnector.__init__
            if module is pd_connector
            else module.HybridStoreConnector.__init__
        )
        worker_branch = init[init.index("else:") :]
        assert "allow_amx()" in worker_branch, module.__name__
