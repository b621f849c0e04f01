"""Listening ports that hybridkv chooses for its own local servers (the embedded master, and the
vLLM servers and proxy that the CLI and tests start).

Why not just bind port 0: the kernel hands out port 0 from the EPHEMERAL range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default), the same range every outgoing
connection and every ``get_open_port()`` of a vLLM engine draws from. A port chosen that way is
released at once and bound by our server 10-60 s later (after its imports); meanwhile an
engine's ZMQ / torch.distributed / NIXL socket on the same host can take it, and our server dies
with "address already in use" (e.g. a proxy's port taken while engines boot). A port OUTSIDE the
ephemeral range is never handed out implicitly, so only another explicit bind can take it. The
callers still re-choose on a taken port (a race stays possible).
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 20000  # below: registered services crowd the range (and many hosts reserve it)
HIGHEST_PORT = 65535
TRIES = 64


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's (low, high) ephemeral port range; Linux's default where it cannot be read."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def candidate_ranges(ephemeral: tuple[int, int]) -> list[range]:
    """Port ranges at or above ``LOWEST_PORT`` that lie outside ``ephemeral`` (may be empty)."""
    low, high = ephemeral
    ranges = [
        range(LOWEST_PORT, min(low, HIGHEST_PORT + 1)),
        range(max(high + 1, LOWEST_PORT), HIGHEST_PORT + 1),
    ]
    return [r for r in ranges if len(r)]


def _bindable(host: str, port: int) -> bool:
    # No SO_REUSEADDR: a port with any socket on it (a listener, a connection, TIME_WAIT) is refused.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, outside the ephemeral range where the host allows
    (see the module docstring); the kernel's choice (port 0) where it does not. Random, so that
    concurrent callers rarely pick the same one."""
    pick = random.SystemRandom()
    ranges = candidate_ranges(ephemeral_range())
    if ranges:
        weights = [len(r) for r in ranges]
        for _ in range(TRIES):
            port = pick.choice(pick.choices(ranges, weights=weights)[0])
            if _bindable(host, port):
                return port
    return _kernel_port(host)


def reports_port_in_use(log_text: str) -> bool:
    """Whether a server's log says a port it wanted was taken, in any of the spellings seen:
    uvicorn's "[Errno 98] error while attempting to bind ... address already in use", the
    kernel's / vLLM's "Address already in use". One check, case-insensitive, for every server
    this package starts on a port it chose (the chosen port is free when chosen, not when bound)."""
    return "address already in use" in log_text.lower()
