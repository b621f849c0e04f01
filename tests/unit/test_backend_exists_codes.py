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

import uuid
from typing import Any, Iterator

import pytest

from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.mooncake_backend import INTERNAL_ERROR, MooncakeBackend, StoreError


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
        b = MooncakeBackend(master.address, global_segment_size=64 << 20, local_buffer_size=16 << 20, timeout_s=10.0)
        try:
            yield b
        finally:
            b.close()


@pytest.mark.parametrize("index", [0, 1, 2])
def test_one_failed_key_among_real_answers_raises_with_its_code(backend: MooncakeBackend, index: int) -> None:
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
