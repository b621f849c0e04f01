"""Store objects MACed with the deployment secret, against a REAL mooncake_master.

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

import numpy as np
import pytest
import torch

from hybridkv.connector import pd_auth
from hybridkv.connector.store_config import ConfigError, StoreConnectorConfig
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.keys import KeySchema
from hybridkv.store.object_trailer import (
    TAG_BLAKE3_KEYED_64,
    TRAILER_BYTES,
    ObjectMac,
    checksum_bytes,
    seal,
)
from tests.unit.store_rig import StoreRig, no_env_secret, rigs, store  # noqa: F401 - fixtures

NUM_BLOCKS = 8
SCHEMA = KeySchema(model_id="mac", layout_id="fa16")


@pytest.fixture
def secret_file(tmp_path):
    return pd_auth.write_secret_file(tmp_path / "secret")


def _rig(master: EmbeddedMaster, secret_file: str = "", seed: int = 13) -> StoreRig:
    return StoreRig(master, SCHEMA, NUM_BLOCKS, seed=seed, secret_file=secret_file)


def _key(tag: str) -> tuple[bytes, str]:
    h = f"{tag}-{time.monotonic_ns()}".encode().ljust(32, b".")
    return h, SCHEMA.key(0, h)


def _secret(path) -> bytes:
    return path.read_bytes().strip()


def test_planted_object_without_the_mac_is_refused_and_removed(store, rigs, secret_file):
    master, planter = store
    rig = _rig(master, str(secret_file))
    rigs.append(rig)
    h, key = _key("planted")
    poison = bytes(np.random.default_rng(1).integers(0, 256, len(rig.payload(0)), dtype=np.uint8))
    assert (
        planter.put_bytes(key, seal(key, poison, format_code=rig.worker.format_code)) == 0
    )  # a correct XXH3 trailer
    before = rig.kv[3].clone()
    assert planter.exists([key]) == [True]
    assert rig.load("A", [h], [3]) is False
    assert rig.stats.get("fail.load_unauthenticated_object") == 1, rig.stats
    assert rig.stats.get("removed_objects") == 1, rig.stats
    assert planter.exists([key]) == [False]  # not offered to the next lookup
    assert rig.kv[3].view(torch.int16).numpy().tobytes() in (
        poison,
        before.view(torch.int16).numpy().tobytes(),
    )


def test_object_with_the_mac_loads_byte_for_byte(store, rigs, secret_file):
    master, planter = store
    rig = _rig(master, str(secret_file))
    rigs.append(rig)
    h, key = _key("good")
    payload = rig.payload(5)
    assert (
        planter.put_bytes(
            key, seal(key, payload, ObjectMac(_secret(secret_file)), rig.worker.format_code)
        )
        == 0
    )
    rig.kv[2] = 0
    assert rig.load("B", [h], [2]) is True
    assert rig.kv[2].view(torch.int16).numpy().tobytes() == payload
    assert rig.stats.get("loaded_blocks") == 1 and "removed_objects" not in rig.stats


@pytest.mark.parametrize("where", [0, 2047, -TRAILER_BYTES + 9, -1])
def test_flipped_byte_in_a_maced_object_is_refused_and_removed(store, rigs, secret_file, where):
    master, planter = store
    rig = _rig(master, str(secret_file))
    rigs.append(rig)
    h, key = _key("flip")
    obj = bytearray(
        seal(key, rig.payload(1), ObjectMac(_secret(secret_file)), rig.worker.format_code)
    )
    obj[where] ^= 0x04
    assert planter.put_bytes(key, bytes(obj)) == 0
    assert rig.load("C", [h], [4]) is False
    assert rig.stats.get("fail.load_corrupt_object") == 1, rig.stats
    assert planter.exists([key]) == [False]


def test_the_mac_binds_the_key(store, rigs, secret_file):
    """A genuine MACed object copied under another key (the attacker can read and write)."""
    master, planter = store
    rig = _rig(master, str(secret_file))
    rigs.append(rig)
    (h, key), (_, other) = _key("victim"), _key("source")
    assert (
        planter.put_bytes(
            key,
            seal(other, rig.payload(1), ObjectMac(_secret(secret_file)), rig.worker.format_code),
        )
        == 0
    )
    assert rig.load("D", [h], [4]) is False
    assert rig.stats.get("fail.load_corrupt_object") == 1, rig.stats


def test_saved_objects_carry_the_mac_and_a_reader_without_the_secret_neither_trusts_nor_removes_them(
    store, rigs, secret_file
):
    master, planter = store
    writer, plain = _rig(master, str(secret_file)), _rig(master, "", seed=99)
    rigs += [writer, plain]
    h, key = _key("saved")
    writer.save([h], [6])
    obj = planter.get_bytes(key)
    payload = writer.payload(6)
    assert obj is not None and obj[: len(payload)] == payload
    trailer = obj[len(payload) :]
    assert trailer[5] == TAG_BLAKE3_KEYED_64
    assert int.from_bytes(trailer[8:], "little") == checksum_bytes(
        key, payload, ObjectMac(_secret(secret_file))
    )
    assert int.from_bytes(trailer[8:], "little") != checksum_bytes(key, payload)  # not the XXH3
    assert plain.load("E", [h], [0]) is False
    assert plain.stats.get("fail.load_format_mismatch") == 1, plain.stats
    assert planter.exists([key]) == [True]  # left for the readers that can check it
    assert writer.load("F", [h], [1]) is True
    assert writer.kv[1].view(torch.int16).numpy().tobytes() == payload


def test_without_a_secret_a_planted_object_loads_as_before(store, rigs):
    """The documented risk of running without a secret (logged at startup): XXH3 is no MAC."""
    master, planter = store
    rig = _rig(master, "")
    rigs.append(rig)
    h, key = _key("nosecret")
    poison = bytes(len(rig.payload(0)))
    assert planter.put_bytes(key, seal(key, poison, format_code=rig.worker.format_code)) == 0
    assert rig.load("G", [h], [7]) is True
    assert rig.kv[7].view(torch.int16).numpy().tobytes() == poison


def test_secret_from_the_environment_is_the_p_d_one(store, rigs, secret_file, monkeypatch):
    master, planter = store
    monkeypatch.setenv(pd_auth.SECRET_ENV, _secret(secret_file).decode())
    rig = _rig(master, "")
    rigs.append(rig)
    h, key = _key("env")
    assert (
        planter.put_bytes(key, seal(key, rig.payload(2), format_code=rig.worker.format_code)) == 0
    )
    assert rig.load("H", [h], [3]) is False
    assert rig.stats.get("fail.load_unauthenticated_object") == 1, rig.stats


def test_config_key_is_validated(tmp_path):
    assert (
        StoreConnectorConfig.from_extra_config({"auth_secret_file": "/x"}).auth_secret_file == "/x"
    )
    with pytest.raises(ConfigError, match="auth_secret_file"):
        StoreConnectorConfig.from_extra_config({"auth_secret_file": 5})
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    from hybridkv.connector.store_auth import StoreSecret

    with pytest.raises(ConfigError, match="at least 16"):
        StoreSecret.load(StoreConnectorConfig(auth_secret_file=str(short)))


def test_keys_and_mac_come_from_one_read_of_the_secret(tmp_path, monkeypatch):
    """The connector loads the secret once (``StoreSecret.load``) and hands it to the worker:
    the tenant id of its keys and the MAC of its objects cannot come from two different
    reads of the file (before: the key's tenant and the object MAC each read it).
    Planted: a StoreWorker that ignores ``secret=`` and reloads -> the rewritten file's MAC
    is used and the tags differ (and a second read is counted)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from hybridkv.connector.store_auth import StoreSecret
    from hybridkv.connector.store_worker import StoreWorker

    path = pd_auth.write_secret_file(tmp_path / "secret")
    cfg = StoreConnectorConfig(auth_secret_file=str(path))
    reads = []
    real_load = pd_auth.load_key
    monkeypatch.setattr(pd_auth, "load_key", lambda *a, **k: reads.append(a) or real_load(*a, **k))
    secret = StoreSecret.load(cfg)
    assert len(reads) == 1
    assert secret.tenant == StoreSecret.load(cfg).tenant and len(secret.tenant) == 16
    pd_auth.write_secret_file(path)  # the file changes after the connector read it
    reads.clear()
    kvc = KVCacheConfig(
        num_blocks=2,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["l0"],
                FullAttentionSpec(
                    block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
                ),
            )
        ],
    )
    worker = StoreWorker(cfg, kvc, SCHEMA, client=None, secret=secret)  # type: ignore[arg-type]
    assert reads == []
    body = b"x" * 64
    assert worker._mac.of_bytes("k", body) == secret.object_mac().of_bytes("k", body)
    assert worker._mac.of_bytes("k", body) != StoreSecret.load(cfg).object_mac().of_bytes(
        "k", body
    )  # the new file's secret
    assert (
        StoreSecret.load(StoreConnectorConfig()).tenant == ""
        and StoreSecret(None).object_mac() is None
    )
