"""What the scheduler side tells the workers each step, and what they answer.

Jobs carry (group, block hash, block id) triples, not key strings: each worker
formats keys with its own rank, so one job serves every tensor-parallel rank.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorWorkerMetadata,
)

from hybridkv.connector.block_copies import BlockCopiesMetadata


@dataclass
class BlockBatch:
    """Objects to move: object i is block ``block_ids[i]`` of group ``group_ids[i]``."""

    group_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    generation: int = 0  # the key generation (KeySchema.generation) its objects are named in

    def add(self, group_id: int, block_hash: bytes, block_id: int) -> None:
        self.group_ids.append(group_id)
        self.hashes.append(block_hash)
        self.block_ids.append(block_id)

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class LoadJob:
    """Fill a request's external-token blocks; ``refused`` = the scheduler already
    knows the load cannot be done (the worker reports it failed without I/O)."""

    req_id: str
    blocks: BlockBatch
    refused: str | None = None
    load_id: int = 0  # pins of the target blocks are released by this id


@dataclass
class SaveJob:
    """Write blocks whose KV is complete after this step; the blocks stay pinned
    on the scheduler side until every worker acknowledged ``job_id``."""

    job_id: int
    blocks: BlockBatch
    sync: bool = False  # state blocks: written before the next forward may touch them
    # partial tails: decode keeps writing the block past the key's boundary, so the worker
    # copies the bytes first and checksums + writes that copy (else the trailer covers bytes
    # that change before the put and the object is stored corrupt)
    snapshot: bool = False


@dataclass
class StoreConnectorMetadata(BlockCopiesMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


@dataclass
class StoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Save jobs finished, and requests whose load calls have all returned (their
    target blocks may be unpinned), on this worker; summed over workers by ``aggregate``.
    ``failed_saves``: finished save jobs that did not write every object (skipped or
    failed), so the scheduler offers their keys again instead of taking them as saved."""

    finished_saves: Counter = field(default_factory=Counter)
    released_loads: Counter = field(default_factory=Counter)
    failed_saves: Counter = field(default_factory=Counter)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, StoreWorkerMetadata)
        return StoreWorkerMetadata(
            self.finished_saves + other.finished_saves,
            self.released_loads + other.released_loads,
            self.failed_saves + other.failed_saves,
        )
