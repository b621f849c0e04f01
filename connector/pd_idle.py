"""Pacing of a P/D instance's empty engine steps while it only waits on leases.

vLLM keeps stepping an engine while a finished request's blocks are held by its connector
(``Scheduler.has_finished_requests`` counts requests waiting on a delayed free): a prefill
instance holding unread leases runs empty schedules back to back, a core per engine process
(and on a GPU host one collective RPC to every worker per step), for up to ``lease_s``
after every hand-over. Nothing changes on such a step except what the workers report
(a decode's release ends a lease), so the steps can be paced.

``IdlePacer.after_step(idle)`` runs at the end of the connector's ``build_connector_meta``
(inside ``schedule()``). On a step that schedules nothing while the connector only holds
leases or read-target pins, it pauses: ``MIN_PAUSE_S`` first, doubling per consecutive idle
step up to ``MAX_PAUSE_S``. A release arriving at a worker in this process (vLLM's
single-process executor) ends the pause at once (``wake``); with workers in other processes
the release is learned on the next paced step, within ``MAX_PAUSE_S``. Any step with work
resets the pacing, so a busy engine never pauses. The cost: a request arriving at an engine
that is idle apart from leases waits up to ``MAX_PAUSE_S`` before it is scheduled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

MIN_PAUSE_S = 0.001
MAX_PAUSE_S = 0.05

# Set by a prefill worker in this process when a decode's release arrives (pd_worker).
_WAKE = threading.Event()


def wake() -> None:
    """End any pause now: a lease was released (its blocks can be freed on this step)."""
    _WAKE.set()


class IdlePacer:
    """Counts consecutive idle steps and pauses after each (see the module docstring)."""

    def __init__(
        self,
        min_pause_s: float = MIN_PAUSE_S,
        max_pause_s: float = MAX_PAUSE_S,
        wait: Callable[[float], bool] | None = None,
    ) -> None:
        self._min, self._max = min_pause_s, max_pause_s
        self._wait = wait if wait is not None else _WAKE.wait
        self._pause = 0.0
        self.paused_s = 0.0  # total time paused (tests, debugging)
        self.idle_steps = 0

    def after_step(self, idle: bool) -> None:
        if not idle:
            self._pause = 0.0
            return
        self.idle_steps += 1
        self._pause = self._min if self._pause == 0.0 else min(self._max, self._pause * 2)
        t0 = time.monotonic()
        if self._wait(self._pause):
            _WAKE.clear()
            self._pause = 0.0  # a release came: step now, and keep the next pause short
        self.paused_s += time.monotonic() - t0


__all__ = ["IdlePacer", "MAX_PAUSE_S", "MIN_PAUSE_S", "wake"]
