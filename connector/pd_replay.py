"""Side-channel replay window: each authenticated request body is accepted once.

Every side-channel body carries ``ts`` (the caller's wall clock, seconds since the epoch)
and ``nonce`` (random hex), both under the request MAC. The server accepts a body only
when ``ts`` lies within ``window_s`` of its own wall clock and its nonce was not seen in
that window. A nonce stays remembered until its ``ts`` leaves the window, after which the
body is refused for its age; so a captured (body, MAC) opens nothing a second time.

Memory is bounded: past ``capacity`` remembered nonces the oldest are dropped and every
body stamped at or before the newest dropped one is refused (a "floor"), so dropping never
re-opens a replay. Fresh bodies are stamped near now and stay above the floor.

The window compares two hosts' wall clocks: hosts of a P/D pair must keep them within
``window_s`` of each other (NTP). The window is wide because a caller's body may wait in a
starved process for tens of seconds before the server reads it.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Callable
from typing import Any

REPLAY_WINDOW_S = 300.0
MAX_NONCES = 65536
MIN_NONCE_CHARS = 1
MAX_NONCE_CHARS = 128


class ReplayGuard:
    """Accepts each (``ts``, ``nonce``) of an authenticated body once within the window."""

    def __init__(
        self,
        window_s: float = REPLAY_WINDOW_S,
        capacity: int = MAX_NONCES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._window = window_s
        self._capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # (ts + window, nonce), a min-heap
        self._floor = -math.inf  # bodies stamped at or before this are refused (capacity)

    def __len__(self) -> int:
        return len(self._seen)

    def refusal(self, obj: Any) -> str | None:
        """Why this body is refused as stale or replayed (None: fresh, and now remembered)."""
        if not isinstance(obj, dict):
            return "the body is not a JSON object"
        ts, nonce = obj.get("ts"), obj.get("nonce")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            return (
                "the body carries no timestamp (ts): a caller of an older version, or a forged body"
            )
        if not isinstance(nonce, str) or not MIN_NONCE_CHARS <= len(nonce) <= MAX_NONCE_CHARS:
            return f"the body carries no nonce of {MIN_NONCE_CHARS}-{MAX_NONCE_CHARS} characters"
        now = self._clock()
        if abs(now - ts) > self._window:
            return (
                f"its timestamp is {now - ts:+.0f} s from this host's clock, outside the {self._window:g} s "
                "replay window: a replayed request, or the two hosts' clocks differ by more than that (run NTP)"
            )
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if ts <= self._floor:
                return "its timestamp is older than the replay cache still covers (many requests in the window)"
            if nonce in self._seen:
                return "its nonce was seen already: a replayed request"
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (ts + self._window, nonce))
            while len(self._seen) > self._capacity:
                expiry, old = heapq.heappop(self._expiry)
                self._seen.discard(old)
                self._floor = max(self._floor, expiry - self._window)
        return None


__all__ = ["MAX_NONCES", "REPLAY_WINDOW_S", "ReplayGuard"]
