"""READs that timed out but may still write: their blocks stay pinned until each settles.

NIXL cannot cancel a READ, and releasing its handle is not a fence (over UCX tcp a READ
from a stalled peer keeps writing its destination after release once the peer resumes;
pd_transport.release). So a decode rank whose READ timed out recomputes the request in OTHER
blocks, and keeps the READ's destination blocks out of vLLM's hands until the READ reports DONE
or fails (a dead peer fails at once); then ``on_settled(req_id)`` lets them go.

Why a class and one thread for all stragglers: a thread per straggler would leave one thread
and the blocks of every stranded request behind a peer stopped for good (SIGSTOP, a hung host),
with nothing telling the operator. One daemon thread polls them all, backing off to
``max_pause_s`` while nothing settles, and a request whose READs are still open after
``warn_after_s`` is logged once with the blocks it pins; ``pending()`` says how many requests are waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.connector.log_once import warn_once
from hybridkv.connector.pd_transport import TransferError
from hybridkv.store.logs import get_logger

logger = get_logger(__name__, "P/D")

FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 1.0
WARN_AFTER_S = 60.0


@dataclass
class _Straggler:
    handles: list[Any]
    blocks: int
    since: float
    warned: bool = field(default=False)


class StragglerDrain:
    """``add(req_id, handles, blocks)`` after a READ timed out; ``on_settled(req_id)`` runs on
    the drain thread once every handle has settled (DONE or failed) and been released."""

    def __init__(
        self,
        poll: Callable[[Any], str],
        release: Callable[[Any], None],
        on_settled: Callable[[str], None],
        *,
        warn_after_s: float = WARN_AFTER_S,
        max_pause_s: float = MAX_PAUSE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._poll, self._release, self._on_settled = poll, release, on_settled
        self.warn_after_s, self.max_pause_s, self._clock = warn_after_s, max_pause_s, clock
        self._cond = threading.Condition()
        self._pending: dict[str, _Straggler] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, req_id: str, handles: Sequence[Any], blocks: int) -> None:
        """Keep ``req_id``'s ``blocks`` destination blocks until ``handles`` all settle."""
        with self._cond:
            entry = self._pending.get(req_id)
            if entry is None:
                self._pending[req_id] = _Straggler(list(handles), blocks, self._clock())
            else:  # one job per request: unreachable, but must not drop handles
                entry.handles.extend(handles)
            if (self._thread is None or not self._thread.is_alive()) and not self._stopped:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name="hybridkv-pd-stragglers"
                )
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        """Requests whose timed-out READs have not all settled (their blocks still pinned)."""
        with self._cond:
            return len(self._pending)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _settle(self, handles: list[Any]) -> list[Any]:
        """Poll each handle; release the settled ones; return those still in flight. An error
        that is not a transfer's own failure says nothing about the READ: it stays in flight
        (its blocks kept), and the thread goes on serving the others."""
        still = []
        for handle in handles:
            try:
                if self._poll(handle) != "DONE":
                    still.append(handle)
                    continue
            except TransferError:
                pass  # failed: it writes nothing more
            except Exception as e:  # noqa: BLE001 - one odd handle must not stop the drain of all
                warn_once(
                    logger,
                    "pd_straggler_poll",
                    "polling a timed-out READ failed (%r); its blocks stay out of use",
                    e,
                )
                still.append(handle)
                continue
            try:
                self._release(handle)
            except Exception as e:  # noqa: BLE001 - settled: nothing writes its blocks any more
                warn_once(logger, "pd_straggler_release", "releasing a settled READ failed: %r", e)
        return still

    def _run(self) -> None:
        pause = FIRST_PAUSE_S
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                    pause = FIRST_PAUSE_S
                if self._stopped:
                    return
                items = [
                    (req_id, entry, list(entry.handles)) for req_id, entry in self._pending.items()
                ]
            settled = []
            for req_id, entry, polled in items:
                still = self._settle(polled)
                with self._cond:  # handles added meanwhile were appended after the polled ones
                    entry.handles = still + entry.handles[len(polled) :]
                    if not entry.handles:
                        self._pending.pop(req_id, None)
                        settled.append(req_id)
                        continue
                if not entry.warned and self._clock() - entry.since >= self.warn_after_s:
                    entry.warned = True
                    logger.warning(
                        "a timed-out READ for %s is still in flight after %.0f s; its %d "
                        "destination blocks stay out of use until it settles (is the prefill "
                        "instance stopped? killing it ends the READ)",
                        req_id,
                        self._clock() - entry.since,
                        entry.blocks,
                    )
            for req_id in settled:
                try:
                    self._on_settled(req_id)
                except Exception:  # noqa: BLE001 - the drain thread serves every other request too
                    logger.exception("freeing the blocks of %s failed", req_id)
            pause = FIRST_PAUSE_S if settled else min(self.max_pause_s, pause * 2)
            with self._cond:
                if not self._stopped:
                    self._cond.wait(pause)
