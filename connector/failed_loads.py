"""A connector's failed async loads, and the one admission each must skip (vLLM 0.32/0.33).

Why: vLLM frees a failed async load's blocks only when ``schedule()`` reaches the request
in ``kv_holding_waiting``, and its waiting loop stops at the first request there that
cannot allocate. When several loads fail in one step (a store node or a prefill instance
died), the first failed request, now holding nothing, needs its whole prompt
(``full_sequence_must_fit``) while the failed loads queued behind it still hold the blocks
it needs: nothing runs, nothing frees, the engine stalls until clients give up. A
connector whose ``get_num_new_matched_tokens`` answers ``None`` ("not known yet") once for
that request lets it leave ``kv_holding_waiting`` holding nothing, so the same step
reaches and frees the others. The vLLM code, the reproducers and the fix to report upstream:
docs/vllm_upstream.md, section 1.

Only a connector's OWN loads owe the deferral (under MultiConnector every child sees every
child's ``failed_recving``; two deferrals would skip the request twice). But once ANY
connector's load of a request failed, no connector may offer that request another async load
(``load_failed``; a connector that tracks the request records another's failure with
``mark``'s ``is_tracked``): vLLM keeps the failed request in ``_inflight_prefills`` after
freeing its blocks, and an async admission then reserves that stale entry's whole prompt on
top of the request's own allocation, twice its prompt. Where that does not fit the waiting
loop stops at it every step with nothing running (docs/vllm_upstream.md, section 4). A plain
admission (the request recomputes) clears the entry.

Used by both connector schedulers (``StoreScheduler``, ``PDScheduler``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class FailedLoads:
    """Requests whose load this connector posted failed, each with its deferral still owed
    or already taken; remembered until the request finishes."""

    def __init__(self) -> None:
        self._owed: dict[str, bool] = {}  # request id -> its one skipped admission is still to come
        self.deferrals = 0  # admissions skipped so far

    def mark(
        self,
        failed: Iterable[str],
        is_own: Callable[[str], bool],
        is_tracked: Callable[[str], bool] = lambda _r: False,
    ) -> None:
        """Remember the failed loads (``KVConnectorOutput.failed_recving``): those ``is_own``
        says this connector posted owe one deferral; another connector's failure of a request
        ``is_tracked`` (one this connector will be asked about again, and will forget when it
        finishes) owes none but counts as failed (``load_failed``)."""
        for r in failed:
            if is_own(r):
                self._owed[r] = True
            elif is_tracked(r):
                self._owed.setdefault(r, False)

    def take_deferral(self, request_id: str) -> bool:
        """True exactly once after the request's load failed: skip this admission
        (``get_num_new_matched_tokens`` answers ``None``). Counted in ``deferrals``."""
        if not self._owed.get(request_id):
            return False
        self._owed[request_id] = False
        self.deferrals += 1
        return True

    def load_failed(self, request_id: str) -> bool:
        """Did a load of the request fail (this connector's, deferral taken or not, or a
        tracked request's load by another connector)? Until the request finishes: a connector
        must not offer it an async load again (the module docstring says why)."""
        return request_id in self._owed

    def forget(self, request_id: str) -> None:
        """The request finished: nothing owed, nothing remembered."""
        self._owed.pop(request_id, None)

    def __len__(self) -> int:
        """Requests remembered (a finished request is not)."""
        return len(self._owed)
