"""Prefill side: a lease's blocks are held by the connector, not by a finished request.

Returning ``delay_free=True`` from ``request_finished`` keeps the finished request in vLLM's
scheduler until the workers report it in ``finished_sending``, and vLLM steps the engine
for as long as such a request exists (``Scheduler.has_finished_requests``): a prefill
holding unread leases would run empty steps back to back, and each step wakes every worker, whose
message-queue reader then spins for a second (vLLM's ``SpinCondition``). So the connector
takes its own reference on the lease's blocks (``BlockPool.touch``, as a prefix hit does),
vLLM frees the request at once, and the engine goes idle when nothing else runs.

Lease ends (read, released, expired) travel from the workers in the connector's worker
metadata (``leases_ended``, summed over the TP ranks), never in ``finished_sending``; the
blocks are freed once every rank ended its lease (each rank's decode reader reads that
rank's memory). An idle engine learns of ends at its next step: blocks stay held while
nothing runs, and a request that needs them runs steps that report the ends.

The lease budget (``max_lease_fraction``) counts PHYSICAL blocks: many leases of requests
sharing one long system prompt hold its blocks once, and count once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from hybridkv.connector.pd_metadata import PDWorkerMetadata


@dataclass
class PDLeaseWorkerMetadata(PDWorkerMetadata):
    """``released`` (decode, see PDWorkerMetadata) plus prefill leases ended on each rank."""

    leases_ended: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PDWorkerMetadata)
        merged = PDWorkerMetadata.aggregate(self, other)
        ended = dict(self.leases_ended)
        for k, v in getattr(other, "leases_ended", {}).items():
            ended[k] = ended.get(k, 0) + v
        return PDLeaseWorkerMetadata(merged.released, ended)


class LeasePins:
    """The connector's references on leased blocks, per request, until every rank ended it."""

    def __init__(self, tp_size: int) -> None:
        self._tp_size = tp_size
        self._pins: dict[str, list[Any]] = {}  # req id -> KVCacheBlocks it holds
        self._ended_counts: dict[str, int] = {}
        self._refs: Counter[int] = Counter()  # block id -> leases holding it

    @property
    def physical_blocks(self) -> int:
        """Distinct blocks the leases hold (shared prefix blocks once)."""
        return len(self._refs)

    def added_by(self, block_ids: tuple[list[int], ...]) -> int:
        """How many blocks a lease on ``block_ids`` would add to :attr:`physical_blocks`."""
        return len({b for group in block_ids for b in group if b and b not in self._refs})

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._pins

    def hold(self, block_pool: Any, req_id: str, block_ids: tuple[list[int], ...]) -> None:
        """Take a reference on the request's blocks (null entries skipped)."""
        blocks = [block_pool.blocks[b] for group in block_ids for b in group if b]
        block_pool.touch(blocks)
        old = self._pins.pop(req_id, None)
        if old is not None:  # the same request handed over again: one hold
            self._drop(block_pool, old)
        self._pins[req_id] = blocks
        self._refs.update(b.block_id for b in blocks)

    def _drop(self, block_pool: Any, blocks: list[Any]) -> None:
        self._refs.subtract(b.block_id for b in blocks)
        for b in blocks:
            if self._refs[b.block_id] <= 0:
                del self._refs[b.block_id]
        block_pool.free_blocks(reversed(blocks))  # tail blocks evicted first

    def ended(self, block_pool: Any, counts: dict[str, int]) -> list[str]:
        """Ranks reported these leases ended; returns the requests whose blocks are freed now."""
        freed = []
        for req_id, n in counts.items():
            if req_id not in self._pins:
                continue
            done = self._ended_counts.pop(req_id, 0) + n
            if done < self._tp_size:
                self._ended_counts[req_id] = done
                continue
            self._drop(block_pool, self._pins.pop(req_id))
            freed.append(req_id)
        return freed


__all__ = ["LeasePins", "PDLeaseWorkerMetadata"]
