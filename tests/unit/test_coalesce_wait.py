"""``PDTransport.wait`` does not put a timer sleep between a coalesced READ and its completion.

A coalesced GPU READ finishes in well under a millisecond; a 50-1000 us timer sleep after each
poll held such a READ to a quarter of the link on the H200. The wait's own loop is exercised
with a stand-in for ``poll`` (a READ that reports DONE after a few polls, no NIXL agent): the
question is only which sleeps the loop takes.
"""

from __future__ import annotations

import pytest

import hybridkv.connector.pd_transport as pdt


class _PollsDoneAfter:
    """Stand-in for a transport whose READ completes after ``n`` polls."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.polls = 0

    def poll(self, handle: object) -> str:
        self.polls += 1
        self.left -= 1
        return "DONE" if self.left <= 0 else "PROC"


def test_a_fast_read_is_waited_for_without_a_timer_sleep(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(pdt.time, "sleep", sleeps.append)
    fake = _PollsDoneAfter(6)
    handle = pdt.ReadHandle(peer="p", num_descs=16, nbytes=1 << 28)
    pdt.PDTransport.wait(fake, handle, 5.0)
    assert fake.polls == 6
    assert [s for s in sleeps if s > 0] == []


def test_a_slow_read_still_backs_off_and_times_out(monkeypatch):
    clock = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock[0] += max(s, 1e-4)  # each poll costs some time

    monkeypatch.setattr(pdt.time, "sleep", sleep)
    monkeypatch.setattr(pdt.time, "monotonic", lambda: clock[0])
    handle = pdt.ReadHandle(peer="p", num_descs=1, nbytes=1)
    with pytest.raises(pdt.TransferTimeout):
        pdt.PDTransport.wait(_PollsDoneAfter(10**9), handle, 0.05)
    positive = [s for s in sleeps if s > 0]
    assert positive[0] == 0.00005 and max(positive) == 0.001  # the backoff after the spin window
    # polls without a timer sleep for WAIT_SPIN_S (1e-4 s of clock per poll here), then backs off
    assert (
        int(pdt.WAIT_SPIN_S / 1e-4)
        <= sum(1 for s in sleeps if s == 0)
        <= int(pdt.WAIT_SPIN_S / 1e-4) + 2
    )
