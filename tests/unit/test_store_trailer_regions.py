"""The trailer covers every byte of a multi-layer object on the worker's zero-copy path.

Why: on the CPU engine an object is gathered from one region per layer (``checksum_parts``
hashes them in order). A check that skipped a region (an off-by-one over the regions, a
sub-batch that hashed the wrong slice) passed every other store test: their KV caches have
one layer, so each object is one region. Here a real ``StoreWorker`` saves 3-layer objects
into a real ``mooncake_master``-backed segment; one byte is then flipped in the stored object
at the first and last byte of each layer's region, and the load must be refused as corrupt
(planted: ``checksum_parts`` leaving the last region out -> the last layer's flips loaded).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.connector.store_metadata import BlockBatch, LoadJob, SaveJob, StoreConnectorMetadata
from hybridkv.connector.store_worker import StoreWorker
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.keys import KeySchema
from hybridkv.store.mooncake_backend import MooncakeBackend
from hybridkv.store.object_trailer import TRAILER_BYTES

NUM_BLOCKS = 8
LAYERS = 3
SCHEMA = KeySchema(model_id="trailer-regions", layout_id="fa16x3")
BOUND_S = 30.0


class Rig:
    """A zero-copy StoreWorker over a 3-layer host KV cache (3 separate allocations)."""

    def __init__(self, master: EmbeddedMaster) -> None:
        self.client = MooncakeBackend(master.address, global_segment_size=32 << 20, timeout_s=10)
        g = torch.Generator().manual_seed(16)
        self.names = [f"l{i}" for i in range(LAYERS)]
        self.kv = {
            n: torch.randn(NUM_BLOCKS, 2, 16, 64, generator=g).to(torch.bfloat16)
            for n in self.names
        }
        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        kvc = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(self.names, spec)],
        )
        cfg = StoreConnectorConfig(master_address=master.address, timeout_s=10, max_batch_blocks=4)
        self.worker = StoreWorker(cfg, kvc, SCHEMA, self.client)
        self.worker.register_kv_caches(self.kv)
        self.region = self.kv["l0"][0].numel() * 2  # bytes of one layer's block
        self.next_id = 1

    def block(self, b: int) -> bytes:
        return b"".join(self.kv[n][b].view(torch.int16).numpy().tobytes() for n in self.names)

    def save(self, tag: str, b: int) -> None:
        batch = BlockBatch()
        batch.add(0, _hash(tag), b)
        job = SaveJob(self.next_id, batch)
        self.next_id += 1
        self.worker.wait_for_save(StoreConnectorMetadata(saves=[job]))
        t0 = time.monotonic()
        acked = 0
        while not acked and time.monotonic() - t0 < BOUND_S:
            meta = self.worker.build_worker_meta()
            acked = meta.finished_saves.get(job.job_id, 0) if meta is not None else 0
            time.sleep(0.005)
        assert acked == 1

    def load(self, tag: str, dst: int) -> bool:
        batch = BlockBatch()
        batch.add(0, _hash(tag), dst)
        req = f"r{self.next_id}"
        job = LoadJob(req, batch, load_id=self.next_id)
        self.next_id += 1
        self.worker.start_load_kv(StoreConnectorMetadata(loads=[job]))
        t0 = time.monotonic()
        while time.monotonic() - t0 < BOUND_S:
            res = self.worker.get_transfer_results()
            if req in res.finished_recving:
                return req not in res.failed_recving
            time.sleep(0.005)
        raise AssertionError(f"load {req} not reported within {BOUND_S} s")

    def stat(self, name: str) -> float:
        stats = self.worker.take_stats()
        return 0 if stats is None else stats.data.get(name, 0)

    def close(self) -> None:
        self.worker.shutdown(timeout_s=1.0)
        self.client.close()


def _hash(tag: str) -> bytes:
    return tag.encode().ljust(32, b".")


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with EmbeddedMaster() as m:
        r = Rig(m)
        try:
            yield r
        finally:
            r.close()


def test_an_intact_three_layer_object_loads_every_byte(rig: Rig) -> None:
    rig.save("intact", 1)
    assert rig.load("intact", 5) is True
    assert rig.block(5) == rig.block(1)
    rig.stat("")  # drain


@pytest.mark.parametrize("layer", range(LAYERS))
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_flip_in_any_layers_region_is_refused_as_corrupt(
    rig: Rig, layer: int, where: str
) -> None:
    tag = f"flip-{layer}-{where}"
    rig.save(tag, 2)
    key = SCHEMA.key(0, _hash(tag))
    stored = bytearray(rig.client._store.get(key))
    assert len(stored) == LAYERS * rig.region + TRAILER_BYTES
    at = layer * rig.region + (0 if where == "first" else rig.region - 1)
    stored[at] ^= 0x01
    assert rig.client.replace_bytes(key, bytes(stored)) == 0
    rig.stat("")  # drain earlier counters
    assert rig.load(tag, 6) is False
    assert rig.stat("fail.load_corrupt_object") == 1
