"""What HybridPDConnector's scheduler side tells its workers each step.

Decode side: ``reads`` (pull these remote blocks into these local blocks, per
group). Prefill side: ``leases`` (hold these finished requests' blocks until the
decode side says it has read them, or the lease expires).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorWorkerMetadata,
)

from hybridkv.connector.block_copies import BlockCopiesMetadata


@dataclass
class ReadJob:
    """Pull one request's blocks from a prefill peer (pairs per group, same order)."""

    req_id: str
    remote_req_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[list[int]]
    local_block_ids: list[list[int]]
    refused: str | None = None
    # Nothing to read (decode's own prefix cache or another connector, e.g. the store
    # under MultiConnector, supplies the prefix): only tell prefill to drop its lease.
    release_only: bool = False
    # The prefill side's lease on these blocks, claimed (once) when the READ has ended:
    # the bytes count only if the claim is granted.
    lease_id: str = ""
    # Each prefill rank's handshake port (on remote_host), rank order; its length is the
    # prefill instance's tensor_parallel_size. Empty: [remote_port] (one rank).
    remote_ports: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.remote_ports:
            self.remote_ports = [self.remote_port]


@dataclass
class Lease:
    """Hold a finished request's blocks for ``ttl_s`` (counted on the prefill worker's
    monotonic clock from when it learns of the lease; no other host's clock is used)."""

    req_id: str
    lease_id: str
    ttl_s: float


@dataclass
class PDConnectorMetadata(BlockCopiesMetadata):
    reads: list[ReadJob] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)


@dataclass
class PDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Where a worker's gRPC handshake service listens (sent to the scheduler by vLLM)."""

    host: str
    port: int
    tp_rank: int


@dataclass
class PDWorkerMetadata(KVConnectorWorkerMetadata):
    """Decode reads whose target blocks nothing writes into anymore (per worker, summed)."""

    released: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PDWorkerMetadata)
        merged = dict(self.released)
        for k, v in other.released.items():
            merged[k] = merged.get(k, 0) + v
        return PDWorkerMetadata(merged)
