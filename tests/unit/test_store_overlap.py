"""The overlapped trailer check catches what the serial one catches, and writes the same bytes.

Why: the store data path now hashes sub-batch i+1 while sub-batch i is in the put and
verifies sub-batch i-1 while sub-batch i is in the get. A pipeline like that can lose a
check at its edges (the first sub-batch of a save, the LAST of a load, which is verified
after the loop) or pair a trailer with the wrong sub-batch's bytes. So, against a REAL
mooncake_master, with objects small enough that one job spans many sub-batches:

* a load's sub-batch plan covers every object once, in order, ramped as documented;
* an overlapped save stores exactly the objects a serial save stores (compared byte for
  byte, and with ``seal`` computed independently), and loads them back byte for byte;
* a planted fault in the first, a middle and the last sub-batch of a load (a one-block
  shift: another block's real, correctly sealed object under the victim key; a flipped
  byte; a truncated object; an old-format object; an object without the MAC where one
  is required) fails the request for its own reason, counts the objects before it as
  loaded (== its position) and removes what must be removed.
"""

from __future__ import annotations

import time

import pytest

from hybridkv.connector import pd_auth
from hybridkv.connector.store_worker import WorkerLimits, plan_spans
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.keys import KeySchema
from hybridkv.store.mooncake_backend import MooncakeBackend
from hybridkv.store.object_trailer import ObjectMac, seal
from tests.unit.store_rig import StoreRig, no_env_secret, rigs, store  # noqa: F401 - fixtures

NUM_BLOCKS = 40
JOB = 18  # blocks per job: 7 sub-batches with the limits below
OBJECT = 2 * 16 * 64 * 2  # one block of l0: [2, 16, 64] bf16 = 4 KiB
# Loads: sub-batches of ..., 4, 4, 2, 1 objects; saves: 1 object first, then up to 4 (sized
# by what was hashed during the previous put). The exposed edges are single objects.
OVERLAP = WorkerLimits(overlap_first_bytes=OBJECT, overlap_max_bytes=4 * OBJECT)
SERIAL = WorkerLimits(overlap_first_bytes=0)
SCHEMA = KeySchema(model_id="overlap", layout_id="fa16")


def test_load_sub_batch_plan_covers_every_object_once_ramped():
    mib = 1 << 20
    assert plan_spans([2 * mib] * 64, 256, 8 * mib, 128 * mib) == [
        (0, 4),
        (4, 12),
        (12, 28),
        (28, 60),
        (60, 64),
    ]
    # A load's plan is the mirror image: its last sub-batch (verified exposed) is the small one.
    assert plan_spans([2 * mib] * 64, 256, 8 * mib, 128 * mib, ramp_down=True) == [
        (0, 4),
        (4, 36),
        (36, 52),
        (52, 60),
        (60, 64),
    ]
    assert plan_spans([OBJECT] * JOB, 8, OBJECT, 4 * OBJECT) == [
        (0, 1),
        (1, 3),
        (3, 7),
        (7, 11),
        (11, 15),
        (15, 18),
    ]
    assert plan_spans([OBJECT] * JOB, 8, OBJECT, 4 * OBJECT, ramp_down=True) == [
        (0, 3),
        (3, 7),
        (7, 11),
        (11, 15),
        (15, 17),
        (17, 18),
    ]
    assert plan_spans([10] * 10, 4, 0, 0) == [(0, 4), (4, 8), (8, 10)]  # serial: plain batches
    assert plan_spans([10] * 10, 3, 1000, 1000) == [
        (0, 3),
        (3, 6),
        (6, 9),
        (9, 10),
    ]  # max_objects caps
    assert plan_spans([50, 5, 5, 50], 8, 20, 20) == [
        (0, 1),
        (1, 3),
        (3, 4),
    ]  # an object larger than the span
    assert plan_spans([], 8, 20, 20) == []


class Rig(StoreRig):
    """A StoreRig whose store calls are recorded: (op, objects, side work given)."""

    def __init__(self, master: EmbeddedMaster, limits: WorkerLimits, secret_file: str = "") -> None:
        super().__init__(
            master,
            SCHEMA,
            NUM_BLOCKS,
            seed=16,
            secret_file=secret_file,
            limits=limits,
            max_batch_blocks=8,
        )
        self.calls: list[tuple[str, int, bool]] = []
        for op in ("put_from_parts", "get_into_parts"):
            self._record(op)

    def _record(self, op: str) -> None:
        real = getattr(self.client, op)

        def recorded(keys, addrs, sizes, timeout_s=None, while_waiting=None):
            self.calls.append((op, len(keys), while_waiting is not None))
            return real(keys, addrs, sizes, timeout_s=timeout_s, while_waiting=while_waiting)

        setattr(self.client, op, recorded)


def _hashes(tag: str, n: int = JOB) -> list[bytes]:
    stamp = time.monotonic_ns()
    return [f"{tag}-{stamp}-{i}".encode().ljust(32, b".") for i in range(n)]


def _stored(holder: MooncakeBackend, hashes: list[bytes]) -> list[bytes | None]:
    return [holder.get_bytes(SCHEMA.key(0, h)) for h in hashes]


def _plant(holder: MooncakeBackend, key: str, data: bytes) -> None:
    holder.remove(key, force=True)
    assert holder.put_bytes(key, data) == 0


def test_overlapped_save_stores_the_serial_objects_and_loads_them_back(store, rigs):
    master, holder = store
    overlapped, serial = Rig(master, OVERLAP), Rig(master, SERIAL)
    rigs += [overlapped, serial]
    hashes, src = _hashes("same"), list(range(1, JOB + 1))
    serial.save(hashes, src)
    by_serial = _stored(holder, hashes)
    for h in hashes:
        assert holder.remove(SCHEMA.key(0, h), force=True) == 0
    overlapped.save(hashes, src)
    by_overlap = _stored(holder, hashes)
    assert by_overlap == by_serial
    assert by_overlap == [
        seal(SCHEMA.key(0, h), overlapped.payload(b), format_code=overlapped.worker.format_code)
        for h, b in zip(hashes, src)
    ]
    # Serial: 3 plain batches, no side work. Overlapped: sub-batch 0 is the one object of
    # overlap_first_bytes; the others are sized by what was hashed during the previous put
    # (timing-dependent), each at most max_batch_blocks, every put but the last with side work.
    assert serial.calls == [
        ("put_from_parts", 8, False),
        ("put_from_parts", 8, False),
        ("put_from_parts", 2, False),
    ]
    sizes = [n for _, n, _ in overlapped.calls]
    assert sizes[0] == 1 and sum(sizes) == JOB and max(sizes) <= 4 and len(sizes) >= 6, (
        overlapped.calls
    )
    assert [side for _, _, side in overlapped.calls] == [True] * (len(sizes) - 1) + [False]
    # Load into other blocks, byte for byte; each get but the first overlaps verifying the previous one.
    dst = list(range(NUM_BLOCKS - JOB, NUM_BLOCKS))
    overlapped.kv[dst] = 0
    overlapped.calls.clear()
    assert overlapped.load("round-trip", hashes, dst)
    assert [overlapped.payload(d) for d in dst] == [overlapped.payload(s) for s in src]
    assert overlapped.calls == [
        ("get_into_parts", n, i > 0) for i, n in enumerate((3, 4, 4, 4, 2, 1))
    ]
    assert overlapped.stats.get("loaded_blocks") == JOB and not any(
        k.startswith("fail") for k in overlapped.stats
    )


# Where a planted object sits in an 18-object load: sub-batches (0,3) (3,7) (7,11) (11,15) (15,17) (17,18).
POSITIONS = {"first": 0, "middle": 9, "last": JOB - 1}


def _shifted(rig: Rig, hashes: list[bytes], src: list[int], pos: int) -> bytes:
    """A one-block shift: the neighbour's real object (sealed under ITS key) under the victim's key."""
    other = pos - 1 if pos else pos + 1
    return seal(
        SCHEMA.key(0, hashes[other]), rig.payload(src[other]), format_code=rig.worker.format_code
    )


def _flipped(rig: Rig, hashes: list[bytes], src: list[int], pos: int) -> bytes:
    good = bytearray(
        seal(SCHEMA.key(0, hashes[pos]), rig.payload(src[pos]), format_code=rig.worker.format_code)
    )
    good[OBJECT // 2] ^= 0x04
    return bytes(good)


def _truncated(rig: Rig, hashes: list[bytes], src: list[int], pos: int) -> bytes:
    return seal(
        SCHEMA.key(0, hashes[pos]), rig.payload(src[pos]), format_code=rig.worker.format_code
    )[:-100]


def _old_format(rig: Rig, hashes: list[bytes], src: list[int], pos: int) -> bytes:
    good = bytearray(
        seal(SCHEMA.key(0, hashes[pos]), rig.payload(src[pos]), format_code=rig.worker.format_code)
    )
    good[OBJECT + 4] = (
        2  # trailer format version 2: right size, right check, format no longer spoken
    )
    return bytes(good)


FAULTS = {  # planted bytes, the load's fail cause, whether the worker removes the object
    "shift": (_shifted, "load_corrupt_object", True),
    "flipped": (_flipped, "load_corrupt_object", True),
    # Mooncake refuses a multi-buffer get of an object shorter than its regions (as the e2e sees).
    "truncated": (_truncated, "load_transfer_fail", False),
    "old_format": (_old_format, "load_format_mismatch", False),
}


@pytest.mark.parametrize("where", list(POSITIONS))
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_planted_fault_in_any_sub_batch_fails_the_load(store, rigs, fault, where):
    master, holder = store
    rig = Rig(master, OVERLAP)
    rigs.append(rig)
    hashes, src = _hashes(f"{fault}-{where}"), list(range(1, JOB + 1))
    rig.save(hashes, src)
    pos = POSITIONS[where]
    make, cause, removed = FAULTS[fault]
    victim = SCHEMA.key(0, hashes[pos])
    _plant(holder, victim, make(rig, hashes, src, pos))
    assert not rig.load(f"{fault}-{where}", hashes, list(range(NUM_BLOCKS - JOB, NUM_BLOCKS)))
    assert rig.stats.get(f"fail.{cause}") == 1, rig.stats
    assert rig.stats.get("loaded_blocks") == pos, (
        rig.stats
    )  # every object before it checked and good
    assert rig.stats.get("rank_failed_loads") == 1
    assert (holder.get_bytes(victim) is None) == removed
    assert rig.stats.get("removed_objects", 0) == int(removed)


@pytest.mark.parametrize("where", list(POSITIONS))
def test_without_the_mac_a_planted_object_in_any_sub_batch_is_refused(store, rigs, tmp_path, where):
    """The MAC composes with the overlap: an XXH3-only object (all a writer without the secret
    can make) is refused as unauthenticated and removed, wherever it sits."""
    master, holder = store
    secret = pd_auth.write_secret_file(tmp_path / "secret")
    rig = Rig(master, OVERLAP, secret_file=str(secret))
    rigs.append(rig)
    hashes, src = _hashes(f"mac-{where}"), list(range(1, JOB + 1))
    rig.save(hashes, src)
    mac = ObjectMac(
        secret.read_bytes().strip()
    )  # the secret as the worker reads it (test_store_mac's rule)
    stored = _stored(holder, hashes)
    assert stored == [
        seal(SCHEMA.key(0, h), rig.payload(b), mac, rig.worker.format_code)
        for h, b in zip(hashes, src)
    ]
    pos = POSITIONS[where]
    victim = SCHEMA.key(0, hashes[pos])
    _plant(
        holder, victim, seal(victim, rig.payload(src[pos]), format_code=rig.worker.format_code)
    )  # right bytes, XXH3 trailer, no MAC
    assert not rig.load(f"mac-{where}", hashes, list(range(NUM_BLOCKS - JOB, NUM_BLOCKS)))
    assert rig.stats.get("fail.load_unauthenticated_object") == 1, rig.stats
    assert rig.stats.get("loaded_blocks") == pos and holder.get_bytes(victim) is None
