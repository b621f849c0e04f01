"""The object trailer: every wrong object it must catch is caught, each for its reason.

One byte flipped, a truncated object, another block's object under this key, an
object written in the old 8-byte CRC-32 format, a trailer of another version or
tag kind: each must fail (the request then recomputes), and a right object must
pass, whether the check reads the object from its regions or from bytes.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from hybridkv.store.call_pool import CallPool
from hybridkv.store.object_trailer import (
    CORRUPT,
    FORMAT_MISMATCH,
    FORMAT_VERSION,
    LEGACY_TRAILER_BYTES,
    MAGIC,
    TAG_BLAKE3_KEYED_64,
    TAG_XXH3_64,
    TRAILER_BYTES,
    UNAUTHENTICATED,
    ObjectMac,
    TrailerArena,
    checksum_bytes,
    checksum_parts,
    must_remove,
    seal,
    size_verdict,
)

KEY = "hkv2/m/l/g0/tp1.0-pp1.0/aa"
OTHER_KEY = "hkv2/m/l/g0/tp1.0-pp1.0/bb"


def _regions(arrays: list[np.ndarray]) -> tuple[list[int], list[int]]:
    return [int(a.ctypes.data) for a in arrays], [a.nbytes for a in arrays]


def _payload(seed: int, n: int = 8192) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _load(stored: bytes, key: str, payload_bytes: int) -> str | None:
    """What the worker concludes for one object: the store returns ``stored`` into the
    payload buffer plus a trailer slot (an arena), as the batched get does."""
    buf = np.zeros(payload_bytes, dtype=np.uint8)
    arena = TrailerArena(1, lambda a, n: None)
    arena.clear(1)
    code = len(stored)  # the get returns the stored object's size
    if (bad := size_verdict(code, payload_bytes)) is not None:
        return bad
    buf[:] = np.frombuffer(stored[:payload_bytes], dtype=np.uint8)
    ctypes.memmove(arena.addr(0), stored[payload_bytes:], TRAILER_BYTES)
    return arena.verdict(0, checksum_parts(key, *_regions([buf])))


def test_regions_checksum_equals_checksum_of_their_concatenation():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4096, 17, 65536)]
    addrs, sizes = _regions(parts)
    payload = b"".join(p.tobytes() for p in parts)
    assert checksum_parts("k", addrs, sizes) == checksum_bytes("k", payload)
    sealed = seal("k", payload)
    assert len(sealed) == len(payload) + TRAILER_BYTES == len(payload) + 16
    trailer = sealed[-TRAILER_BYTES:]
    assert int.from_bytes(trailer[:4], "little") == MAGIC
    assert (trailer[4], trailer[5], trailer[6:8]) == (FORMAT_VERSION, TAG_XXH3_64, b"\0\0")
    assert int.from_bytes(trailer[8:], "little") == checksum_bytes("k", payload)


def test_a_right_object_loads():
    payload = _payload(1)
    assert _load(seal(KEY, payload), KEY, len(payload)) is None


@pytest.mark.parametrize("where", [0, 4095, 8191])
def test_one_flipped_byte_is_caught(where):
    payload = _payload(2)
    stored = bytearray(seal(KEY, payload))
    stored[where] ^= 0x10
    assert _load(bytes(stored), KEY, len(payload)) == CORRUPT


def test_a_flipped_trailer_byte_is_caught():
    payload = _payload(2)
    stored = bytearray(seal(KEY, payload))
    stored[-1] ^= 0x01
    assert _load(bytes(stored), KEY, len(payload)) == CORRUPT


@pytest.mark.parametrize("cut", [1, 7, 9, TRAILER_BYTES, 4096])
def test_a_truncated_object_is_caught(cut):
    payload = _payload(3)
    stored = seal(KEY, payload)[:-cut]
    verdict = _load(stored, KEY, len(payload))
    # 8 bytes short is exactly the old format's size: refused as a format mismatch.
    assert verdict == (
        FORMAT_MISMATCH if cut == TRAILER_BYTES - LEGACY_TRAILER_BYTES else "short_object"
    )


def test_another_blocks_object_under_this_key_is_caught():
    """A whole, valid object of ANOTHER block stored under this key (a misplaced write)."""
    other = seal(OTHER_KEY, _payload(4))
    assert _load(other, OTHER_KEY, 8192) is None  # it is a good object for its own key
    assert _load(other, KEY, 8192) == CORRUPT


def test_an_old_format_object_is_a_format_mismatch_not_a_crash():
    """Format 2: payload + u32 b"HVK2" + u32 CRC-32 seeded with the key's CRC (8 bytes)."""
    payload = _payload(5)
    old = (
        payload
        + np.asarray([0x324B5648, zlib.crc32(payload, zlib.crc32(KEY.encode()))], "<u4").tobytes()
    )
    assert len(old) == len(payload) + LEGACY_TRAILER_BYTES
    assert _load(old, KEY, len(payload)) == FORMAT_MISMATCH


@pytest.mark.parametrize(
    "field, value",
    [("version", FORMAT_VERSION + 1), ("version", 2), ("kind", 1), ("magic", 0x324B5648)],
)
def test_a_trailer_of_another_version_or_tag_kind_is_a_format_mismatch(field, value):
    """Same size, right check, but a format this reader does not speak: refused, not trusted."""
    payload = _payload(6)
    stored = bytearray(seal(KEY, payload))
    t = len(payload)
    if field == "magic":
        stored[t : t + 4] = value.to_bytes(4, "little")
    else:
        stored[t + (4 if field == "version" else 5)] = value
    assert _load(bytes(stored), KEY, len(payload)) == FORMAT_MISMATCH


def test_arena_slots_are_registered_written_and_checked():
    registered: list[tuple[int, int]] = []
    arena = TrailerArena(4, lambda a, n: registered.append((a, n)))
    assert registered == [(arena.base, 4 * TRAILER_BYTES)]
    arena.write(2, 0xDEADBEEF_01234567)
    assert arena.holds(2, 0xDEADBEEF_01234567)
    assert arena.verdict(2, 1) == CORRUPT and arena.verdict(1, 0) == FORMAT_MISMATCH
    raw = ctypes.string_at(arena.addr(2), TRAILER_BYTES)
    assert (
        int.from_bytes(raw[:4], "little") == MAGIC
        and int.from_bytes(raw[8:], "little") == 0xDEADBEEF_01234567
    )
    arena.clear(4)
    assert arena.verdict(2, 0xDEADBEEF_01234567) == FORMAT_MISMATCH


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


# --- the keyed tag ------------------------------------------------------------------

SECRET = b"0123456789abcdef0123456789abcdef"


def _load_mac(stored: bytes, key: str, payload_bytes: int, mac: ObjectMac | None) -> str | None:
    buf = np.zeros(payload_bytes, dtype=np.uint8)
    arena = TrailerArena(1, lambda a, n: None, TAG_XXH3_64 if mac is None else mac.kind)
    if (bad := size_verdict(len(stored), payload_bytes)) is not None:
        return bad
    buf[:] = np.frombuffer(stored[:payload_bytes], dtype=np.uint8)
    ctypes.memmove(arena.addr(0), stored[payload_bytes:], TRAILER_BYTES)
    return arena.verdict(0, checksum_parts(key, *_regions([buf]), mac))


def test_mac_over_regions_equals_mac_over_bytes_and_differs_per_secret_and_key():
    rng = np.random.default_rng(9)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4096, 17, 65536)]
    payload = b"".join(p.tobytes() for p in parts)
    mac = ObjectMac(SECRET)
    assert checksum_parts("k", *_regions(parts), mac) == checksum_bytes("k", payload, mac)
    assert checksum_bytes("k", payload, mac) != checksum_bytes(
        "k", payload, ObjectMac(SECRET[::-1])
    )
    assert checksum_bytes("k", payload, mac) != checksum_bytes("k2", payload, mac)
    assert checksum_bytes("k", payload, mac) != checksum_bytes("k", payload)
    assert seal("k", payload, mac)[-TRAILER_BYTES + 5] == TAG_BLAKE3_KEYED_64
    assert "0123" not in repr(mac)


def test_mac_verdicts():
    payload, mac = _payload(11), ObjectMac(SECRET)
    assert _load_mac(seal(KEY, payload, mac), KEY, len(payload), mac) is None
    assert _load_mac(seal(KEY, payload), KEY, len(payload), mac) == UNAUTHENTICATED  # XXH3 only
    flipped = bytearray(seal(KEY, payload, mac))
    flipped[100] ^= 1
    assert _load_mac(bytes(flipped), KEY, len(payload), mac) == CORRUPT
    assert _load_mac(seal(KEY, payload, ObjectMac(SECRET[::-1])), KEY, len(payload), mac) == CORRUPT
    assert (
        _load_mac(seal(KEY, payload, mac), KEY, len(payload), None) == FORMAT_MISMATCH
    )  # cannot check
    assert [
        must_remove(v) for v in (None, CORRUPT, UNAUTHENTICATED, FORMAT_MISMATCH, "short_object")
    ] == [False, True, True, False, False]


def test_mac_refuses_a_short_secret():
    with pytest.raises(ValueError, match="at least 16"):
        ObjectMac(b"short")
