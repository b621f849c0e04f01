"""Store objects MACed with the deployment secret (issue 13), against a REAL mooncake_master.

Why real: the attack is a process that reaches the master and writes an object; here a
second Mooncake client (holding the store's memory, no secret) plants objects with
``put``, and a real StoreWorker with the secret loads them through the batched
zero-copy get it always uses. What must hold: a planted object with a correct XXH3
trailer (all a writer without the secret can make) is refused and removed, so the
next lookup does not offer it; a correctly MACed one loads byte for byte; one flipped
byte is refused and removed; a reader without the secret neither trusts nor removes a
MACed object.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from hybridkv.connector import pd_auth
from hybridkv.connector.store_config import ConfigError, StoreConnectorConfig
from hybridkv.connector.store_metadata import BlockBatch, LoadJob, SaveJob, StoreConnectorMetadata
from hybridkv.connector.store_worker import StoreWorker
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.keys import KeySchema
from hybridkv.store.mooncake_backend import MooncakeBackend
from hybridkv.store.object_trailer import (
    TAG_BLAKE3_KEYED_64,
    TRAILER_BYTES,
    ObjectMac,
    checksum_bytes,
    seal,
)

NUM_BLOCKS = 8
SCHEMA = KeySchema(model_id="mac", layout_id="fa16")


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[EmbeddedMaster, MooncakeBackend]]:
    """A master and the client that holds the store's memory: also the attacker's client
    (it has no secret and writes whatever it likes)."""
    with EmbeddedMaster(default_kv_lease_ttl_ms=500) as master, MooncakeBackend(
        master.address, global_segment_size=32 << 20, local_buffer_size=4 << 20
    ) as planter:
        yield master, planter


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch):
    monkeypatch.delenv(pd_auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(pd_auth.SECRET_FILE_ENV, raising=False)


@pytest.fixture
def secret_file(tmp_path):
    return pd_auth.write_secret_file(tmp_path / "secret")


class Rig:
    """A StoreWorker over a one-group host KV cache (block b = bytes of ``kv[b]``)."""

    def __init__(self, master: EmbeddedMaster, secret_file: str = "", seed: int = 13) -> None:
        self.client = MooncakeBackend(master.address, global_segment_size=0, local_buffer_size=4 << 20)
        self.kv = torch.randn(NUM_BLOCKS, 2, 16, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
        cfg = StoreConnectorConfig(master_address=master.address, auth_secret_file=secret_file)
        self.worker = StoreWorker(cfg, kvc, SCHEMA, self.client)
        self.worker.register_kv_caches({"l0": self.kv})
        self.stats: dict = {}

    def payload(self, block: int) -> bytes:
        return self.kv[block].view(torch.int16).numpy().tobytes()

    def load(self, req: str, h: bytes, dst: int) -> bool:
        batch = BlockBatch()
        batch.add(0, h, dst)
        self.worker.start_load_kv(StoreConnectorMetadata(loads=[LoadJob(req, batch, load_id=1)]))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            res = self.worker.get_transfer_results()
            if req in res.finished_recving:
                self._take_stats()
                return req not in res.failed_recving
            time.sleep(0.005)
        raise AssertionError(f"load {req} did not finish")

    def save(self, h: bytes, src: int) -> None:
        batch = BlockBatch()
        batch.add(0, h, src)
        self.worker.wait_for_save(StoreConnectorMetadata(saves=[SaveJob(7, batch, sync=True)]))
        self._take_stats()
        assert self.stats.get("saved_blocks") == 1, self.stats

    def _take_stats(self) -> None:
        s = self.worker.take_stats()
        for k, v in (s.data.items() if s is not None else ()):
            if not isinstance(v, list):
                self.stats[k] = self.stats.get(k, 0) + v

    def close(self) -> None:
        self.worker.shutdown(timeout_s=2.0)
        self.client.close()


@pytest.fixture
def rigs(store) -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for r in made:
        r.close()


def _key(tag: str) -> tuple[bytes, str]:
    h = f"{tag}-{time.monotonic_ns()}".encode().ljust(32, b".")
    return h, SCHEMA.key(0, h)


def _secret(path) -> bytes:
    return path.read_bytes().strip()


def test_planted_object_without_the_mac_is_refused_and_removed(store, rigs, secret_file):
    master, planter = store
    rig = Rig(master, str(secret_file))
    rigs.append(rig)
    h, key = _key("planted")
    poison = bytes(np.random.default_rng(1).integers(0, 256, len(rig.payload(0)), dtype=np.uint8))
    assert planter.put_bytes(key, seal(key, poison)) == 0  # a correct XXH3 trailer
    before = rig.kv[3].clone()
    assert planter.exists([key]) == [True]
    assert rig.load("A", h, 3) is False
    assert rig.stats.get("fail.load_unauthenticated_object") == 1, rig.stats
    assert rig.stats.get("removed_objects") == 1, rig.stats
    assert planter.exists([key]) == [False]  # not offered to the next lookup
    assert rig.kv[3].view(torch.int16).numpy().tobytes() in (poison, before.view(torch.int16).numpy().tobytes())


def test_object_with_the_mac_loads_byte_for_byte(store, rigs, secret_file):
    master, planter = store
    rig = Rig(master, str(secret_file))
    rigs.append(rig)
    h, key = _key("good")
    payload = rig.payload(5)
    assert planter.put_bytes(key, seal(key, payload, ObjectMac(_secret(secret_file)))) == 0
    rig.kv[2] = 0
    assert rig.load("B", h, 2) is True
    assert rig.kv[2].view(torch.int16).numpy().tobytes() == payload
    assert rig.stats.get("loaded_blocks") == 1 and "removed_objects" not in rig.stats


@pytest.mark.parametrize("where", [0, 2047, -TRAILER_BYTES + 9, -1])
def test_flipped_byte_in_a_maced_object_is_refused_and_removed(store, rigs, secret_file, where):
    master, planter = store
    rig = Rig(master, str(secret_file))
    rigs.append(rig)
    h, key = _key("flip")
    obj = bytearray(seal(key, rig.payload(1), ObjectMac(_secret(secret_file))))
    obj[where] ^= 0x04
    assert planter.put_bytes(key, bytes(obj)) == 0
    assert rig.load("C", h, 4) is False
    assert rig.stats.get("fail.load_corrupt_object") == 1, rig.stats
    assert planter.exists([key]) == [False]


def test_the_mac_binds_the_key(store, rigs, secret_file):
    """A genuine MACed object copied under another key (the attacker can read and write)."""
    master, planter = store
    rig = Rig(master, str(secret_file))
    rigs.append(rig)
    (h, key), (_, other) = _key("victim"), _key("source")
    assert planter.put_bytes(key, seal(other, rig.payload(1), ObjectMac(_secret(secret_file)))) == 0
    assert rig.load("D", h, 4) is False
    assert rig.stats.get("fail.load_corrupt_object") == 1, rig.stats


def test_saved_objects_carry_the_mac_and_a_reader_without_the_secret_neither_trusts_nor_removes_them(
    store, rigs, secret_file
):
    master, planter = store
    writer, plain = Rig(master, str(secret_file)), Rig(master, "", seed=99)
    rigs += [writer, plain]
    h, key = _key("saved")
    writer.save(h, 6)
    obj = planter.get_bytes(key)
    payload = writer.payload(6)
    assert obj is not None and obj[: len(payload)] == payload
    trailer = obj[len(payload):]
    assert trailer[5] == TAG_BLAKE3_KEYED_64
    assert int.from_bytes(trailer[8:], "little") == checksum_bytes(key, payload, ObjectMac(_secret(secret_file)))
    assert int.from_bytes(trailer[8:], "little") != checksum_bytes(key, payload)  # not the XXH3
    assert plain.load("E", h, 0) is False
    assert plain.stats.get("fail.load_format_mismatch") == 1, plain.stats
    assert planter.exists([key]) == [True]  # left for the readers that can check it
    assert writer.load("F", h, 1) is True
    assert writer.kv[1].view(torch.int16).numpy().tobytes() == payload


def test_without_a_secret_a_planted_object_loads_as_before(store, rigs):
    """The documented risk of running without a secret (logged at startup): XXH3 is no MAC."""
    master, planter = store
    rig = Rig(master, "")
    rigs.append(rig)
    h, key = _key("nosecret")
    poison = bytes(len(rig.payload(0)))
    assert planter.put_bytes(key, seal(key, poison)) == 0
    assert rig.load("G", h, 7) is True
    assert rig.kv[7].view(torch.int16).numpy().tobytes() == poison


def test_secret_from_the_environment_is_the_p_d_one(store, rigs, secret_file, monkeypatch):
    master, planter = store
    monkeypatch.setenv(pd_auth.SECRET_ENV, _secret(secret_file).decode())
    rig = Rig(master, "")
    rigs.append(rig)
    h, key = _key("env")
    assert planter.put_bytes(key, seal(key, rig.payload(2))) == 0
    assert rig.load("H", h, 3) is False
    assert rig.stats.get("fail.load_unauthenticated_object") == 1, rig.stats


def test_config_key_is_validated(tmp_path):
    assert StoreConnectorConfig.from_extra_config({"auth_secret_file": "/x"}).auth_secret_file == "/x"
    with pytest.raises(ConfigError, match="auth_secret_file"):
        StoreConnectorConfig.from_extra_config({"auth_secret_file": 5})
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    from hybridkv.connector.store_auth import store_object_mac

    with pytest.raises(ConfigError, match="at least 16"):
        store_object_mac(StoreConnectorConfig(auth_secret_file=str(short)))
