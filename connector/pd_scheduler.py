"""Scheduler side of HybridPDConnector (both roles of a P/D pair).

Prefill (request carries ``do_remote_decode``): with Mamba/linear-attention
groups the prompt's last token is dropped before scheduling, so the recurrent
state the decode side receives is h(N-1) and decode recomputes token N itself
(a state cannot "un-see" a token). With a sliding-window group the prompt is cut
too, to the hand-over boundary + 1 (``prefill_tokens``): at finish vLLM frees the blocks outside the
window of the LAST computed token, and decode, resuming at the boundary, needs the
window before it (uncut, a prompt of N % block in {0, block-1} would lose that block and
decode would read around the gap: silently wrong output). At finish the blocks are kept under a lease
and ``kv_transfer_params`` tell the decode side where to read them.

Decode (request carries ``do_remote_prefill``): offers the prompt up to the last
scheduler-block boundary before its final token, minus what its own prefix cache
holds (the prefill side computed exactly that much when the model has recurrent
state), then pairs, per group, the
prefill side's blocks with the blocks vLLM allocated for them. Attention groups
pair by block position (the prefill side sends positional lists, nulls
included), so dense groups read only the uncached suffix (end-trim) and sliding
windows only their tail (a hand-over missing a block decode needs is recomputed, never
read around); a Mamba group pairs the prefill side's state column
with the decode side's (``state_column``: never a speculative-decoding scratch block). Decode always recomputes the last prompt token itself:
vLLM 0.32's CPU attention crashes the worker (SIGILL) on the step that follows an
external hit covering the whole prompt.

Both: a request's ``kv_transfer_params`` are read once, by ``pd_params`` (validated
against this prompt and layout and, with a secret, MAC-verified); the result, not the
client's dict, drives everything here. A refused set recomputes, or with
``kv_load_failure_policy=fail`` is offered and then refused as a load, so vLLM fails
that request alone.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from hybridkv.connector.block_copies import step_block_copies
from hybridkv.connector.failed_loads import FailedLoads
from hybridkv.connector.pd_auth import DeploymentKey
from hybridkv.connector.pd_metadata import (
    Lease,
    PDConnectorMetadata,
    PDHandshakeMetadata,
    PDWorkerMetadata,
    ReadJob,
)
from hybridkv.connector.pd_params import (
    LocalLayout,
    ParsedParams,
    PromptView,
    Refused,
    RemoteDecode,
    RemotePrefill,
    issue_remote_prefill,
    parse_kv_transfer_params,
)
from hybridkv.connector.pd_tp import MAMBA_TP_NOT_ENABLED
from hybridkv.store import vllm_compat
from hybridkv.store.geometry import state_column
from hybridkv.store.logs import get_logger

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = get_logger(__name__, "P/D")


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
    """Both roles' scheduler side. Requests' ``kv_transfer_params`` are parsed once
    (``pd_params``) into ``self._params``; nothing here reads the raw dict, and the
    connector's own per-request state lives here, never in the client's dict."""

    def __init__(
        self,
        engine_id: str,
        has_recurrent_state: bool,
        lease_s: float,
        mamba_group_ids: tuple[int, ...],
        align_tokens: int,
        *,
        can_prefill: bool = True,
        can_decode: bool = True,
        group_block_sizes: tuple[int, ...] = (),
        num_blocks: int = 0,
        key: DeploymentKey | None = None,
        fail_on_refusal: bool = False,
        tp_size: int = 1,
        total_kv_heads: int = 0,
        max_lease_fraction: float = 1.0,
        mamba_problem: str | None = MAMBA_TP_NOT_ENABLED,
        group_windows: tuple[int, ...] = (),
    ) -> None:
        self._engine_id = engine_id
        self._recurrent = has_recurrent_state
        # Sliding window (tokens) per KV cache group, 0 where the group has none. At a prefill's
        # finish vLLM frees the blocks outside the window of its LAST prompt token
        # (Scheduler._connector_finished -> remove_skipped_blocks), but decode resumes at the
        # hand-over boundary, up to a block earlier, and needs the window before THAT token.
        self._windows = tuple(group_windows)
        # Prefill cuts the prompt (prefill_tokens) when the model has recurrent state (h(N-1)
        # cannot be undone) or a sliding window (the window before the boundary must still be
        # held at finish).
        self._truncate = has_recurrent_state or any(self._windows)
        self._align = align_tokens
        self._lease_s = lease_s
        self._mamba = set(mamba_group_ids)
        self._can_prefill, self._can_decode = can_prefill, can_decode
        self._group_block_sizes, self._num_blocks = group_block_sizes, num_blocks
        self._key = key
        # kv_load_failure_policy=fail: a refused set fails its request (through a refused
        # load) instead of recomputing silently.
        self._fail_on_refusal = fail_on_refusal
        self._tp_size, self._total_kv_heads = tp_size, total_kv_heads
        # Why Mamba state is not re-sliced across TP sizes here (None: allow_mamba_cross_tp on
        # and every Mamba group is GDN state): LocalLayout.mamba_problem.
        self._mamba_problem = mamba_problem
        self._handshake: PDHandshakeMetadata | None = None
        self._rank_ports: tuple[int, ...] = ()  # every worker's handshake port, rank order
        self._released_counts: dict[str, int] = {}  # decode: ranks whose READ target is free
        # Prefill: blocks held by leases not yet ended (read, released or expired). Any API
        # client can send do_remote_decode, so unread leases must not be able to hold the
        # whole KV cache for lease_s: past this budget a finished request hands nothing over.
        self._lease_budget = int(num_blocks * max_lease_fraction) if num_blocks else 0
        self._leased: dict[str, int] = {}  # req id -> its blocks
        self._leased_blocks = 0  # sum of _leased (kept, not re-summed on every finished request)
        self.leases_refused = 0
        self._reads: list[ReadJob] = []
        self._leases: list[Lease] = []
        self._block_pool: Any = None
        self._pins: dict[str, list[Any]] = {}  # decode: read targets, until the READ is over
        self._params: dict[str, ParsedParams] = {}
        self._truncated: set[str] = set()  # prefill: prompt already cut to the handover boundary
        self._read_started: set[str] = set()  # decode: one transfer per request
        # Decode: requests whose READ job this connector posted (it loads into their blocks),
        # until the workers report it finished; a failed one goes to _failed_reads.
        self._reading: set[str] = set()
        self._failed_reads = (
            FailedLoads()
        )  # failed READs: the next admission attempt is skipped once

    @property
    def failed_read_deferrals(self) -> int:
        """Admissions skipped once after a failed READ (see get_num_new_matched_tokens)."""
        return self._failed_reads.deferrals

    def bind_block_pool(self, block_pool: Any) -> None:
        self._block_pool = block_pool

    # ------------------------------------------------------------- parameters
    def local_layout(self) -> LocalLayout:
        hash_bs = getattr(self._block_pool, "hash_block_size", None) or self._align
        return LocalLayout(
            self._can_prefill,
            self._can_decode,
            self._group_block_sizes,
            self._num_blocks,
            hash_bs,
            tp_size=self._tp_size,
            mamba_group_ids=tuple(sorted(self._mamba)),
            total_kv_heads=self._total_kv_heads,
            mamba_problem=self._mamba_problem,
        )

    def params(self, request: "Request") -> ParsedParams:
        """The request's validated ``kv_transfer_params`` (parsed on first use, then cached)."""
        rid = request.request_id
        if rid not in self._params:
            parsed = parse_kv_transfer_params(
                request.kv_transfer_params,
                PromptView(request.num_prompt_tokens, request.block_hashes),
                self.local_layout(),
                self._key,
            )
            if isinstance(parsed, Refused):
                action = "failing it" if self._fail_on_refusal else "recomputing"
                logger.warning("request %s refused: %s (%s)", rid, parsed, action)
            self._params[rid] = parsed
        return self._params[rid]

    def _forget(self, req_id: str) -> None:
        self._params.pop(req_id, None)
        self._truncated.discard(req_id)
        self._read_started.discard(req_id)
        self._reading.discard(req_id)
        self._failed_reads.forget(req_id)

    # ------------------------------------------------------------- handshake
    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """Every worker's handshake address (vLLM collects one per rank). The decode side
        is told each rank's port; a prefill instance whose ranks are not all known, or
        not on one host, hands nothing over (decode would miss a rank's heads)."""
        ranks = {r: m for r, m in metadata.items() if isinstance(m, PDHandshakeMetadata)}
        if not ranks:
            return
        hosts = {m.host for m in ranks.values()}
        if sorted(ranks) != list(range(self._tp_size)) or len(hosts) != 1:
            logger.error(
                "handshake addresses for ranks %s on hosts %s, expected ranks 0..%d on one "
                "host; this prefill instance hands no KV over (decode recomputes)",
                sorted(ranks),
                sorted(hosts),
                self._tp_size - 1,
            )
            return
        self._handshake = ranks[0]
        self._rank_ports = tuple(ranks[r].port for r in range(self._tp_size))

    # --------------------------------------------------------------- prefill
    def on_new_request(self, request: "Request") -> None:
        if (
            not isinstance(self.params(request), RemoteDecode)
            or request.request_id in self._truncated
        ):
            return
        keep = self.prefill_tokens(request.num_prompt_tokens)
        drop = request.num_prompt_tokens - keep
        if self._truncate and keep > 0 and drop > 0 and request.prompt_token_ids is not None:
            # The recurrent state handed over must be h(keep), and a sliding window group must
            # still hold the window before token keep when vLLM trims it at finish (it trims to
            # the window of the last computed token): compute exactly that much.
            del request.prompt_token_ids[-drop:]
            del request._all_token_ids[-drop:]
            request.num_prompt_tokens = keep
            request.max_tokens = 1
            self._truncated.add(request.request_id)

    def prefill_tokens(self, num_prompt_tokens: int) -> int:
        """How much of the prompt a prefill computes (``on_new_request`` cuts the rest).

        Recurrent state: exactly the hand-over T. Sliding windows only: T + 1 where vLLM's trim
        at finish (to the window of token T + 1) still keeps the window before T, so a store
        child under MultiConnector, which saves up to the last block boundary before the final
        prompt token, still saves through T; else T."""
        keep = self.handover_tokens(num_prompt_tokens)
        if self._recurrent or keep <= 0:
            return keep
        if keep + 1 >= num_prompt_tokens:
            return num_prompt_tokens
        for gid, window in enumerate(self._windows):
            if window and gid < len(self._group_block_sizes):
                bs = self._group_block_sizes[gid]
                if max(0, keep + 2 - window) // bs != max(0, keep + 1 - window) // bs:
                    return keep
        return keep + 1

    def handover_tokens(self, num_prompt_tokens: int) -> int:
        """Tokens whose KV moves prefill -> decode: the last scheduler-block boundary
        before the final prompt token (decode recomputes the rest)."""
        return (num_prompt_tokens - 1) // self._align * self._align

    def request_finished(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        parsed = self.params(request)
        cut = request.request_id in self._truncated
        self._forget(request.request_id)
        if not isinstance(parsed, RemoteDecode):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted: nothing to hand over
        if self._handshake is None:
            logger.warning(
                "no handshake address from the workers; cannot hand over %s", request.request_id
            )
            return False, None
        remote = [list(group) for group in block_ids]
        if not any(any(group) for group in remote):
            return False, None
        held = len({b for group in remote for b in group if b})
        in_use = self._leased_blocks
        if self._lease_budget and in_use + held > self._lease_budget:
            self.leases_refused += 1
            logger.warning(
                "not handing %s over: unread leases hold %d of %d blocks (max_lease_fraction "
                "of the KV cache); its blocks are freed now and decode computes the prompt itself. "
                "Many do_remote_decode requests whose decode leg never comes, or a slow decode: raise "
                "max_lease_fraction or lower lease_s",
                request.request_id,
                in_use,
                self._lease_budget,
            )
            return False, None
        hash_bs = self.local_layout().hash_block_size
        # Sign only what this request hashed (a prompt's last partial block has no hash).
        num_tokens = min(request.num_computed_tokens, len(request.block_hashes) * hash_bs)
        if not cut:
            # With lookahead hashes, the sampled token is in the hash of a prompt block ending
            # within the lookahead of the prompt's end; decode, holding the prompt only, never
            # computes that hash. A cut prompt was hashed before the cut (vLLM hashes a request
            # when it is built), over prompt tokens only: every hash it has, decode computes.
            num_tokens = min(
                num_tokens,
                vllm_compat.prompt_hashed_tokens(
                    request, hash_bs, vllm_compat.hash_lookahead_tokens(self._block_pool)
                ),
            )
        for gid in self._mamba:
            if gid < len(remote) and gid < len(self._group_block_sizes):
                # Hand over the table up to the state column: the speculative-decoding scratch
                # blocks after it hold nothing decode may read (vLLM's clip_ssm_state_blocks).
                del remote[gid][state_column(num_tokens, self._group_block_sizes[gid]) + 1 :]
        lease = Lease(request.request_id, secrets.token_hex(16), self._lease_s)
        self._leases.append(lease)
        self._leased_blocks += held - self._leased.get(request.request_id, 0)
        self._leased[request.request_id] = held
        # After lease_s the prefill side frees (and may reuse) the blocks; decode claims the
        # lease when its READ has ended and keeps the bytes only if that is granted.
        return True, issue_remote_prefill(
            RemotePrefill(
                engine_id=self._engine_id,
                request_id=request.request_id,
                host=self._handshake.host,
                port=self._handshake.port,
                block_ids=tuple(tuple(g) for g in remote),
                num_tokens=num_tokens,
                lease_id=lease.lease_id,
                ports=self._rank_ports,
            ),
            self._key,
            request.block_hashes,
            hash_bs,
            self._group_block_sizes,
        )

    # ---------------------------------------------------------------- decode
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens decode READs from the prefill side (async), 0 to compute them itself.

        ``None`` (vLLM: "not known yet", the request is skipped this step) exactly once
        after a READ this connector posted failed, so that several READs failing in one
        step (a prefill instance died) cannot stall vLLM's scheduler (why:
        connector/failed_loads.py; counted in ``failed_read_deferrals``)."""
        if self._failed_reads.take_deferral(request.request_id):
            return None, False
        parsed = self.params(request)
        if request.request_id in self._read_started:
            return 0, False
        if isinstance(parsed, Refused) and self._fail_on_refusal and self._can_decode:
            # Offer what a valid set would cover: the refused load then fails the request.
            count = self.handover_tokens(request.num_prompt_tokens) - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        if not isinstance(parsed, RemotePrefill):
            return 0, False
        target = min(parsed.num_tokens, self.handover_tokens(request.num_prompt_tokens))
        count = target - num_computed_tokens
        if count > 0:
            missing = self.missing_blocks(parsed.block_ids, num_computed_tokens, target)
            if missing:
                # Reading around the gap would leave those blocks' KV unwritten (silently wrong
                # output); recompute instead (the lease is released by the empty job).
                logger.warning(
                    "request %s: the prefill side's blocks miss (group, block) %s that "
                    "decode needs to resume at token %d; recomputing from token %d",
                    request.request_id,
                    missing,
                    target,
                    num_computed_tokens,
                )
                return 0, False
        return (count, True) if count > 0 else (0, False)

    def missing_blocks(
        self, remote_groups: tuple[tuple[int, ...], ...], num_computed_tokens: int, target: int
    ) -> list[tuple[int, int]]:
        """(group, block index) pairs decode needs from the prefill side to resume at ``target``
        with ``num_computed_tokens`` cached here, but the positional lists hold none for
        (null or past the end). Attention groups only: a full-attention group needs every
        block from the local hit to ``target``; a sliding window only those holding the window
        before token ``target``. An empty list: the hand-over is complete."""
        missing = []
        for gid, remote in enumerate(remote_groups):
            if gid in self._mamba or gid >= len(self._group_block_sizes):
                continue
            bs = self._group_block_sizes[gid]
            window = self._windows[gid] if gid < len(self._windows) else 0
            first = num_computed_tokens // bs
            if window:
                first = max(first, max(0, target - window + 1) // bs)
            for idx in range(first, (target - 1) // bs + 1):
                if idx >= len(remote) or not remote[idx]:
                    missing.append((gid, idx))
        return missing

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        parsed = self.params(request)
        if request.request_id in self._read_started:
            return
        if isinstance(parsed, Refused):
            if num_external_tokens > 0:  # fail policy: the worker reports this load failed
                self._read_started.add(request.request_id)
                self._reading.add(request.request_id)
                self._reads.append(
                    ReadJob(request.request_id, "", "", "", 0, [], [], refused=str(parsed))
                )
            return
        if not isinstance(parsed, RemotePrefill):
            return
        self._read_started.add(request.request_id)
        job = ReadJob(
            req_id=request.request_id,
            remote_req_id=parsed.request_id,
            remote_engine_id=parsed.engine_id,
            remote_host=parsed.host,
            remote_port=parsed.port,
            remote_block_ids=[],
            local_block_ids=[],
            lease_id=parsed.lease_id,
            remote_ports=list(parsed.rank_ports),
        )
        if num_external_tokens == 0:
            # The local prefix cache covers it, or another connector was chosen (the store
            # under MultiConnector): read nothing, but release the prefill side's lease now
            # rather than after lease_s (its blocks stay held until then). Never reported as
            # a receive: this connector loads nothing here.
            job.release_only = True
            self._reads.append(job)
            return
        remote_groups = parsed.block_ids
        if len(remote_groups) != len(blocks.blocks):
            job.refused = (
                f"prefill has {len(remote_groups)} KV cache groups, decode {len(blocks.blocks)}"
            )
        else:
            target = min(parsed.num_tokens, self.handover_tokens(request.num_prompt_tokens))
            for gid, (remote, group) in enumerate(zip(remote_groups, blocks.blocks)):
                if gid in self._mamba:
                    pair = self.pair_state_blocks(gid, remote, group, parsed.num_tokens, target)
                    if isinstance(pair, str):
                        job.refused = pair
                        break
                    r, l_ = pair
                else:
                    r, l_ = pair_by_position(list(remote), group)
                job.remote_block_ids.append(r)
                job.local_block_ids.append(l_)
            if self._block_pool is not None:
                # A READ that timed out may still write: the request recomputes in other blocks.
                pinned = [
                    self._block_pool.blocks[b] for group in job.local_block_ids for b in group
                ]
                self._block_pool.touch(pinned)
                self._pins[request.request_id] = pinned
        self._reading.add(request.request_id)
        self._reads.append(job)

    def pair_state_blocks(
        self, gid: int, remote: tuple[int, ...], local: list[Any], remote_tokens: int, target: int
    ) -> tuple[list[int], list[int]] | str:
        """The prefill side's state block -> decode's state block of Mamba group ``gid``, or why
        none can be paired (the READ is refused, decode recomputes).

        Each side's state sits at its table's column ``state_column(tokens)``; blocks after it
        are speculative-decoding scratch blocks. The prefill side computed exactly the hand-over
        (``prefill_tokens``), so its state is h(remote_tokens) and decode resumes at ``target``:
        the two must be the same token count, or the state is of another position."""
        if gid >= len(self._group_block_sizes):
            return f"no block size known for Mamba group {gid}"
        if remote_tokens != target:
            return f"Mamba group {gid}: the prefill side's state is at token {remote_tokens}, decode resumes at {target}"
        column = state_column(target, self._group_block_sizes[gid])
        remote_block = remote[column] if 0 <= column < len(remote) else 0
        local_block = local[column] if 0 <= column < len(local) else None
        if not remote_block:
            return f"Mamba group {gid}: the prefill side lists no state block at column {column}"
        if local_block is None or local_block.is_null or local_block.block_hash is not None:
            return f"Mamba group {gid}: decode allocated no writable state block at column {column}"
        return [remote_block], [local_block.block_id]

    def update_connector_output(self, output: Any) -> None:
        failed = getattr(output, "failed_recving", None) or set()
        # Only READs it posted owe a deferral; after another connector's failed load it offers no
        # READ either (a request's one transfer is already taken: _read_started).
        self._failed_reads.mark(failed, self._reading.__contains__)
        for req_id in getattr(output, "finished_recving", None) or ():
            self._reading.discard(req_id)
        for req_id in getattr(output, "finished_sending", None) or ():
            self._leased_blocks -= self._leased.pop(
                req_id, 0
            )  # the lease ended: vLLM frees its blocks now
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, PDWorkerMetadata):
            return
        for req_id, count in meta.released.items():
            # Every rank reads into the same local blocks: free them once every rank's READ settled.
            done = self._released_counts.pop(req_id, 0) + count
            if done < self._tp_size:
                self._released_counts[req_id] = done
                continue
            pinned = self._pins.pop(req_id, None)
            if pinned is not None:
                self._block_pool.free_blocks(pinned)

    def has_pins(self) -> bool:
        return bool(self._pins)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> PDConnectorMetadata:
        meta = PDConnectorMetadata(
            reads=self._reads, leases=self._leases, block_copies=step_block_copies(scheduler_output)
        )
        self._reads, self._leases = [], []
        return meta
