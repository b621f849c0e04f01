"""The store never loads a block written in another byte order (another kernel-block split).

vLLM splits a manager block into kernel blocks per attention backend, so two engines that share
a master (same model, same manager blocks, same keys) can lay out one block's bytes differently:
under LBHNC with 2 heads, a 64-token block split into 4 kernel rows of 16 orders its bytes
[row, head, token] where an unsplit one orders them [head, token]. Both write valid trailers, so
only the trailer's format code (the worker's block formats) tells them apart: the load is refused
(a format mismatch: the object stays, its writer's layout still reads it) and the request
recomputes. Caches are built by vLLM's own ``allocate_kv_cache``; workers and master are real.
"""

from __future__ import annotations

import time

import pytest
import torch

from hybridkv.connector.block_layout import KVLayout
from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.connector.store_metadata import BlockBatch, LoadJob, SaveJob, StoreConnectorMetadata
from hybridkv.connector.store_worker import StoreWorker, layout_format_code
from hybridkv.store.keys import KeySchema
from hybridkv.store.mooncake_backend import MooncakeBackend
from tests.unit.store_rig import no_env_secret, store  # noqa: F401 (fixtures)
from tests.unit.test_kernel_blocks import Cache, Case, fa

SCHEMA = KeySchema.create("kernel-split-model", "float32", [{"g": "fa64"}])
HASH = bytes(range(32))


class _Worker:
    def __init__(self, master, kernel: int, seed: int) -> None:
        self.cache = Cache(Case("LBHNC", [(["fa.0", "fa.1"], fa(64, 2, 8))], [kernel]))
        gen = torch.Generator().manual_seed(seed)
        self.cache.raw.copy_(
            torch.randint(0, 255, self.cache.raw.shape, generator=gen, dtype=torch.uint8).view(
                self.cache.raw.dtype
            )
        )
        self.client = MooncakeBackend(
            master.address, global_segment_size=0, local_buffer_size=4 << 20
        )
        cfg = StoreConnectorConfig(master_address=master.address)
        self.worker = StoreWorker(cfg, self.cache.config, SCHEMA, self.client)
        self.worker.register_kv_caches(self.cache.caches)

    def block(self, b: int) -> list[torch.Tensor]:
        return [self.cache.manager_view(n)[b].clone() for n in ("fa.0", "fa.1")]

    def save(self, b: int) -> None:
        batch = BlockBatch()
        batch.add(0, HASH, b)
        self.worker.wait_for_save(StoreConnectorMetadata(saves=[SaveJob(1, batch, sync=True)]))

    def load(self, req: str, b: int) -> tuple[bool, dict]:
        batch = BlockBatch()
        batch.add(0, HASH, b)
        self.worker.start_load_kv(StoreConnectorMetadata(loads=[LoadJob(req, batch, load_id=1)]))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            res = self.worker.get_transfer_results()
            if req in res.finished_recving:
                stats = self.worker.take_stats()
                return req not in res.failed_recving, dict(stats.data if stats else {})
            time.sleep(0.005)
        raise AssertionError(f"load {req} did not finish")

    def close(self) -> None:
        self.worker.shutdown(timeout_s=2.0)
        self.client.close()


@pytest.fixture
def workers(store):
    made: list[_Worker] = []
    yield lambda kernel, seed: made.append(_Worker(store[0], kernel, seed)) or made[-1]
    for w in made:
        w.close()


def test_a_block_of_another_kernel_split_is_refused_not_loaded(workers):
    unsplit, split = workers(64, 1), workers(16, 2)
    unsplit.save(3)
    ok, stats = split.load("split-reader", 5)
    assert not ok
    assert stats.get("fail.load_format_mismatch") == 1 and "removed_objects" not in stats, stats
    # The object stays: a reader with the writer's layout still loads it, byte for byte.
    same = workers(64, 3)
    ok, stats = same.load("same-reader", 7)
    assert ok and stats.get("loaded_blocks") == 1, stats
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(same.block(7), unsplit.block(3))
    )


def test_where_the_split_does_not_reorder_bytes_the_codes_agree():
    """LBNHC puts tokens outside heads: a split block has the same byte order as an unsplit one
    (``block_format`` says so), so engines with either split share objects; under LBHNC not."""

    def code(layout: str, kernel: int) -> int:
        c = Cache(Case(layout, [(["fa.0", "fa.1"], fa(64, 2, 8))], [kernel]))
        return layout_format_code(KVLayout.from_kv_caches(c.config, c.caches))

    assert code("LBNHC", 16) == code("LBNHC", 64)
    assert code("LBHNC", 16) != code("LBHNC", 64)
