"""The 16-byte trailer that makes a stored KV object self-checking.

A store can hand back an object of the right size with the wrong bytes (a
buggy or restarted node, a bit flip, a writer racing a replace). KV bytes have
no structure to sanity-check, so such an object would load silently and the
request would answer HTTP 200 with corrupted generations. Every object therefore
ends with a trailer::

    u32 MAGIC  "HKV3"          which trailer format this is
    u8  FORMAT_VERSION (4)     bumped whenever the layout or the check changes
    u8  tag kind               TAG_XXH3_64 (no deployment secret) or
                               TAG_BLAKE3_KEYED_64 (a MAC: see below); readers
                               refuse a kind they do not expect
    u16 block format code      ``block_format_code`` of the writer's block byte order
                               (vLLM's kernel-block split and KV layout); readers
                               refuse another code as a format mismatch
    u64 check                  XXH3-64 of the payload, seeded with XXH3-64 of the key;
                               or the MAC's first 8 bytes

so a flipped byte, a truncated object, a right payload stored under another key
(the seed differs) and an object written in another format (old 8-byte CRC-32
trailer, unknown version or tag kind, another block byte order) all fail and the
request recomputes.

Why the block format code: keys name a block by model, manager-block layout and prompt,
but vLLM's attention backend may split a manager block into kernel blocks, and under
some layouts (LBHNC with several heads) the split reorders the block's bytes. Two engines
sharing a master can then write the same key in two byte orders, each with a valid check;
only the writer's format code tells a reader the bytes are not in its order.

Why XXH3-64: every candidate (XXH3-64/128, CRC-32, CRC32C, BLAKE3) reads at about the
memory's speed on cold buffers; XXH3-64 is as fast as any, twice as wide as a CRC (a misplaced
or corrupted object passes with probability 2^-64, not 2^-32), releases the GIL (so the worker
hashes one sub-batch while another is in its store call: ``connector/store_worker.py``), and
ships cp311 wheels for x86_64 and aarch64 (``bench/store_data_path.py``, candidates table;
docs/results.md).

What it costs: a store call on a local segment is one memcpy, so a separate pass over the
bytes adds about a quarter of the job where it cannot overlap; no faster hash changes that,
only reading the bytes while they are in cache would, and the copy is inside Mooncake's call.
Overlapping the hash with the store call helps only where a core AND memory bandwidth are
spare. 2 MiB pages (``THP_MEM_ALLOC_ENABLE=1``) make the pass faster. It is NOT a MAC:
an adversary who can write objects can forge it; the keyed tag kind is where a
MAC over (key, length, check) or over the bytes belongs.

The MAC (anyone who reaches the master can write objects)
---------------------------------------------------------
With a deployment secret the check is a keyed BLAKE3 over ``u32 len(key) || key ||
payload`` under a key derived from the secret (``derive_key_context`` =
``MAC_CONTEXT``, so the store MAC can never equal a P/D message MAC made from the same
secret), truncated to 64 bits. Why over the BYTES and not a MAC over (key, length,
XXH3 of the payload), which would cost only the XXH3 pass we already make: XXH3 is not
collision resistant, and its seed here is public (the key), so an attacker who can
write objects and read one genuine object (payload P, tag T) can compute P' != P with
XXH3(P') == XXH3(P) and store P' with T -- a MAC over the hash authenticates the
hash, not the bytes. A MAC is only as strong as the collision resistance of what it
covers, so it must cover the payload with a keyed cryptographic hash. BLAKE3 is the
fastest such hash available and vLLM already depends on it (keyed BLAKE2b and
HMAC-SHA256 are several times slower): one pass at about half XXH3's speed, paid only
by deployments that set a secret. 64 bits of tag: a forgery is an online
guess (one store write and one victim load per try) that succeeds with probability
2^-64.

A reader with a secret refuses an XXH3-tagged object as ``UNAUTHENTICATED`` (a writer
without the secret, or a planted object); a reader without one refuses a MAC-tagged
object as a format mismatch (it cannot check it). Objects the reader refuses as
corrupt or unauthenticated are removed by the worker, so they are not offered again.

The trailer is written and read zero-copy like the payload: it is one more part
of the batched multi-buffer call, taken from a small registered arena.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from functools import lru_cache

import blake3
import numpy as np
import xxhash

TRAILER_BYTES = 16
MAGIC = 0x33564B48  # b"HKV3" little-endian
FORMAT_VERSION = 4  # 4: the block format code in the former reserved field
TAG_XXH3_64 = 0
TAG_BLAKE3_KEYED_64 = 1
MAC_CONTEXT = "hybridkv 2026 store object trailer MAC v1"
LEGACY_TRAILER_BYTES = 8  # format 2: u32 b"HVK2" + u32 CRC-32 (read back as a format mismatch)

# One trailer as numpy sees it (little-endian, packed).
_DTYPE = np.dtype(
    [("magic", "<u4"), ("version", "u1"), ("kind", "u1"), ("format", "<u2"), ("check", "<u8")]
)
assert _DTYPE.itemsize == TRAILER_BYTES

# What a load's trailer says, beyond "fine".
FORMAT_MISMATCH = "format_mismatch"
CORRUPT = "corrupt_object"
UNAUTHENTICATED = "unauthenticated_object"  # an XXH3 object where a MAC is required


@lru_cache(maxsize=256)
def _char_array(n: int) -> type:
    return ctypes.c_char * n


def block_format_code(block_formats: Sequence[str]) -> int:
    """The trailer's 16-bit code of a worker's block byte order (its groups'
    ``GroupLayout.block_formats``, in group order); never 0."""
    return 1 + xxhash.xxh3_64_intdigest("\n".join(block_formats).encode()) % 0xFFFF


@lru_cache(maxsize=1 << 16)
def key_seed(key: str) -> int:
    """The check's seed: binds an object to the key it was written under."""
    return xxhash.xxh3_64_intdigest(key.encode())


class ObjectMac:
    """The keyed tag of one deployment (the secret itself is never kept or printed)."""

    kind = TAG_BLAKE3_KEYED_64

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError(
                f"store MAC secret has {len(secret)} bytes; use at least 16 random bytes"
            )
        self._key = blake3.blake3(secret, derive_key_context=MAC_CONTEXT).digest()

    def __repr__(self) -> str:
        return "ObjectMac(<secret>)"

    def _start(self, key: str) -> "blake3.blake3":
        k = key.encode()
        h = blake3.blake3(key=self._key)
        h.update(len(k).to_bytes(4, "little") + k)
        return h

    def parts(self, key: str, addrs: Sequence[int], sizes: Sequence[int]) -> int:
        h = self._start(key)
        for a, s in zip(addrs, sizes):
            h.update(memoryview(_char_array(s).from_address(a)).cast("B"))  # blake3 needs strides
        return int.from_bytes(h.digest(8), "little")

    def of_bytes(self, key: str, payload: bytes) -> int:
        h = self._start(key)
        h.update(payload)
        return int.from_bytes(h.digest(8), "little")


def checksum_parts(
    key: str, addrs: Sequence[int], sizes: Sequence[int], mac: ObjectMac | None = None
) -> int:
    """The check of the regions of one object, in order: XXH3-64 seeded with its key, or ``mac``'s tag."""
    if mac is not None:
        return mac.parts(key, addrs, sizes)
    h = xxhash.xxh3_64(seed=key_seed(key))
    for a, s in zip(addrs, sizes):
        h.update(_char_array(s).from_address(a))
    return h.intdigest()


def checksum_bytes(key: str, payload: bytes, mac: ObjectMac | None = None) -> int:
    if mac is not None:
        return mac.of_bytes(key, payload)
    return xxhash.xxh3_64_intdigest(payload, seed=key_seed(key))


def tag_kind(mac: ObjectMac | None) -> int:
    return TAG_XXH3_64 if mac is None else mac.kind


def trailer_bytes(check: int, kind: int = TAG_XXH3_64, format_code: int = 0) -> bytes:
    t = np.zeros(1, dtype=_DTYPE)
    t[0] = (MAGIC, FORMAT_VERSION, kind, format_code, check)
    return t.tobytes()


def format_code_of(obj: bytes) -> int:
    """The block format code in a stored object's trailer (to re-seal a payload for its readers)."""
    return int.from_bytes(
        obj[len(obj) - TRAILER_BYTES + 6 : len(obj) - TRAILER_BYTES + 8], "little"
    )


def seal(key: str, payload: bytes, mac: ObjectMac | None = None, format_code: int = 0) -> bytes:
    """A complete object (payload + valid trailer, ``format_code`` of the reader it is for):
    for repair tools and fault tests."""
    return payload + trailer_bytes(checksum_bytes(key, payload, mac), tag_kind(mac), format_code)


def must_remove(verdict: str | None) -> bool:
    """Whether a refused object is wrong for EVERY reader of this deployment (remove it so it
    is not offered again): corrupt, or unauthenticated where a MAC is required. A format
    mismatch is not: another hybridkv version or a reader without the secret may read it."""
    return verdict in (CORRUPT, UNAUTHENTICATED)


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

    def __init__(
        self,
        slots: int,
        register: Callable[[int, int], None],
        kind: int = TAG_XXH3_64,
        format_code: int = 0,
    ) -> None:
        self.kind = kind  # the tag kind this reader/writer uses (and requires on load)
        self.format_code = format_code  # its block byte order (written, and required on load)
        self.rows = np.zeros(slots, dtype=_DTYPE)
        self.base = int(self.rows.ctypes.data)
        register(self.base, self.rows.nbytes)

    def addr(self, slot: int) -> int:
        return self.base + slot * TRAILER_BYTES

    def write(self, slot: int, check: int) -> None:
        self.rows[slot] = (MAGIC, FORMAT_VERSION, self.kind, self.format_code, check)

    def clear(self, count: int) -> None:
        self.rows[:count] = 0

    def verdict(self, slot: int, check: int) -> str | None:
        """None when the slot holds this format's trailer with ``check``; else why not."""
        row = self.rows[slot]
        if int(row["magic"]) != MAGIC or int(row["version"]) != FORMAT_VERSION:
            return FORMAT_MISMATCH
        if int(row["format"]) != self.format_code:
            return FORMAT_MISMATCH  # another block byte order: right for its writer, not for us
        if (kind := int(row["kind"])) != self.kind:
            return (
                UNAUTHENTICATED
                if self.kind == TAG_BLAKE3_KEYED_64 and kind == TAG_XXH3_64
                else FORMAT_MISMATCH
            )
        return None if int(row["check"]) == check else CORRUPT

    def holds(self, slot: int, check: int) -> bool:
        return self.verdict(slot, check) is None
