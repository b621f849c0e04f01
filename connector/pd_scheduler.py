"""Scheduler side of HybridPDConnector (both roles of a P/D pair).

Prefill (request carries ``do_remote_decode``): with Mamba/linear-attention
groups the prompt's last token is dropped before scheduling, so the recurrent
state the decode side receives is h(N-1) and decode recomputes token N itself
(a state cannot "un-see" a token). At finish the blocks are kept under a lease
and ``kv_transfer_params`` tell the decode side where to read them.

Decode (request carries ``do_remote_prefill``): offers the prompt up to the last
scheduler-block boundary before its final token, minus what its own prefix cache
holds (the prefill side computed exactly that much when the model has recurrent
state), then pairs, per group, the
prefill side's blocks with the blocks vLLM allocated for them. Attention groups
pair by block position (the prefill side sends positional lists, nulls
included), so dense groups read only the uncached suffix (end-trim) and sliding
windows only their tail; a Mamba group pairs the prefill side's last state block
with the decode side's. Decode always recomputes the last prompt token itself:
vLLM 0.32's CPU attention crashed the worker (SIGILL) on the step that follows an
external hit covering the whole prompt.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from hybridkv.connector.block_copies import step_block_copies
from hybridkv.connector.pd_metadata import Lease, PDConnectorMetadata, PDHandshakeMetadata, PDWorkerMetadata, ReadJob

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm." + __name__)  # vLLM configures the "vllm" logger tree

REQUIRED_REMOTE = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")


def pair_from_end(remote: list[int], local: list[int]) -> tuple[list[int], list[int]]:
    """Pair the last k blocks of each list (k = the shorter length)."""
    k = min(len(remote), len(local))
    return (remote[len(remote) - k :], local[len(local) - k :]) if k else ([], [])


def pair_by_position(remote: list[int], local_blocks) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Block i of the prefill side -> block i here, where this side needs data
    (allocated, not already holding cached content) and the prefill side has it."""
    r, l_ = [], []
    for idx, block in enumerate(local_blocks):
        if idx >= len(remote):
            break
        if block.is_null or block.block_hash is not None or not remote[idx]:
            continue
        r.append(remote[idx])
        l_.append(block.block_id)
    return r, l_


class PDScheduler:
    def __init__(
        self, engine_id: str, has_recurrent_state: bool, lease_s: float, mamba_group_ids: tuple[int, ...],
        align_tokens: int,
    ) -> None:
        self._engine_id = engine_id
        self._recurrent = has_recurrent_state
        self._align = align_tokens
        self._lease_s = lease_s
        self._mamba = set(mamba_group_ids)
        self._handshake: PDHandshakeMetadata | None = None
        self._reads: list[ReadJob] = []
        self._leases: list[Lease] = []
        self._block_pool: Any = None
        self._pins: dict[str, list[Any]] = {}  # decode: read targets, until the READ is over

    def bind_block_pool(self, block_pool: Any) -> None:
        self._block_pool = block_pool

    # ------------------------------------------------------------- handshake
    def set_handshake(self, metadata: dict[int, Any]) -> None:
        rank0 = metadata.get(0)
        if isinstance(rank0, PDHandshakeMetadata):
            self._handshake = rank0

    # --------------------------------------------------------------- prefill
    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or params.get("_hkv_truncated"):
            return
        keep = self.handover_tokens(request.num_prompt_tokens)
        drop = request.num_prompt_tokens - keep
        if self._recurrent and keep > 0 and drop > 0 and request.prompt_token_ids is not None:
            # The recurrent state handed over must be h(keep): compute exactly that much.
            del request.prompt_token_ids[-drop:]
            del request._all_token_ids[-drop:]
            request.num_prompt_tokens = keep
            request.max_tokens = 1
            params["_hkv_truncated"] = True

    def handover_tokens(self, num_prompt_tokens: int) -> int:
        """Tokens whose KV moves prefill -> decode: the last scheduler-block boundary
        before the final prompt token (decode recomputes the rest)."""
        return (num_prompt_tokens - 1) // self._align * self._align

    def request_finished(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: nothing to hand over
        if self._handshake is None:
            logger.warning("hybridkv P/D: no handshake address from the workers; cannot hand over %s",
                           request.request_id)
            return False, None
        remote = [list(group) for group in block_ids]
        if not any(any(group) for group in remote):
            return False, None
        expires = time.time() + self._lease_s
        self._leases.append(Lease(request.request_id, expires))
        return True, {
            # After this the prefill side frees (and may reuse) the blocks: a later READ
            # would copy another request's KV, so decode refuses to read past it.
            "remote_lease_expires_at": expires,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self._handshake.host,
            "remote_port": self._handshake.port,
            "remote_block_ids": remote,
            "remote_num_tokens": request.num_computed_tokens,
        }

    # ---------------------------------------------------------------- decode
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or params.get("_hkv_read"):
            return 0, False
        if any(k not in params for k in REQUIRED_REMOTE):
            logger.warning("hybridkv P/D: request %s has incomplete kv_transfer_params %s; recomputing",
                           request.request_id, sorted(params))
            return 0, False
        target = min(int(params.get("remote_num_tokens") or 0), self.handover_tokens(request.num_prompt_tokens))
        count = target - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or params.get("_hkv_read"):
            return
        params["_hkv_read"] = True  # one transfer per request
        if any(k not in params for k in REQUIRED_REMOTE):
            return  # warned at lookup; nothing to read and no peer to tell
        job = ReadJob(
            req_id=request.request_id,
            remote_req_id=params["remote_request_id"],
            remote_engine_id=params["remote_engine_id"],
            remote_host=params["remote_host"],
            remote_port=int(params["remote_port"]),
            remote_block_ids=[],
            local_block_ids=[],
            lease_expires_at=params.get("remote_lease_expires_at"),
        )
        if num_external_tokens == 0:
            # The local prefix cache covers it, or another connector was chosen (the store
            # under MultiConnector): read nothing, but release the prefill side's lease now
            # rather than after lease_s (its blocks stay held and its engine keeps stepping
            # until then). Never reported as a receive: this connector loads nothing here.
            job.release_only = True
            self._reads.append(job)
            return
        remote_groups = params["remote_block_ids"]
        if len(remote_groups) != len(blocks.blocks):
            job.refused = f"prefill has {len(remote_groups)} KV cache groups, decode {len(blocks.blocks)}"
        else:
            for gid, (remote, group) in enumerate(zip(remote_groups, blocks.blocks)):
                if gid in self._mamba:
                    # Only the state at the boundary: the last block on each side.
                    local = [b.block_id for b in group if not b.is_null and b.block_hash is None]
                    r, l_ = pair_from_end([b for b in remote if b][-1:], local[-1:])
                else:
                    r, l_ = pair_by_position(remote, group)
                job.remote_block_ids.append(r)
                job.local_block_ids.append(l_)
            if self._block_pool is not None:
                # A READ that timed out may still write: the request recomputes in other blocks.
                pinned = [self._block_pool.blocks[b] for group in job.local_block_ids for b in group]
                self._block_pool.touch(pinned)
                self._pins[request.request_id] = pinned
        self._reads.append(job)

    def update_connector_output(self, output: Any) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, PDWorkerMetadata):
            return
        for req_id in meta.released:
            pinned = self._pins.pop(req_id, None)
            if pinned is not None:
                self._block_pool.free_blocks(pinned)

    def has_pins(self) -> bool:
        return bool(self._pins)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> PDConnectorMetadata:
        meta = PDConnectorMetadata(reads=self._reads, leases=self._leases,
                                   block_copies=step_block_copies(scheduler_output))
        self._reads, self._leases = [], []
        return meta
