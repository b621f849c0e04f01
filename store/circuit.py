"""The store client's circuit breaker: closed, open with exponential backoff, half-open.

Why: a dead master costs each call the ~4.4 s the Mooncake binding needs to find out (or the
caller's whole ``timeout_s``). After one call says "unreachable" the circuit opens and calls
fail at once (``MASTER_UNREACHABLE``). When the window ends, ONE call is let through as a probe
(half-open) while the others keep failing fast: with a fixed window and every caller admitted
at its end, each of the engine's callers (lookups, loads, saves) paid the 4.4 s again once a
second, for as long as the master stayed down. Each failed probe doubles the window, up to
``max_s`` (the longest a master that came back waits to be noticed); any answered call closes
it. A probe that never reports (a verb that raised before reading its codes) frees its slot
after ``probe_ttl_s``, so the circuit cannot stay half-open for good.

Pure logic over an injectable clock (tests/unit/test_store_circuit.py); thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Circuit:
    """``admit()`` before a call, then ``failure(probe)`` (the master was unreachable) or
    ``success()`` (it answered) after it."""

    def __init__(
        self,
        base_s: float,
        max_s: float,
        probe_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if base_s < 0 or max_s < base_s or probe_ttl_s <= 0:
            raise ValueError(
                f"circuit: base_s={base_s}, max_s={max_s}, probe_ttl_s={probe_ttl_s}: "
                "expected 0 <= base_s <= max_s and probe_ttl_s > 0"
            )
        self.base_s, self.max_s, self.probe_ttl_s = float(base_s), float(max_s), float(probe_ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0  # consecutive unreachable answers; 0: closed
        self._open_until = 0.0
        self._probe_until = 0.0  # a probe is in flight until then (half-open)

    @property
    def is_open(self) -> bool:
        """True while calls are refused or only a probe may pass."""
        return self._failures > 0

    @property
    def window_s(self) -> float:
        """The window a failure now opens (doubles per consecutive failure, at most max_s)."""
        return min(self.max_s, self.base_s * (2 ** max(0, min(self._failures - 1, 30))))

    def admit(self) -> tuple[bool, float]:
        """(admitted, is it the probe) as ``(True, probe)``, or ``(False, seconds until the next
        probe may go)``; 0.0 there means a probe is in flight now."""
        with self._lock:
            if not self._failures:
                return True, False
            now = self._clock()
            if now < self._open_until:
                return False, self._open_until - now
            if now < self._probe_until:
                return False, 0.0
            self._probe_until = now + self.probe_ttl_s
            return True, True

    def failure(self, probe: bool) -> None:
        """The master was unreachable (or a probe ended without an answer): open, or, for the
        probe, open longer. A non-probe call failing while the circuit is open was admitted
        before it opened (they all fail together when a master dies): the window stands, and
        the probe in flight keeps its slot, so one master outage doubles it once per probe."""
        with self._lock:
            if self._failures and not probe:
                return
            self._failures += 1
            self._open_until = self._clock() + self.window_s
            self._probe_until = 0.0

    def success(self) -> None:
        """The master answered: close."""
        if self._failures:  # the common path takes no lock
            with self._lock:
                self._failures, self._open_until, self._probe_until = 0, 0.0, 0.0
