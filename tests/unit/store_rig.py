"""A real StoreWorker over a one-group host KV cache on a real mooncake_master.

Shared by the store-worker tests that move objects through the worker's own batched
zero-copy put/get (tests/unit/test_store_mac.py, tests/unit/test_store_overlap.py):
block ``b`` of the cache is the bytes of ``kv[b]``; the fixtures give each module one
master plus the client holding the store's memory (also used to read and plant objects),
and make sure no deployment secret leaks in from the environment.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from hybridkv.connector import pd_auth
from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.connector.store_metadata import BlockBatch, LoadJob, SaveJob, StoreConnectorMetadata
from hybridkv.connector.store_worker import StoreWorker, WorkerLimits
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.keys import KeySchema
from hybridkv.store.mooncake_backend import MooncakeBackend


class StoreRig:
    """One StoreWorker with its own (memory-less) client; ``stats`` sums its counters."""

    def __init__(
        self,
        master: EmbeddedMaster,
        schema: KeySchema,
        num_blocks: int,
        *,
        seed: int,
        secret_file: str = "",
        limits: WorkerLimits | None = None,
        **config: object,
    ) -> None:
        self.client = MooncakeBackend(
            master.address, global_segment_size=0, local_buffer_size=4 << 20
        )
        self.kv = torch.randn(
            num_blocks, 2, 16, 64, generator=torch.Generator().manual_seed(seed)
        ).to(torch.bfloat16)
        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        kvc = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
        )
        cfg = StoreConnectorConfig(
            master_address=master.address, auth_secret_file=secret_file, **config
        )
        self.worker = StoreWorker(cfg, kvc, schema, self.client, limits)
        self.worker.register_kv_caches({"l0": self.kv})
        self.stats: dict = {}

    def payload(self, block: int) -> bytes:
        return self.kv[block].view(torch.int16).numpy().tobytes()

    def save(self, hashes: list[bytes], blocks: list[int]) -> None:
        """One synchronous save job; every block must be saved."""
        batch = BlockBatch()
        for h, b in zip(hashes, blocks, strict=True):
            batch.add(0, h, b)
        self.worker.wait_for_save(StoreConnectorMetadata(saves=[SaveJob(1, batch, sync=True)]))
        self._take_stats()
        assert self.stats.get("saved_blocks") == len(blocks), self.stats

    def load(self, req: str, hashes: list[bytes], blocks: list[int]) -> bool:
        """One load job; True if it succeeded (bounded: a hang fails the test)."""
        batch = BlockBatch()
        for h, b in zip(hashes, blocks, strict=True):
            batch.add(0, h, b)
        self.worker.start_load_kv(StoreConnectorMetadata(loads=[LoadJob(req, batch, load_id=1)]))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            res = self.worker.get_transfer_results()
            if req in res.finished_recving:
                self._take_stats()
                return req not in res.failed_recving
            time.sleep(0.005)
        raise AssertionError(f"load {req} did not finish")

    def _take_stats(self) -> None:
        s = self.worker.take_stats()
        for k, v in s.data.items() if s is not None else ():
            if not isinstance(v, list):
                self.stats[k] = self.stats.get(k, 0) + v

    def close(self) -> None:
        self.worker.shutdown(timeout_s=2.0)
        self.client.close()


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[EmbeddedMaster, MooncakeBackend]]:
    """A master and the client holding the store's memory (also the one that reads and
    plants objects: it has no secret and writes whatever it likes)."""
    with (
        EmbeddedMaster(default_kv_lease_ttl_ms=500) as master,
        MooncakeBackend(
            master.address, global_segment_size=32 << 20, local_buffer_size=4 << 20
        ) as holder,
    ):
        yield master, holder


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch):
    monkeypatch.delenv(pd_auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(pd_auth.SECRET_FILE_ENV, raising=False)


@pytest.fixture
def rigs(store) -> Iterator[list[StoreRig]]:
    """Rigs a test made (append them); closed after the test, before the master goes."""
    made: list[StoreRig] = []
    yield made
    for r in made:
        r.close()
