"""``MooncakeBackend.exists`` with one failing key among real answers.

Why: a lookup asks ~12k keys in one ``batch_is_exist``; the backend checks the codes with
one ``min()`` on the common path. Every other test sees batches that fail as a whole (a
dead or stopped master), so a check that looked at the wrong end of the codes (``max``)
passed them all and would have read a failed key as "missing" -- a lookup answering for a
key nobody could check. A real master never mixes a failure into a batch's answers (it
answers 0 for empty, 5000-character and NUL keys alike), so that fault is PLANTED here: a
named wrapper over the real client rewrites one real answer into Mooncake's INTERNAL_ERROR
(-1; not a code that opens the unreachable-master breaker); the other keys are answered by
the real master. Shown failing: ``max(codes) < 0`` in the backend -> 3 of 3 fail.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any, Iterator

import pytest

from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.mooncake_backend import (
    CALL_TIMEOUT,
    CLIENT_STUCK,
    INTERNAL_ERROR,
    MooncakeBackend,
    StoreError,
)


class OneKeyFailsClient:
    """FAKE FAULT: the real Mooncake client, except that ``batch_is_exist`` answers
    ``code`` for the key at ``index`` (the real master's answer for the others)."""

    def __init__(self, real: Any, index: int, code: int) -> None:
        self._real, self._index, self._code = real, index, code

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        codes = list(self._real.batch_is_exist(keys))
        codes[self._index] = self._code
        return codes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture(scope="module")
def backend() -> Iterator[MooncakeBackend]:
    with EmbeddedMaster() as master:
        b = MooncakeBackend(
            master.address, global_segment_size=64 << 20, local_buffer_size=16 << 20, timeout_s=10.0
        )
        try:
            yield b
        finally:
            b.close()


@pytest.mark.parametrize("index", [0, 1, 2])
def test_one_failed_key_among_real_answers_raises_with_its_code(
    backend: MooncakeBackend, index: int
) -> None:
    present, missing = f"t/{uuid.uuid4().hex}", f"t/{uuid.uuid4().hex}"
    assert backend.put_bytes(present, b"x") == 0
    keys = [present, missing, present]
    assert backend.exists(keys) == [True, False, True]  # the real master's answers
    real = backend._store
    backend._store = OneKeyFailsClient(real, index, INTERNAL_ERROR)
    try:
        with pytest.raises(StoreError) as err:
            backend.exists(keys)
    finally:
        backend._store = real
    assert err.value.code == INTERNAL_ERROR
    assert "1 of 3 lookups failed" in str(err.value)
    assert backend.exists(keys) == [True, False, True]  # one failed call leaves nothing behind


# --- one query asked as concurrent parts (``exists(shards=)``, the scheduler's lookup) ---------
#
# Why: a 128k-token lookup asks ~12k keys; the backend splits them into contiguous parts in
# flight at once on its call pool and joins the answers. The faults that matter are the join
# (answers in completion order instead of key order, a part answering short) and the bound
# (one hung part must time out the query as a whole, be counted stuck, and heal).


class SlowPartsClient:
    """FAKE DELAY: the real client, except that a ``batch_is_exist`` whose keys include
    ``slow_key`` first waits on ``gate`` (at most ``max_wait_s``): that part returns last,
    or hangs until released. Answers are the real master's."""

    def __init__(self, real: Any, slow_key: str, gate: threading.Event, max_wait_s: float) -> None:
        self._real, self._slow, self._gate, self._max = real, slow_key, gate, max_wait_s
        self.calls: list[int] = []  # keys per call, in call order

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls.append(len(keys))
        if self._slow in keys:
            self._gate.wait(self._max)
        return self._real.batch_is_exist(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class ShortPartClient:
    """FAKE FAULT: the real client, except that the part holding ``key`` answers one code short."""

    def __init__(self, real: Any, key: str) -> None:
        self._real, self._key = real, key

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        codes = list(self._real.batch_is_exist(keys))
        return codes[:-1] if self._key in keys else codes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture(scope="module")
def pattern(backend: MooncakeBackend) -> tuple[list[str], list[bool]]:
    """40 keys, a random half stored: a misordered join reads wrong answers."""
    rng = random.Random(7)
    keys = [f"t/{uuid.uuid4().hex}" for _ in range(40)]
    want = [rng.random() < 0.5 for _ in keys]
    for k, ok in zip(keys, want):
        if ok:
            assert backend.put_bytes(k, b"x") == 0
    assert backend.exists(keys) == want
    return keys, want


@pytest.mark.parametrize("shards", [2, 3, 4, 7, 40, 100])
def test_parts_are_joined_in_key_order_whatever_returns_first(
    backend, pattern, shards: int
) -> None:
    """The FIRST part is held back until the others have answered, so a join in completion
    order (or a part dropped / answered twice) gives a different list."""
    keys, want = pattern
    real = backend._store
    gate = threading.Event()
    slow = SlowPartsClient(real, keys[0], gate, max_wait_s=0.3)  # part 0 returns last
    backend._store = slow
    try:
        assert backend.exists(keys, shards=shards) == want
    finally:
        backend._store = real
    n = min(shards, len(keys))
    assert len(slow.calls) == n and sum(slow.calls) == len(keys), (
        slow.calls
    )  # n parts, every key once


def test_a_failed_code_in_one_part_fails_the_whole_query(backend, pattern) -> None:
    keys, want = pattern
    real = backend._store
    backend._store = OneKeyFailsClient(real, 3, INTERNAL_ERROR)  # index 3 within EVERY part
    try:
        with pytest.raises(StoreError) as err:
            backend.exists(keys, shards=4)
    finally:
        backend._store = real
    assert err.value.code == INTERNAL_ERROR
    assert "4 of 40 lookups failed" in str(err.value)
    assert backend.exists(keys, shards=4) == want


def test_a_part_answering_short_is_an_error_not_a_shifted_answer(backend, pattern) -> None:
    keys, want = pattern
    real = backend._store
    backend._store = ShortPartClient(real, keys[15])
    try:
        with pytest.raises(StoreError) as err:
            backend.exists(keys, shards=4)
    finally:
        backend._store = real
    assert err.value.code == INTERNAL_ERROR and "answered 9 codes" in str(err.value)
    assert backend.exists(keys, shards=4) == want


def test_one_hung_part_times_out_the_query_and_heals(backend, pattern) -> None:
    """One part blocks (as a call on a hung master would): the query fails with CALL_TIMEOUT
    within ITS bound (not the parts' sum), only the hung part is counted stuck, a new query is
    refused while it is (CLIENT_STUCK, like any stuck metadata call), and all heals once it
    returns."""
    keys, want = pattern
    real = backend._store
    gate = threading.Event()
    backend._store = SlowPartsClient(real, keys[-1], gate, max_wait_s=20.0)  # the last part hangs
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError) as err:
            backend.exists(keys, timeout_s=0.3, shards=4)
        took = time.monotonic() - t0
        assert err.value.code == CALL_TIMEOUT and "1 of 4 concurrent calls" in str(err.value)
        assert 0.3 <= took < 2.0, took
        assert backend.stuck_calls == 1
        with pytest.raises(StoreError) as again:
            backend.exists(keys[:2], shards=2)
        assert again.value.code == CLIENT_STUCK
        pending = err.value.pending
        assert pending is not None and not pending.done()
        gate.set()
        pending.result(timeout=10)
        deadline = time.monotonic() + 10
        while backend.stuck_calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.stuck_calls == 0
    finally:
        gate.set()
        backend._store = real
    assert backend.exists(keys, shards=4) == want
