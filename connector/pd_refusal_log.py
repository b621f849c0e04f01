"""Refusal warnings of the P/D side channel, rate-limited per peer host.

Anyone who reaches the handshake port can make it refuse (no MAC, a replay, a wrong
layout); a warning per call would let one peer flood the prefill worker's log and its CPU. Each
(peer host, kind) logs at most once per ``interval_s``; the next line says how many were
left out. The table of peers is bounded (least recently seen dropped first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

REFUSAL_LOG_INTERVAL_S = 10.0
MAX_PEERS_TRACKED = 1024


def peer_host(peer: str) -> str:
    """gRPC's ``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678`` without the port."""
    head, sep, _port = peer.rpartition(":")
    return head if sep and head else peer


class RefusalLog:
    """``warn(peer, kind, fmt, *args)``: logged unless this peer host logged this kind lately."""

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        capacity: int = MAX_PEERS_TRACKED,
    ) -> None:
        self._logger = logger
        self._interval = interval_s
        self._capacity = capacity
        self._lock = threading.Lock()
        self._last: OrderedDict[tuple[str, str], tuple[float, int]] = (
            OrderedDict()
        )  # -> (logged at, left out)

    def warn(self, peer: str, kind: str, fmt: str, *args: Any) -> bool:
        """True if this one was logged."""
        key, now = (peer_host(peer), kind), time.monotonic()
        with self._lock:
            logged_at, left_out = self._last.get(key, (-float("inf"), 0))
            if now - logged_at < self._interval:
                self._last[key] = (logged_at, left_out + 1)
                self._last.move_to_end(key)
                return False
            self._last[key] = (now, 0)
            self._last.move_to_end(key)
            while len(self._last) > self._capacity:
                self._last.popitem(last=False)
        if left_out:
            fmt += " (and %d more such refusals of this peer in the last %.0f s, not logged)"
            args = (*args, left_out, now - logged_at)
        self._logger.warning(fmt, *args)
        return True


__all__ = ["REFUSAL_LOG_INTERVAL_S", "RefusalLog", "peer_host"]
