"""P/D side channel: the decode worker asks the prefill worker for its NIXL agent and KV layout.

Why a hybridkv-owned channel: NIXL's own metadata listener binds 0.0.0.0 and
its fetch does not complete on loopback, and decode must learn more than
the agent blob anyway — where every group's blocks live on the prefill side
(base address and block stride per layer) and whether the two KV caches can
be copied block for block at all. Two engines that disagree on a group's block
size, dtype or head layout would "work" at the NIXL level and silently move
the wrong bytes, so compatibility is checked here, once per peer, and a
mismatch is refused with the field, both values and the fix named.

One gRPC service, JSON bodies (no protoc step): ``GetAgentInfo``, ``ClaimLease``
(right after its READ, decode asks whether the lease still holds the blocks; granted
once per lease, judged on the PREFILL side's monotonic clock alone) and ``ReleaseBlocks``.
With a deployment key every call carries ``hkv-mac`` metadata, an HMAC over the method and the body (which holds a fresh
nonce), and every answer a trailing ``hkv-mac`` over the method, the request and the
answer: a caller without the secret is refused before its body is parsed, and a
server without it cannot answer (no forged layout, no forged claim). Only prefill
instances serve it. The prefill worker of each TP rank
runs a :class:`HandshakeServer`; the decode worker of the same rank calls
:func:`fetch_agent_info`. Refusal happens on the decode side
(:func:`fetch_agent_info` validates every answer); the server also checks the
layout decode says it expects and answers FAILED_PRECONDITION with the same
message, so the prefill log shows why a peer was turned away.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import grpc
import numpy as np

from hybridkv.connector.block_layout import GroupLayout, KVLayout
from hybridkv.connector.pd_auth import PURPOSE_RPC_ANSWER, PURPOSE_RPC_REQUEST, DeploymentKey
from hybridkv.connector.pd_refusal_log import RefusalLog
from hybridkv.connector.pd_replay import ReplayGuard
from hybridkv.connector.pd_tp import (
    MAX_TP,
    StateSplit,
    head_outermost,
    ratio_problem,
    replicated_on_every_rank,
    state_split_problem,
)
from hybridkv.connector.pd_transport import HOST, MemorySpace
from hybridkv.store.logs import get_logger

logger = get_logger(__name__, "P/D")

# Bump on any change of the JSON schema or of what a field means.
# 2: ReleaseBlocks (decode tells prefill a request's blocks are done with).
# 3: ClaimLease, MACs on every call and answer (hkv-mac metadata), a nonce in every body.
# 4: each group's memory type and device (mem_type/dev: VRAM KV caches), and its
#    block formats (kernel-block split and VLLM_KV_CACHE_LAYOUT), refused on mismatch.
# 5: the layout carries ``kv_identity`` (store.keys.kv_identity: model, revision,
#    quantization, kv-cache dtype as named, rope, ...), each differing key refused.
# 6: tensor parallelism across sizes: each group's per-rank KV heads, kernel rows and
#    kv_cache_layout, the model's total KV heads; the request names the prefill rank it
#    wants (``prefill_rank``); ClaimLease / ReleaseBlocks carry the reader (decode rank)
#    and how many decode ranks read this prefill rank.
# 7: Mamba (GDN) state re-sliced across TP sizes: each Mamba group's per-rank state splits
#    (``state_splits``: per state offset, rows, unit bytes and its TP-sharded parts).
# 8: every body carries ``ts`` (the caller's wall clock) beside its nonce; a body outside
#    the replay window or with a nonce seen in it is refused (pd_replay). A ClaimLease for a
#    lease the worker does not hold yet is answered at once with ``retry_s``.
# 9: each group's ``num_head_slots`` and ``kv_head_major_slots`` (attention page packing);
#    slots not grouped by KV head are refused across TP sizes. MLA latent groups
#    (pd_tp.REPLICATED_SPECS) pair across TP sizes, read whole from one prefill rank, where
#    version 8 refused them (kv_heads).
HANDSHAKE_VERSION = 9

SERVICE = "hybridkv.pd.Handshake"
METHOD = "GetAgentInfo"
_FULL_METHOD = f"/{SERVICE}/{METHOD}"
RELEASE_METHOD = "ReleaseBlocks"
_FULL_RELEASE_METHOD = f"/{SERVICE}/{RELEASE_METHOD}"
CLAIM_METHOD = "ClaimLease"
_FULL_CLAIM_METHOD = f"/{SERVICE}/{CLAIM_METHOD}"
MAC_METADATA = "hkv-mac"
# No HTTP proxy on the side channel: peers are addressed directly.
_CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


class HandshakeError(RuntimeError):
    """The peer could not be reached, answered garbage, or runs an incompatible KV cache."""


class LeaseRefused(HandshakeError):
    """The prefill side will not let this READ happen (unknown, already claimed, expired)."""


class LeasePending(Exception):
    """Prefill side: the worker does not hold this lease yet (its next step delivers it);
    the claim is answered at once with ``retry_s`` and the caller asks again."""


# A handshake thread never waits for a lease: a ClaimLease that comes before the lease
# is answered "ask again in CLAIM_RETRY_S", and the decode side asks until CLAIM_WAIT_S.
CLAIM_RETRY_S = 0.05
CLAIM_WAIT_S = 5.0  # covers a prefill step that starts late on a loaded host
# Handshake threads, and the calls the server holds at once (threads + queued); past
# MAX_CONCURRENT_RPCS a call is answered RESOURCE_EXHAUSTED at once.
HANDSHAKE_THREADS = 4
MAX_CONCURRENT_RPCS = 64


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def request_mac(key: DeploymentKey, method: str, body: bytes) -> str:
    """The MAC a caller sends with ``body`` (which carries a fresh nonce)."""
    return key.mac(PURPOSE_RPC_REQUEST, method, _digest(body))


def answer_mac(key: DeploymentKey, method: str, body: bytes, answer: bytes) -> str:
    """The MAC a server returns: bound to the request (and so to its nonce)."""
    return key.mac(PURPOSE_RPC_ANSWER, method, _digest(body), _digest(answer))


def _metadata_value(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for k, v in metadata or ():
        if k == MAC_METADATA:
            return v if isinstance(v, str) else None
    return None


# --------------------------------------------------------------------------- layout description


@dataclass(frozen=True)
class GroupDescriptor:
    """What one side knows about one KV-cache group's block bytes.

    The compatibility fields (spec .. block_bytes) must agree between prefill
    and decode; ``bases``/``strides`` are the prefill side's addresses that
    decode builds its remote READ descriptors from (empty in the layout decode
    sends as "expected": addresses are private to each process). ``mem_type`` /
    ``dev`` say where those addresses live (NIXL ``DRAM``/``VRAM`` and device id),
    which the READ's remote descriptors must name; they need not agree between
    the sides. ``block_formats`` (per layer view, ``GroupLayout.block_formats``)
    must agree: equal block bytes in a different kernel-block split or
    ``VLLM_KV_CACHE_LAYOUT`` are different bytes.
    """

    group_id: int
    spec: str
    block_size: int
    dtype: str
    sliding_window: int | None
    block_bytes: tuple[int, ...]
    bases: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    mem_type: str = HOST.kind
    dev: int = HOST.dev
    block_formats: tuple[str, ...] = ()
    # TP across sizes (pd_tp): this rank's KV heads (0: not attention), kernel rows per
    # layer view, and vLLM's resolved kv_cache_layout name.
    kv_heads: int = 0
    kernel_rows: tuple[int, ...] = ()
    kv_cache_layout: str = ""
    # Mamba groups: each state's split on this rank (pd_tp.StateSplit.to_wire); empty when
    # the state kind is not re-sliced (then only equal TP sizes pair).
    state_splits: tuple[tuple[int, ...], ...] = ()
    # Attention page packing: slots per page where it diverges from one per KV head (0: one
    # per head), and whether they are grouped by head (vLLM 0.34's kv_head_major_slots). Head slicing cuts one run per head, so
    # slots not grouped by head pair only at equal TP sizes.
    num_head_slots: int = 0
    kv_head_major_slots: bool = False

    def splits(self) -> tuple[StateSplit, ...]:
        return tuple(StateSplit.from_wire(t) for t in self.state_splits)

    @property
    def memory_space(self) -> MemorySpace:
        if self.mem_type not in ("DRAM", "VRAM"):
            raise HandshakeError(f"group {self.group_id}: unknown memory type {self.mem_type!r}")
        return MemorySpace(self.mem_type, self.dev)  # type: ignore[arg-type]

    @property
    def num_layers(self) -> int:
        return len(self.block_bytes)

    def to_group_layout(self) -> GroupLayout:
        """The peer's group as a :class:`GroupLayout`, so remote addresses come from the
        same ``regions()`` formula as local ones."""
        if len(self.bases) != self.num_layers or len(self.strides) != self.num_layers:
            raise HandshakeError(
                f"group {self.group_id}: descriptor carries {len(self.bases)} bases and "
                f"{len(self.strides)} strides for {self.num_layers} layers"
            )
        return GroupLayout(
            group_id=self.group_id,
            layer_names=(),  # names stay on the peer; only bytes travel
            bases=np.asarray(self.bases, dtype=np.int64),
            strides=np.asarray(self.strides, dtype=np.int64),
            block_bytes=np.asarray(self.block_bytes, dtype=np.int64),
        )


@dataclass(frozen=True)
class LayoutDescriptor:
    """One worker's KV cache as the other side needs to see it."""

    tp_size: int
    groups: tuple[GroupDescriptor | None, ...]  # None: the group has no layer on this worker
    # ``store.keys.kv_identity(vllm_config)`` as sorted (key, value) pairs (hashable): the
    # config fields outside the geometry that change the KV bytes or their meaning (two fp8
    # variants have equal block bytes; another revision has equal shapes).
    kv_identity: tuple[tuple[str, str], ...] = ()
    # The model's KV heads per attention layer over all ranks (0: unknown); with the
    # per-rank kv_heads it tells a head split from vLLM's replication of too few heads.
    total_kv_heads: int = 0

    @classmethod
    def from_kv(
        cls,
        layout: KVLayout,
        rows: Sequence[dict],
        tp_size: int,
        spaces: Sequence[MemorySpace | None] | None = None,
        kv_identity: Mapping[str, str] | None = None,
        kv_heads: Sequence[int] | None = None,
        total_kv_heads: int = 0,
        state_splits: Sequence[Sequence[StateSplit]] | None = None,
        head_slots: Sequence[tuple[int, bool]] | None = None,
    ) -> "LayoutDescriptor":
        """Combine the worker's addresses (``KVLayout``) with the spec facts of
        ``block_layout.layout_rows(kv_cache_config)``; ``spaces`` is each group's
        memory space (``PDTransport.group_spaces``; None: host memory);
        ``kv_identity`` is ``store.keys.kv_identity(vllm_config)``; ``kv_heads`` each
        group's KV heads on this rank (0 for state groups), ``total_kv_heads`` the model's;
        ``state_splits`` each group's Mamba state splits (empty: not a re-sliced Mamba group);
        ``head_slots`` each group's (``num_head_slots``, ``kv_head_major_slots``)
        (``pd_worker.group_head_slots``)."""
        if len(rows) != len(layout.groups):
            raise ValueError(f"{len(rows)} layout rows for {len(layout.groups)} groups")
        if spaces is not None and len(spaces) != len(layout.groups):
            raise ValueError(f"{len(spaces)} memory spaces for {len(layout.groups)} groups")
        groups: list[GroupDescriptor | None] = []
        for gi, (row, g) in enumerate(zip(rows, layout.groups, strict=True)):
            space = (spaces[gi] if spaces is not None else None) or HOST
            if g is None:
                groups.append(None)
                continue
            groups.append(
                GroupDescriptor(
                    group_id=g.group_id,
                    spec=str(row["spec"]),
                    block_size=int(row["block_size"]),
                    dtype=str(row["dtype"]),
                    sliding_window=row.get("window"),
                    block_bytes=tuple(int(x) for x in g.block_bytes),
                    bases=tuple(int(x) for x in g.bases),
                    strides=tuple(int(x) for x in g.strides),
                    mem_type=space.kind,
                    dev=space.dev,
                    block_formats=tuple(str(f) for f in g.block_formats),
                    kv_heads=int(kv_heads[gi]) if kv_heads is not None else 0,
                    kernel_rows=tuple(int(k) for k in g.kernel_rows),
                    kv_cache_layout=str(row.get("kv_cache_layout") or ""),
                    state_splits=tuple(
                        s.to_wire() for s in (state_splits[gi] if state_splits else ())
                    ),
                    num_head_slots=int(head_slots[gi][0]) if head_slots else 0,
                    kv_head_major_slots=bool(head_slots[gi][1]) if head_slots else False,
                )
            )
        return cls(
            tp_size=tp_size,
            groups=tuple(groups),
            kv_identity=_identity_pairs(kv_identity or {}),
            total_kv_heads=int(total_kv_heads),
        )

    def identity(self) -> dict[str, str]:
        return dict(self.kv_identity)

    def without_addresses(self) -> "LayoutDescriptor":
        return replace(
            self,
            groups=tuple(
                None if g is None else replace(g, bases=(), strides=()) for g in self.groups
            ),
        )

    def group_layouts(self) -> tuple[GroupLayout | None, ...]:
        return tuple(None if g is None else g.to_group_layout() for g in self.groups)

    def memory_spaces(self) -> tuple[MemorySpace | None, ...]:
        """Each group's memory space, for ``PDTransport.add_peer``."""
        return tuple(None if g is None else g.memory_space for g in self.groups)

    # JSON ------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "tp_size": self.tp_size,
            "groups": [
                None
                if g is None
                else {
                    "group_id": g.group_id,
                    "spec": g.spec,
                    "block_size": g.block_size,
                    "dtype": g.dtype,
                    "sliding_window": g.sliding_window,
                    "num_layers": g.num_layers,
                    "block_bytes": list(g.block_bytes),
                    "bases": list(g.bases),
                    "strides": list(g.strides),
                    "mem_type": g.mem_type,
                    "dev": g.dev,
                    "block_formats": list(g.block_formats),
                    "kv_heads": g.kv_heads,
                    "kernel_rows": list(g.kernel_rows),
                    "kv_cache_layout": g.kv_cache_layout,
                    "state_splits": [list(t) for t in g.state_splits],
                    "num_head_slots": g.num_head_slots,
                    "kv_head_major_slots": g.kv_head_major_slots,
                }
                for g in self.groups
            ],
            "kv_identity": dict(self.kv_identity),
            "total_kv_heads": self.total_kv_heads,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "LayoutDescriptor":
        groups: list[GroupDescriptor | None] = []
        for g in obj["groups"]:
            if g is None:
                groups.append(None)
                continue
            d = GroupDescriptor(
                group_id=int(g["group_id"]),
                spec=str(g["spec"]),
                block_size=int(g["block_size"]),
                dtype=str(g["dtype"]),
                sliding_window=None
                if g.get("sliding_window") is None
                else int(g["sliding_window"]),
                block_bytes=tuple(int(x) for x in g["block_bytes"]),
                bases=tuple(int(x) for x in g.get("bases", ())),
                strides=tuple(int(x) for x in g.get("strides", ())),
                # absent before version 4, which meant exactly host memory, device 0
                mem_type=str(g.get("mem_type", HOST.kind)),
                dev=int(g.get("dev", HOST.dev)),
                block_formats=tuple(str(f) for f in g.get("block_formats", ())),
                kv_heads=int(g.get("kv_heads", 0)),
                kernel_rows=tuple(int(k) for k in g.get("kernel_rows", ())),
                kv_cache_layout=str(g.get("kv_cache_layout", "")),
                state_splits=tuple(tuple(int(x) for x in t) for t in g.get("state_splits", ())),
                num_head_slots=int(g.get("num_head_slots", 0)),
                kv_head_major_slots=_flag(g.get("kv_head_major_slots", False)),
            )
            if int(g.get("num_layers", d.num_layers)) != d.num_layers:
                raise ValueError(
                    f"group {d.group_id}: num_layers={g['num_layers']} but {d.num_layers} block_bytes"
                )
            groups.append(d)
        if not isinstance(obj.get("kv_identity"), dict):
            raise ValueError(
                f"layout has no kv_identity (added in handshake version 5; this side speaks "
                f"HANDSHAKE_VERSION={HANDSHAKE_VERSION}): the peer runs an older hybridkv; install the "
                "same hybridkv version on both instances"
            )
        return cls(
            tp_size=int(obj["tp_size"]),
            groups=tuple(groups),
            kv_identity=_identity_pairs(obj["kv_identity"]),
            total_kv_heads=int(obj.get("total_kv_heads", 0)),
        )


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected true or false, got {v!r}")
    return v


def _identity_pairs(identity: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in identity.items()))


@dataclass(frozen=True)
class AgentInfo:
    """The prefill worker's answer: who to READ from and where its blocks are."""

    engine_id: str
    tp_rank: int
    agent_name: str
    agent_metadata: bytes
    layout: LayoutDescriptor
    version: int = HANDSHAKE_VERSION

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.layout.tp_size,
            "nixl_agent_name": self.agent_name,
            "nixl_agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
            "layout": self.layout.to_json(),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "AgentInfo":
        layout = LayoutDescriptor.from_json(obj["layout"])
        if int(obj["tp_size"]) != layout.tp_size:
            raise ValueError(f"tp_size={obj['tp_size']} but layout says {layout.tp_size}")
        return cls(
            version=int(obj["version"]),
            engine_id=str(obj["engine_id"]),
            tp_rank=int(obj["tp_rank"]),
            agent_name=str(obj["nixl_agent_name"]),
            agent_metadata=base64.b64decode(obj["nixl_agent_metadata"]),
            layout=layout,
        )


@dataclass(frozen=True)
class AgentInfoRequest:
    """Decode's question; ``expected`` (decode's own layout, no addresses) lets the
    server refuse too."""

    engine_id: str
    tp_rank: int  # the decode rank asking
    expected: LayoutDescriptor | None
    version: int = HANDSHAKE_VERSION
    prefill_rank: int | None = None  # the prefill rank it wants (None: its own rank)

    @property
    def wanted_rank(self) -> int:
        return self.tp_rank if self.prefill_rank is None else self.prefill_rank

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "prefill_rank": self.wanted_rank,
            "expected_layout": None if self.expected is None else self.expected.to_json(),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "AgentInfoRequest":
        exp = obj.get("expected_layout")
        return cls(
            version=int(obj["version"]),
            engine_id=str(obj["engine_id"]),
            tp_rank=int(obj["tp_rank"]),
            expected=None if exp is None else LayoutDescriptor.from_json(exp),
            prefill_rank=int(obj.get("prefill_rank", obj["tp_rank"])),
        )


# --------------------------------------------------------------------------- compatibility


@dataclass(frozen=True)
class Mismatch:
    """One field on which prefill and decode disagree, phrased for the operator."""

    where: str  # "" or e.g. "group 1", "group 0 layer 2"
    name: str  # e.g. "block_size"
    prefill: Any
    decode: Any
    fix: str

    @property
    def field(self) -> str:
        return f"{self.where} {self.name}".strip()

    def __str__(self) -> str:
        return f"prefill {self.field}={self.prefill} but decode has {self.decode}: {self.fix}"


_SAME_MODEL = "serve the same model (and speculative/drafter config) on both instances"
_SAME_IDENTITY = "both instances must serve the same model with the same --kv-cache-dtype/quantization/rope settings"
_MISSING = "<absent>"


def identity_mismatches(prefill: LayoutDescriptor, decode: LayoutDescriptor) -> list[Mismatch]:
    """One mismatch per ``kv_identity`` key the two sides disagree on (a key only one side
    has counts: its value on the other side is ``<absent>``). Values are kv_identity's
    canonical JSON text, shown as is."""
    p, d = prefill.identity(), decode.identity()
    return [
        Mismatch("", f"kv_identity.{k}", p.get(k, _MISSING), d.get(k, _MISSING), _SAME_IDENTITY)
        for k in sorted(p.keys() | d.keys())
        if p.get(k) != d.get(k)
    ]


def version_mismatch(prefill: int, decode: int) -> Mismatch | None:
    if prefill == decode:
        return None
    return Mismatch(
        "handshake",
        "version",
        prefill,
        decode,
        "install the same hybridkv version on both instances",
    )


def find_mismatches(prefill: LayoutDescriptor, decode: LayoutDescriptor) -> list[Mismatch]:
    """Every reason decode cannot copy prefill's blocks byte for byte (empty: compatible).

    The single compatibility rule of P/D; both the client and the server call it.
    """
    out: list[Mismatch] = identity_mismatches(prefill, decode)
    hetero = prefill.tp_size != decode.tp_size
    if hetero:
        problem = ratio_problem(prefill.tp_size, decode.tp_size)
        if problem:
            out.append(Mismatch("", "tp_size", prefill.tp_size, decode.tp_size, problem))
            return out
        if prefill.total_kv_heads != decode.total_kv_heads or prefill.total_kv_heads < max(
            prefill.tp_size, decode.tp_size
        ):
            out.append(
                Mismatch(
                    "",
                    "total_kv_heads",
                    prefill.total_kv_heads,
                    decode.total_kv_heads,
                    "heads re-sliced between TP sizes need the same model with at least as many "
                    "KV heads as ranks on each side; else use the same --tensor-parallel-size",
                )
            )
    if len(prefill.groups) != len(decode.groups):
        out.append(Mismatch("", "num_groups", len(prefill.groups), len(decode.groups), _SAME_MODEL))
        return out
    for gid, (p, d) in enumerate(zip(prefill.groups, decode.groups, strict=True)):
        if p is None or d is None:
            if p is not d:
                out.append(
                    Mismatch(
                        f"group {gid}",
                        "has_layers",
                        p is not None,
                        d is not None,
                        "use the same --pipeline-parallel-size and model on both instances",
                    )
                )
            continue
        g = f"group {gid}"
        if p.spec != d.spec:
            out.append(Mismatch(g, "spec", p.spec, d.spec, _SAME_MODEL))
            continue  # the rest compares different kinds of bytes
        if p.block_size != d.block_size:
            flag = "--block-size (and --mamba-block-size)" if "Mamba" in p.spec else "--block-size"
            out.append(
                Mismatch(
                    g,
                    "block_size",
                    p.block_size,
                    d.block_size,
                    f"start both instances with the same {flag}",
                )
            )
        if p.sliding_window != d.sliding_window:
            out.append(
                Mismatch(g, "sliding_window", p.sliding_window, d.sliding_window, _SAME_MODEL)
            )
        if p.num_layers != d.num_layers:
            out.append(
                Mismatch(
                    g,
                    "num_layers",
                    p.num_layers,
                    d.num_layers,
                    f"{_SAME_MODEL}, with the same --pipeline-parallel-size",
                )
            )
            continue
        if p.dtype != d.dtype:
            out.append(
                Mismatch(
                    g,
                    "dtype",
                    p.dtype,
                    d.dtype,
                    "start both instances with the same --dtype / --kv-cache-dtype",
                )
            )
        if hetero and not replicated_on_every_rank(p.spec):
            out.extend(_heterogeneous_group_mismatches(g, p, d, prefill, decode))
            continue
        # equal TP sizes, or a group every rank holds whole (MLA latent): block for block
        if p.block_formats != d.block_formats:
            out.append(
                Mismatch(
                    g,
                    "block_formats",
                    list(p.block_formats),
                    list(d.block_formats),
                    "the blocks are laid out differently (kernel-block split or head/token order): run the "
                    "same attention backend / kernel block size / VLLM_KV_CACHE_LAYOUT on both instances",
                )
            )
        if p.block_bytes != d.block_bytes:
            layer = next(i for i, (a, b) in enumerate(zip(p.block_bytes, d.block_bytes)) if a != b)
            out.append(
                Mismatch(
                    f"{g} layer {layer}",
                    "block_bytes",
                    p.block_bytes[layer],
                    d.block_bytes[layer],
                    "the per-layer block bytes (kv heads x head size x dtype x block size) must "
                    "match: same model, --kv-cache-dtype, --block-size and --tensor-parallel-size",
                )
            )
    return out


def _heterogeneous_group_mismatches(
    g: str,
    p: GroupDescriptor,
    d: GroupDescriptor,
    prefill: LayoutDescriptor,
    decode: LayoutDescriptor,
) -> list[Mismatch]:
    """What stops decode assembling its blocks of one group from head ranges of prefill's
    (prefill and decode at different TP sizes; see pd_tp)."""
    same_tp = "start both instances with the same --tensor-parallel-size"
    if "Mamba" in p.spec:
        try:
            ps, ds = p.splits(), d.splits()
        except ValueError as e:
            return [
                Mismatch(
                    g, "state_splits", list(p.state_splits), list(d.state_splits), f"{e}; {same_tp}"
                )
            ]
        problem = state_split_problem(ds, ps, decode.tp_size, prefill.tp_size)
        if problem is None:  # the states must also fit each layer's page on both sides
            for layer, (pb, db) in enumerate(zip(p.block_bytes, d.block_bytes)):
                if why := state_split_problem(ds, ps, decode.tp_size, prefill.tp_size, db, pb):
                    problem = f"layer {layer}: {why}"
                    break
        if problem:
            return [
                Mismatch(
                    g,
                    "state_splits",
                    list(p.state_splits),
                    list(d.state_splits),
                    f"{p.spec} state cannot be re-sliced between TP {prefill.tp_size} and "
                    f"{decode.tp_size}: {problem}; {same_tp} for this model",
                )
            ]
        return []
    if p.kv_heads < 1 or d.kv_heads < 1:
        return [
            Mismatch(
                g,
                "kv_heads",
                p.kv_heads,
                d.kv_heads,
                f"a side did not say how many KV heads its {p.spec} blocks hold; {same_tp}",
            )
        ]
    out = []
    for side, x in (("prefill", p), ("decode", d)):
        if x.num_head_slots and not x.kv_head_major_slots:
            out.append(
                Mismatch(
                    g,
                    "num_head_slots",
                    p.num_head_slots,
                    d.num_head_slots,
                    f"the {side} side's attention backend packs {x.num_head_slots} slots per page "
                    f"for {x.kv_heads} KV heads without grouping them by head "
                    "(kv_head_major_slots false), so a head's bytes are not one run that head "
                    f"slicing can cut; {same_tp}, or a backend whose slots are grouped by KV head",
                )
            )
            break
    total = prefill.total_kv_heads
    if p.kv_heads * prefill.tp_size != total or d.kv_heads * decode.tp_size != total:
        out.append(
            Mismatch(
                g,
                "kv_heads",
                p.kv_heads,
                d.kv_heads,
                f"per-rank KV heads x TP size must be the model's {total} heads on both sides "
                f"(vLLM replicates heads when there are fewer than ranks); {same_tp}",
            )
        )
    for side, layout_name in (("prefill", p.kv_cache_layout), ("decode", d.kv_cache_layout)):
        if not head_outermost(layout_name):
            out.append(
                Mismatch(
                    g,
                    "kv_cache_layout",
                    p.kv_cache_layout,
                    d.kv_cache_layout,
                    f"the {side} side's layout {layout_name or '<unknown>'} is not head-outermost within a "
                    f"block; use LBHNC (VLLM_KV_CACHE_LAYOUT unset) on both, or {same_tp}",
                )
            )
            break
    if p.kernel_rows != d.kernel_rows:
        out.append(
            Mismatch(
                g,
                "kernel_rows",
                list(p.kernel_rows),
                list(d.kernel_rows),
                "run the same attention backend / kernel block size on both instances",
            )
        )
    for layer, (a, b) in enumerate(zip(p.block_bytes, d.block_bytes)):
        if a * d.kv_heads != b * p.kv_heads:
            out.append(
                Mismatch(
                    f"{g} layer {layer}",
                    "block_bytes",
                    a,
                    b,
                    f"block bytes must be proportional to the KV heads ({p.kv_heads} vs {d.kv_heads}): "
                    "same model, --kv-cache-dtype and --block-size",
                )
            )
            break
    return out


def _refusal(peer: str, problems: Sequence[Mismatch]) -> str:
    return f"P/D handshake with {peer} refused: " + "; ".join(str(m) for m in problems)


# --------------------------------------------------------------------------- server


class HandshakeServer:
    """Serves one prefill worker's :class:`AgentInfo` on ``host:port`` (port 0: pick a free one).

    Runs in the prefill worker (one per TP rank) for the worker's lifetime.
    """

    def __init__(
        self,
        info: AgentInfo,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = HANDSHAKE_THREADS,
        on_release: Callable[[list[str], int, int], None] | None = None,
        on_claim: Callable[[str, str, int, int], float] | None = None,
        key: DeploymentKey | None = None,
    ):
        """``on_claim(request_id, lease_id, reader, readers)`` returns the seconds the blocks
        are still held or raises :class:`LeaseRefused`; ``on_release(request_ids, reader,
        readers)``: ``reader`` is the calling decode rank, ``readers`` how many decode
        ranks read this prefill rank (decode TP > prefill TP: more than one). ``key``
        None: an unauthenticated deployment."""
        self._info = info
        self._on_release = on_release
        self._on_claim = on_claim
        self._key = key
        self._body = json.dumps(info.to_json()).encode()
        self._host = host
        self._requested_port = port
        self._replays = ReplayGuard()
        self._refusals = RefusalLog(logger)
        self._executor = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="pd-handshake"
        )
        # No SO_REUSEPORT (gRPC's default): a second worker configured with the same port must
        # fail to start, not silently share the port and answer for the other rank. Calls past
        # MAX_CONCURRENT_RPCS are answered RESOURCE_EXHAUSTED instead of queueing without bound.
        self._server = grpc.server(
            self._executor,
            options=[("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                self._authenticated(name, fn),
                request_deserializer=lambda b: b,
                response_serializer=lambda b: b,
            )
            for name, fn in (
                (METHOD, self._get_agent_info),
                (RELEASE_METHOD, self._release_blocks),
                (CLAIM_METHOD, self._claim_lease),
            )
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        self.port: int | None = None

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("HandshakeServer not started")
        return f"{self._host}:{self.port}"

    def start(self) -> int:
        """Bind and serve; returns the bound port."""
        target = f"{self._host}:{self._requested_port}"
        try:
            port = self._server.add_insecure_port(target)
        except RuntimeError as e:  # grpcio raises when it cannot bind
            raise HandshakeError(f"P/D handshake server cannot bind {target}: {e}") from e
        if port == 0:
            raise HandshakeError(
                f"P/D handshake server cannot bind {target}: port in use or host not local"
            )
        self._server.start()
        self.port = port
        return port

    def stop(self, grace_s: float = 0.5) -> None:
        self._server.stop(grace_s).wait(grace_s + 1.0)
        self._executor.shutdown(wait=False)

    def __enter__(self) -> "HandshakeServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _authenticated(self, method: str, fn: Callable[[bytes, grpc.ServicerContext], bytes]):
        """Refuse a call without this deployment's MAC before its body is parsed, and a body
        accepted before (a replay: pd_replay); MAC the answer."""

        def handler(body: bytes, context: grpc.ServicerContext) -> bytes:
            if self._key is not None:
                if not self._key.verify(
                    _metadata_value(context.invocation_metadata()),
                    PURPOSE_RPC_REQUEST,
                    method,
                    _digest(body),
                ):
                    message = (
                        f"P/D side channel: {method} from {context.peer()} refused: no valid {MAC_METADATA} "
                        "(a caller without this deployment's secret, or another auth_secret_file)"
                    )
                    self._refusals.warn(context.peer(), "mac", "%s", message)
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
                try:
                    why = self._replays.refusal(json.loads(body))
                except ValueError:
                    why = "the body is not JSON"
                if why is not None:
                    message = f"P/D side channel: {method} from {context.peer()} refused: {why}"
                    self._refusals.warn(context.peer(), "replay", "%s", message)
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            answer = fn(body, context)
            if self._key is not None:
                context.set_trailing_metadata(
                    ((MAC_METADATA, answer_mac(self._key, method, body, answer)),)
                )
            return answer

        return handler

    def _get_agent_info(self, body: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            obj = json.loads(body)
            peer = f"decode engine {obj.get('engine_id')!r} rank {obj.get('tp_rank')}"
            # Version first: a request of another version may not parse as this one.
            v = version_mismatch(self._info.version, obj.get("version"))
            if v is not None:
                self._refuse(context, _refusal(peer, [v]))
            req = AgentInfoRequest.from_json(obj)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed GetAgentInfo request: {e!r}"
            )
        if req.wanted_rank != self._info.tp_rank:
            self._refuse(
                context,
                f"P/D handshake with {peer} refused: it asked for prefill rank {req.wanted_rank} but this is "
                f"prefill engine {self._info.engine_id!r} rank {self._info.tp_rank}: check the "
                "handshake address used for that rank",
            )
        if req.expected is not None:
            problems = find_mismatches(self._info.layout, req.expected)
            if problems:
                self._refuse(context, _refusal(peer, problems))
        return self._body

    def _release_blocks(self, body: bytes, context: grpc.ServicerContext) -> bytes:
        """Decode is done with these requests' blocks (read, or nothing to read): free them
        now instead of at lease expiry. Over gRPC, not a NIXL notification: polling NIXL for
        notifications on every engine step stalled incoming READs until the lease expired."""
        try:
            obj = json.loads(body)
            ids = obj["request_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise TypeError("request_ids must be a list of strings")
            reader, readers = _reader_fields(obj)
        except (ValueError, KeyError, TypeError) as e:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed ReleaseBlocks request: {e!r}"
            )
        if self._on_release is not None:
            self._on_release(ids, reader, readers)
        return b"{}"

    def _claim_lease(self, body: bytes, context: grpc.ServicerContext) -> bytes:
        """Decode's READ of a request's blocks has ended: grant (once) if the lease still
        holds them, answering the seconds left on this host's monotonic clock."""
        try:
            obj = json.loads(body)
            rid, lid = obj["request_id"], obj["lease_id"]
            if not isinstance(rid, str) or not isinstance(lid, str):
                raise TypeError("request_id and lease_id must be strings")
            reader, readers = _reader_fields(obj)
        except (ValueError, KeyError, TypeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed ClaimLease request: {e!r}")
        if self._on_claim is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this instance holds no leases")
        try:
            remaining = self._on_claim(rid, lid, reader, readers)
        except LeasePending:
            return json.dumps({"request_id": rid, "retry_s": CLAIM_RETRY_S}).encode()
        except LeaseRefused as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return json.dumps({"request_id": rid, "remaining_s": remaining}).encode()

    def _refuse(self, context: grpc.ServicerContext, message: str) -> None:
        """Log on the prefill side (the operator looks there too; rate-limited per peer host)
        and answer FAILED_PRECONDITION."""
        self._refusals.warn(context.peer(), "handshake", "%s", message)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)


def _reader_fields(obj: dict[str, Any]) -> tuple[int, int]:
    """(reader, readers) of a claim or release (absent: one reader, rank 0)."""
    reader, readers = obj.get("reader", 0), obj.get("readers", 1)
    for name, v, lo in (("reader", reader, 0), ("readers", readers, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_TP:
            raise TypeError(f"{name} must be an integer in [{lo}, {MAX_TP}]")
    return reader, readers


# --------------------------------------------------------------------------- client


class _Channels:
    """One gRPC channel per peer address, reused by every call to it (bounded LRU).

    Why: each release, claim and handshake opened a channel of its own (a TCP connect
    and HTTP/2 setup per call, on the peer's read thread); a decode serving many
    requests from one prefill paid that per request. A channel that saw a failed call
    is dropped, so the next call to a restarted peer starts clean instead of waiting out
    a reconnect backoff. An evicted channel is not closed here: a call running on it
    holds its own reference, and gRPC closes it once the last one is gone.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._by_address: OrderedDict[tuple[str, int], grpc.Channel] = OrderedDict()
        self.opened = 0  # channels created (tests and bounds)

    def get(self, address: str, connect_timeout_s: float = 20.0) -> grpc.Channel:
        """``connect_timeout_s``: the caller's bound; a new connection may wait that long plus
        ``CONNECT_MARGIN_MS`` for the peer's HTTP/2 SETTINGS (gRPC's default is 20 s whatever
        the call's deadline). The margin keeps the call's own deadline first: with both equal
        a silent peer's call ended UNAVAILABLE ("unreachable") or DEADLINE_EXCEEDED ("no
        answer") by a race that a loaded CI box decided (test_pd_transport failed on it)."""
        key = (address, max(1000, math.ceil(connect_timeout_s * 1000)) + CONNECT_MARGIN_MS)
        with self._lock:
            channel = self._by_address.get(key)
            if channel is not None:
                self._by_address.move_to_end(key)
                return channel
            channel = grpc.insecure_channel(
                address, options=[*_CHANNEL_OPTIONS, ("grpc.min_reconnect_backoff_ms", key[1])]
            )
            self.opened += 1
            self._by_address[key] = channel
            while len(self._by_address) > self._capacity:
                self._by_address.popitem(last=False)
            return channel

    def drop(self, address: str, channel: grpc.Channel) -> None:
        with self._lock:
            for key in [k for k, c in self._by_address.items() if k[0] == address and c is channel]:
                del self._by_address[key]

    def __len__(self) -> int:
        return len(self._by_address)


CONNECT_MARGIN_MS = 1000  # see _Channels.get
MAX_PEER_CHANNELS = 64  # as many as the NIXL peers a decode worker keeps (PDWorker MAX_PEERS)
_channels = _Channels(MAX_PEER_CHANNELS)


def _call(
    address: str, method: str, obj: dict[str, Any], timeout_s: float, key: DeploymentKey | None
) -> bytes:
    """One authenticated unary call: a nonce in the body, the MAC in the metadata, the
    answer's MAC checked (raises :class:`HandshakeError` if it is missing or wrong)."""
    body = json.dumps({**obj, "nonce": secrets.token_hex(16), "ts": time.time()}).encode()
    metadata = () if key is None else ((MAC_METADATA, request_mac(key, method, body)),)
    channel = _channels.get(address, timeout_s)
    try:
        answer, call = channel.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        ).with_call(body, timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as e:
        if (
            e.code() != grpc.StatusCode.FAILED_PRECONDITION
        ):  # a refusal is an answer: the channel is fine
            _channels.drop(address, channel)
        raise
    if key is not None and not key.verify(
        _metadata_value(call.trailing_metadata()),
        PURPOSE_RPC_ANSWER,
        method,
        _digest(body),
        _digest(answer),
    ):
        raise HandshakeError(
            f"P/D side channel: the {method} answer of {address} carries no valid {MAC_METADATA}: it does not "
            "hold this deployment's secret (another auth_secret_file, or not a hybridkv prefill worker)"
        )
    return answer


def _rpc_failure(e: grpc.RpcError) -> str:
    """``CODE: details``, with what a busy side channel means."""
    text = f"{e.code().name}: {e.details()}"
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        text += (
            f" (the prefill worker's side channel holds {MAX_CONCURRENT_RPCS} calls already and refuses "
            "more; the request recomputes)"
        )
    return text


def release_blocks(
    address: str,
    request_ids: Sequence[str],
    timeout_s: float,
    key: DeploymentKey | None = None,
    reader: int = 0,
    readers: int = 1,
) -> None:
    """Tell the prefill worker at ``address`` it may free these requests' blocks now
    (once all ``readers`` decode ranks that read it said so; ``reader``: this one)."""
    try:
        _call(
            address,
            RELEASE_METHOD,
            {"request_ids": list(request_ids), "reader": reader, "readers": readers},
            timeout_s,
            key,
        )
    except grpc.RpcError as e:
        raise HandshakeError(f"P/D release on {address} failed: {_rpc_failure(e)}") from None


def claim_lease(
    address: str,
    request_id: str,
    lease_id: str,
    timeout_s: float,
    key: DeploymentKey | None = None,
    reader: int = 0,
    readers: int = 1,
    wait_s: float = CLAIM_WAIT_S,
) -> float:
    """Claim the prefill side's lease on ``request_id``'s blocks once a READ of them ended.

    Success proves the blocks were held (not expired, released or claimed by another
    reader) until after the READ; returns the seconds the lease had left, on the prefill
    host's clock. Raises :class:`LeaseRefused` (unknown, claimed or released already,
    expired) or :class:`HandshakeError`.

    The prefill worker may not hold the lease yet (its next engine step delivers it): it
    then answers ``retry_s`` at once, and the claim is asked again until ``wait_s`` passed.
    """
    give_up = time.monotonic() + wait_s
    while True:
        try:
            raw = _call(
                address,
                CLAIM_METHOD,
                {
                    "request_id": request_id,
                    "lease_id": lease_id,
                    "reader": reader,
                    "readers": readers,
                },
                timeout_s,
                key,
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LeaseRefused(f"{e.details()} (prefill worker at {address})") from None
            raise HandshakeError(
                f"P/D lease claim on {address} failed: {_rpc_failure(e)}"
            ) from None
        try:
            obj = json.loads(raw)
            if obj["request_id"] != request_id:
                raise TypeError(f"answer {obj!r}")
            retry = obj.get("retry_s")
            if retry is None:
                remaining = obj["remaining_s"]
                if isinstance(remaining, bool) or not isinstance(remaining, (int, float)):
                    raise TypeError(f"answer {obj!r}")
                return float(remaining)
            if (
                isinstance(retry, bool)
                or not isinstance(retry, (int, float))
                or not 0 <= retry <= 1
            ):
                raise TypeError(f"answer {obj!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise HandshakeError(
                f"P/D lease claim on {address}: malformed answer ({e!r})"
            ) from None
        if time.monotonic() + retry >= give_up:
            raise LeaseRefused(
                f"request {request_id}: no such lease (the prefill worker at {address} did not "
                f"hold it within {wait_s:g} s)"
            )
        time.sleep(max(float(retry), 0.005))


def request_agent_info(
    address: str, request: AgentInfoRequest, timeout_s: float, key: DeploymentKey | None = None
) -> AgentInfo:
    """One GetAgentInfo round trip, decoded; only the version is checked (it decides
    how to parse). :func:`fetch_agent_info` adds the layout checks."""
    try:
        raw = _call(address, METHOD, request.to_json(), timeout_s, key)
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            raise HandshakeError(f"{details} (answer of the prefill worker at {address})") from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise HandshakeError(
                f"P/D handshake with {address}: no answer within {timeout_s:g} s; check that the "
                "prefill instance is up and that this address is its hybridkv handshake port "
                "(not the HTTP or NIXL port)"
            ) from None
        if code == grpc.StatusCode.UNAVAILABLE:
            raise HandshakeError(
                f"P/D handshake with {address}: unreachable ({details}); check that the prefill "
                "instance is running, that its handshake host/port match, and that the host is "
                "reachable from this decode worker"
            ) from None
        raise HandshakeError(f"P/D handshake with {address} failed: {_rpc_failure(e)}") from None
    try:
        obj = json.loads(raw)
        # Version first: an answer of another version may not parse as this one.
        v = version_mismatch(obj.get("version"), request.version)
        if v is not None:
            peer = f"prefill engine {obj.get('engine_id')!r} rank {obj.get('tp_rank')} at {address}"
            raise HandshakeError(_refusal(peer, [v]))
        return AgentInfo.from_json(obj)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise HandshakeError(
            f"P/D handshake with {address}: malformed answer ({e!r}); is it a hybridkv prefill "
            "worker of the same version?"
        ) from None


def check_agent_info(
    info: AgentInfo,
    local: LayoutDescriptor,
    *,
    address: str,
    tp_rank: int,
    prefill_engine_id: str | None = None,
) -> None:
    """``tp_rank``: the prefill rank this worker asked for."""
    """Decode side: refuse an answer this worker cannot READ from (raises :class:`HandshakeError`)."""
    peer = f"prefill engine {info.engine_id!r} rank {info.tp_rank} at {address}"
    v = version_mismatch(info.version, HANDSHAKE_VERSION)
    if v is not None:
        raise HandshakeError(_refusal(peer, [v]))
    if prefill_engine_id is not None and info.engine_id != prefill_engine_id:
        raise HandshakeError(
            f"P/D handshake with {address}: expected prefill engine {prefill_engine_id!r} but "
            f"{info.engine_id!r} answered; the handshake address in kv_transfer_params points at "
            "another instance"
        )
    if info.tp_rank != tp_rank:
        raise HandshakeError(
            f"P/D handshake with {peer}: asked for prefill rank {tp_rank} but reached prefill rank "
            f"{info.tp_rank}; check the handshake address used for that rank"
        )
    problems = find_mismatches(info.layout, local)
    if problems:
        raise HandshakeError(_refusal(peer, problems))


def fetch_agent_info(
    address: str,
    local: LayoutDescriptor,
    *,
    engine_id: str,
    tp_rank: int,
    timeout_s: float = 5.0,
    prefill_engine_id: str | None = None,
    key: DeploymentKey | None = None,
    prefill_rank: int | None = None,
) -> AgentInfo:
    """Decode side: ask ``address`` for its agent and layout, and refuse any incompatibility.

    ``local`` is this decode worker's own layout (its addresses are not sent).
    ``prefill_engine_id``, when known from ``kv_transfer_params``, must match the
    answering engine. Raises :class:`HandshakeError` naming the field, both
    values and the fix, or the address and what to check when there is no answer.
    """
    wanted = tp_rank if prefill_rank is None else prefill_rank
    info = request_agent_info(
        address,
        AgentInfoRequest(
            engine_id=engine_id,
            tp_rank=tp_rank,
            expected=local.without_addresses(),
            prefill_rank=wanted,
        ),
        timeout_s,
        key,
    )
    check_agent_info(
        info, local, address=address, tp_rank=wanted, prefill_engine_id=prefill_engine_id
    )
    return info


__all__ = [
    "HANDSHAKE_VERSION",
    "AgentInfo",
    "AgentInfoRequest",
    "GroupDescriptor",
    "HandshakeError",
    "HandshakeServer",
    "LayoutDescriptor",
    "LeasePending",
    "LeaseRefused",
    "answer_mac",
    "check_agent_info",
    "claim_lease",
    "release_blocks",
    "request_mac",
    "Mismatch",
    "fetch_agent_info",
    "find_mismatches",
    "identity_mismatches",
    "request_agent_info",
    "version_mismatch",
]
