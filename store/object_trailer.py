"""The 16-byte trailer that makes a stored KV object self-checking.

A store can hand back an object of the right size with the wrong bytes (a
buggy or restarted node, a bit flip, a writer racing a replace). KV bytes have
no structure to sanity-check, so such an object would load silently and the
request would answer HTTP 200 with corrupted generations. Every object therefore
ends with a trailer::

    u32 MAGIC  "HKV3"          which trailer format this is
    u8  FORMAT_VERSION (3)     bumped whenever the layout or the check changes
    u8  tag kind               TAG_XXH3_64 today; a keyed tag (the trust issue's MAC)
                               gets its own kind and may grow the trailer: readers
                               refuse a kind they do not know as a format mismatch
    u16 reserved (0)
    u64 check                  XXH3-64 of the payload, seeded with XXH3-64 of the key

so a flipped byte, a truncated object, a right payload stored under another key
(the seed differs) and an object written in another format (old 8-byte CRC-32
trailer, unknown version or tag kind) all fail and the request recomputes.

Why XXH3-64 (measured in ``bench/store_data_path.py``, checksum table): on this
machine's cold memory every candidate (ISA-L CRC-32, hardware CRC32C, XXH3,
BLAKE3) runs at memory speed or below, XXH3-64 as fast as ISA-L CRC-32, twice as
wide (a misplaced or corrupted object passes with probability 2^-64, not 2^-32),
releases the GIL, and ships cp311 wheels for x86_64 and aarch64. It is NOT a MAC:
an adversary who can write objects can forge it; the keyed tag kind is where a
MAC over (key, length, check) or over the bytes belongs.

The trailer is written and read zero-copy like the payload: it is one more part
of the batched multi-buffer call, taken from a small registered arena.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np
import xxhash

TRAILER_BYTES = 16
MAGIC = 0x33564B48  # b"HKV3" little-endian
FORMAT_VERSION = 3
TAG_XXH3_64 = 0
LEGACY_TRAILER_BYTES = 8  # format 2: u32 b"HVK2" + u32 CRC-32 (read back as a format mismatch)

# One trailer as numpy sees it (little-endian, packed).
_DTYPE = np.dtype([("magic", "<u4"), ("version", "u1"), ("kind", "u1"), ("reserved", "<u2"), ("check", "<u8")])
assert _DTYPE.itemsize == TRAILER_BYTES

# What a load's trailer says, beyond "fine".
FORMAT_MISMATCH = "format_mismatch"
CORRUPT = "corrupt_object"


@lru_cache(maxsize=256)
def _char_array(n: int) -> type:
    return ctypes.c_char * n


@lru_cache(maxsize=1 << 16)
def key_seed(key: str) -> int:
    """The check's seed: binds an object to the key it was written under."""
    return xxhash.xxh3_64_intdigest(key.encode())


def checksum_parts(key: str, addrs: Sequence[int], sizes: Sequence[int]) -> int:
    """XXH3-64 over the regions of one object, in order, seeded with its key."""
    h = xxhash.xxh3_64(seed=key_seed(key))
    for a, s in zip(addrs, sizes):
        h.update(_char_array(s).from_address(a))
    return h.intdigest()


def checksum_bytes(key: str, payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=key_seed(key))


def trailer_bytes(check: int) -> bytes:
    t = np.zeros(1, dtype=_DTYPE)
    t[0] = (MAGIC, FORMAT_VERSION, TAG_XXH3_64, 0, check)
    return t.tobytes()


def seal(key: str, payload: bytes) -> bytes:
    """A complete object (payload + valid trailer): for repair tools and fault tests."""
    return payload + trailer_bytes(checksum_bytes(key, payload))


def size_verdict(code: int, payload_bytes: int) -> str | None:
    """What a load's returned size says: None (right size), a format mismatch (an object
    carrying the format-2 8-byte trailer), or a short / odd-sized object."""
    if code == payload_bytes + TRAILER_BYTES:
        return None
    if code == payload_bytes + LEGACY_TRAILER_BYTES:
        return FORMAT_MISMATCH
    return "short_object"


class TrailerArena:
    """Registered room for the trailers of one batch call (``slots`` objects)."""

    def __init__(self, slots: int, register: Callable[[int, int], None]) -> None:
        self.rows = np.zeros(slots, dtype=_DTYPE)
        self.base = int(self.rows.ctypes.data)
        register(self.base, self.rows.nbytes)

    def addr(self, slot: int) -> int:
        return self.base + slot * TRAILER_BYTES

    def write(self, slot: int, check: int) -> None:
        self.rows[slot] = (MAGIC, FORMAT_VERSION, TAG_XXH3_64, 0, check)

    def clear(self, count: int) -> None:
        self.rows[:count] = 0

    def verdict(self, slot: int, check: int) -> str | None:
        """None when the slot holds this format's trailer with ``check``; else why not."""
        row = self.rows[slot]
        if int(row["magic"]) != MAGIC or int(row["version"]) != FORMAT_VERSION or int(row["kind"]) != TAG_XXH3_64:
            return FORMAT_MISMATCH
        return None if int(row["check"]) == check else CORRUPT

    def holds(self, slot: int, check: int) -> bool:
        return self.verdict(slot, check) is None
