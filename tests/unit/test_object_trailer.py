"""The CRC trailer: the same answer from regions and from bytes, bound to its key."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hybridkv.store.call_pool import CallPool
from hybridkv.store.object_trailer import (
    MAGIC,
    TRAILER_BYTES,
    TrailerArena,
    checksum_bytes,
    checksum_parts,
    seal,
)


def _regions(arrays: list[np.ndarray]) -> tuple[list[int], list[int]]:
    return [int(a.ctypes.data) for a in arrays], [a.nbytes for a in arrays]


def test_regions_checksum_equals_checksum_of_their_concatenation():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4096, 17, 65536)]
    addrs, sizes = _regions(parts)
    payload = b"".join(p.tobytes() for p in parts)
    assert checksum_parts("k", addrs, sizes) == checksum_bytes("k", payload)
    sealed = seal("k", payload)
    assert len(sealed) == len(payload) + TRAILER_BYTES
    words = np.frombuffer(sealed[-TRAILER_BYTES:], dtype="<u4")
    assert int(words[0]) == MAGIC and int(words[1]) == checksum_bytes("k", payload)


def test_one_flipped_byte_or_another_key_changes_the_checksum():
    payload = bytearray(np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8).tobytes())
    good = checksum_bytes("hkv2/a", bytes(payload))
    assert checksum_bytes("hkv2/b", bytes(payload)) != good  # a right object under the wrong key
    payload[5000] ^= 1
    assert checksum_bytes("hkv2/a", bytes(payload)) != good


def test_arena_slots_are_registered_written_and_checked():
    registered: list[tuple[int, int]] = []
    arena = TrailerArena(4, lambda a, n: registered.append((a, n)))
    assert registered == [(arena.base, 4 * TRAILER_BYTES)]
    arena.write(2, 0xDEADBEEF)
    assert arena.holds(2, 0xDEADBEEF) and not arena.holds(2, 1) and not arena.holds(1, 0)
    raw = ctypes.string_at(arena.addr(2), TRAILER_BYTES)
    assert np.frombuffer(raw, dtype="<u4").tolist() == [MAGIC, 0xDEADBEEF]
    arena.clear(4)
    assert not arena.holds(2, 0xDEADBEEF)


def test_pool_never_hands_out_an_arena_twice_before_release():
    pool = CallPool(lambda: TrailerArena(2, lambda a, n: None))
    a, b = pool.acquire(), pool.acquire()
    assert a is not b
    pool.release(a)
    assert pool.acquire() is a


@pytest.mark.parametrize("size", [1, 255, 1 << 20])
def test_checksum_reads_memory_in_place(size):
    buf = np.arange(size, dtype=np.uint8)
    addrs, sizes = _regions([buf])
    assert checksum_parts("x", addrs, sizes) == checksum_bytes("x", buf.tobytes())
