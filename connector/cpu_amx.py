"""The AMX tile permission for a CPU worker, taken before its first forward.

Why its own module: both connectors' workers need it (a HybridStoreConnector-only server
whose first request is a store hit of all but the last token runs the same one-token first
forward as a restarted P/D prefill), and neither connector should import the other.
"""

from __future__ import annotations

from hybridkv.store.logs import get_logger

logger = get_logger(__name__)


def allow_amx() -> bool:
    """Request this process's AMX tile permission from Linux before its first forward.

    Why: on a CPU with AMX, Linux delivers SIGILL to a process whose first AMX instruction
    comes before it asked for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM). oneDNN asks on
    its first bf16 matmul; vLLM 0.32's CPU attention does not. So a CPU worker whose FIRST
    forward is one token over a cached prefix dies with SIGILL (exit -4): a restarted prefill
    whose first request is a store hit of all but the prompt's last token, which the P/D
    prefill's cut to the hand-over + 1 makes the usual case (a prefill restarted under load, as
    in bench/soak.py --pd). True when the permission is held."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import torch

    init = getattr(torch.cpu, "_init_amx", None)
    try:
        return bool(init()) if init is not None else False
    except Exception as e:  # noqa: BLE001 - a CPU without AMX, or a torch without the call
        logger.debug("AMX permission not requested: %s", e)
        return False


__all__ = ["allow_amx"]
