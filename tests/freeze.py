"""Stop a process (SIGSTOP) and return only once every one of its threads has stopped.

Why: ``kill(pid, SIGSTOP)`` returns as soon as the signal is queued. The process stops when
one of its threads is next scheduled and hands the group stop to the others; until then the
rest keep running. On an idle host that is microseconds; on CI's busy 2-core host it was long
enough, by the likeliest reading, for a "stopped" Mooncake master to answer one more lookup
(CI 12-03 17:38: ``test_a_call_stuck_on_one_node_leaves_lookups_alone_a_hung_master_refuses_all``,
DID NOT RAISE). Not reproduced here: 60 SIGSTOP-then-lookup rounds beside 4 busy processes,
and 60 beside 6 at nice -15, were all refused. Whatever the cause of that one, a test that
asserts what a hung process does must start only once the process really is hung, and
waiting for that costs nothing.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterable

STOPPED_STATES = frozenset("TtZX")  # stopped, traced, zombie, dead: none runs our code again


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter of each thread of ``pid`` (``/proc/PID/task/*/stat``).

    Raises ``ProcessLookupError`` once the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    states: list[str] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # that thread exited meanwhile
        # The name (field 2) may hold spaces and ')'; the state follows the LAST ')'.
        states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


def wait_stopped(pids: Iterable[int], timeout_s: float = 10.0) -> None:
    """Block until every thread of every pid is stopped; AssertionError after ``timeout_s``
    naming the states seen (a process that cannot stop makes the test meaningless)."""
    pending = list(pids)
    deadline = time.monotonic() + timeout_s
    while pending:
        pid = pending[-1]
        try:
            states = thread_states(pid)
        except ProcessLookupError:
            pending.pop()  # gone: it runs nothing either
            continue
        if states and all(s in STOPPED_STATES for s in states):
            pending.pop()
            continue
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"pid {pid} not stopped {timeout_s:g} s after SIGSTOP: thread states {dict(Counter(states))}"
            )
        # Not faster: each round reads every thread's stat (~100 for a vLLM process) on 2 cores,
        # CPU that the threads still to stop need.
        time.sleep(0.005)


def freeze(*pids: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP each pid (one already gone is skipped), then :func:`wait_stopped` for all."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
            sent.append(pid)
        except ProcessLookupError:
            pass
    try:
        wait_stopped(sent, timeout_s)
    except AssertionError:
        # The callers resume in their own try/finally, entered only after this returns: a
        # process left stopped here would hang their teardown (an engine waiting on it).
        for pid in sent:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        raise
