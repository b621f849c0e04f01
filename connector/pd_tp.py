"""Which prefill ranks a decode rank reads, and which bytes of each block, across TP sizes.

Why its own module: with tensor parallelism every rank holds only its share of each
attention layer's KV heads (vLLM splits ``total_kv_heads`` evenly over the ranks), so
when prefill and decode run different ``--tensor-parallel-size`` a decode rank's block
is assembled from the matching head range of one or several prefill ranks' blocks
(prefill TP2 -> decode TP1: rank 0 takes heads [0, H/2) from prefill rank 0 and
[H/2, H) from rank 1), or is a head sub-range of one prefill rank's block (TP1 -> TP2).
Getting this wrong moves another head's KV: no error, wrong output. So the plan is one
pure function of (ranks, sizes, heads) and the byte ranges one pure function of the
layout, both unit-tested against real tensors.

Bytes: in a head-outermost block layout (vLLM's LBHNC, the CPU backend's only one),
one kernel row of a layer's block is ``[H, N, C]`` with head ``h`` at
``h * N * C`` bytes, so a head range is one contiguous span per kernel row. A layout
where tokens are outside heads (LBNHC) would need a span per token: refused.

Mamba / linear-attention state (GDN, the only kind re-sliced): vLLM packs a layer's
states into its page one after another in spec order from byte 0, padding after the
last (``MambaBase.bind_kv_cache``). Each state is split over ranks along one dimension
made of TP-sharded parts: GDN's conv state along its channels ``[q | k | v]`` (each
part cut in ``tp`` equal pieces by ``mamba_v2_sharded_weight_loader``), stored
``(state_len, channels)`` (vLLM's default ``SD`` conv layout: one span per part per
state row) or ``(channels, state_len)`` (``VLLM_SSM_CONV_STATE_LAYOUT=DS``: one span per
part); its SSM state ``(v_heads, head_v_dim, head_k_dim)`` along v heads, outermost (one
span). :class:`StateSplit` describes one state on one rank; both sides send theirs in
the handshake and :func:`mamba_slices` turns a pair into spans. Other Mamba kinds
(Mamba1/2, KDA, replicated states) need equal TP sizes (refused with the field named).
The scheduler refuses Mamba models across sizes by default (:data:`MAMBA_TP_NOT_ENABLED`
says why); the decode instance's ``allow_mamba_cross_tp`` enables it, and then only a layout
``pd_worker.mamba_reslice_problem`` accepts (every Mamba group GDN state) pairs.

MLA latent caches (:data:`REPLICATED_SPECS`) are not split over ranks at all: vLLM computes
the latent with a replicated projection, so every rank holds the same one latent row per
token (``MLAAttentionSpec.num_kv_heads`` is 1 at any TP). A decode rank reads such a group
whole from ONE prefill rank, :func:`latent_rank` (the first rank it reads anyway), and
nothing of it from the others, while the other groups of the same READs are head- or
state-sliced.

Head slicing cuts each kernel row ``[H, N, C]`` into one run per KV head. An attention spec
may pack ``num_head_slots`` slots instead of one per head: grouped by head (vLLM 0.34's
``kv_head_major_slots``, e.g. each head's K and V slots side by side) every head is still
one run and slices exactly; slots not grouped by head are refused across TP sizes (the
handshake names ``num_head_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A layout name in which H (heads) comes before N (tokens/states) and C (content):
# a head range of one kernel row is one contiguous span.
HEAD_OUTERMOST_LAYOUTS = ("LBHNC", "BLHNC")  # vllm.v1.kv_cache_layout.KVCacheLayout names

MAX_TP = 256

# Spec type names (``block_layout.layout_rows``' "spec") whose cache every TP rank holds
# whole: MLA's latent (vLLM 0.34 also says so with ``max_tp_shards=1`` on these specs).
REPLICATED_SPECS = ("MLAAttentionSpec", "SlidingWindowMLASpec")


@dataclass(frozen=True)
class RankRead:
    """Heads ``[remote_head0, remote_head0 + num_heads)`` of prefill rank ``prefill_rank``'s
    block land at heads ``[local_head0, ...)`` of this decode rank's block."""

    prefill_rank: int
    local_head0: int
    remote_head0: int
    num_heads: int
    whole: bool  # same TP size: the whole block, byte for byte (no slicing)


def ratio_problem(prefill_tp: int, decode_tp: int) -> str | None:
    """Why these TP sizes cannot pair at all (None: one divides the other)."""
    if not (1 <= prefill_tp <= MAX_TP and 1 <= decode_tp <= MAX_TP):
        return f"TP sizes must be in [1, {MAX_TP}] (prefill {prefill_tp}, decode {decode_tp})"
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        return (
            f"prefill tensor_parallel_size={prefill_tp} and decode {decode_tp}: one must divide the other "
            "(each decode rank's heads must come from whole prefill ranks, or lie inside one)"
        )
    return None


def heads_split_problem(total_heads: int, prefill_tp: int, decode_tp: int) -> str | None:
    """Why the model's KV heads cannot be cut evenly over both TP sizes (None: they can).
    vLLM replicates heads when there are fewer heads than ranks, which this does not model."""
    if (
        total_heads < max(1, prefill_tp, decode_tp)
        or total_heads % prefill_tp
        or total_heads % decode_tp
    ):
        return (
            f"the model's {total_heads} KV heads do not split evenly over prefill TP {prefill_tp} and "
            f"decode TP {decode_tp} (vLLM replicates heads when there are fewer heads than ranks)"
        )
    return None


def rank_reads(
    decode_rank: int, decode_tp: int, prefill_tp: int, total_heads: int
) -> list[RankRead]:
    """The prefill ranks decode rank ``decode_rank`` reads, with head ranges, in rank order.

    ``total_heads``: the model's KV heads per layer (all ranks together); must be a
    multiple of both TP sizes (vLLM replicates heads when there are fewer than ranks,
    which this does not model). Equal TP sizes: rank r reads rank r whole.
    """
    problem = ratio_problem(prefill_tp, decode_tp)
    if problem:
        raise ValueError(problem)
    if not 0 <= decode_rank < decode_tp:
        raise ValueError(f"decode rank {decode_rank} outside [0, {decode_tp})")
    if prefill_tp == decode_tp:
        return [RankRead(decode_rank, 0, 0, total_heads // decode_tp if total_heads else 0, True)]
    if (problem := heads_split_problem(total_heads, prefill_tp, decode_tp)) is not None:
        raise ValueError(problem)
    hd, hp = total_heads // decode_tp, total_heads // prefill_tp
    lo, hi = decode_rank * hd, (decode_rank + 1) * hd
    out = []
    for p in range(prefill_tp):
        a, b = max(lo, p * hp), min(hi, (p + 1) * hp)
        if a < b:
            out.append(RankRead(p, a - lo, a - p * hp, b - a, False))
    return out


def replicated_on_every_rank(spec: str) -> bool:
    """Whether a group of spec type ``spec`` holds the same bytes on every TP rank."""
    return spec in REPLICATED_SPECS


def latent_rank(decode_rank: int, decode_tp: int, prefill_tp: int) -> int:
    """The prefill rank decode rank ``decode_rank`` reads replicated groups from: the first
    rank of its :func:`rank_reads` plan (its own when the sizes are equal), so no extra
    handshake or lease; decode ranks reading disjoint prefill ranks spread over them."""
    problem = ratio_problem(prefill_tp, decode_tp)
    if problem:
        raise ValueError(problem)
    if not 0 <= decode_rank < decode_tp:
        raise ValueError(f"decode rank {decode_rank} outside [0, {decode_tp})")
    return decode_rank * prefill_tp // decode_tp


def readers_of(prefill_rank: int, decode_tp: int, prefill_tp: int) -> int:
    """How many decode ranks read prefill rank ``prefill_rank`` (its lease is held until
    every one of them released it)."""
    return max(1, decode_tp // prefill_tp)


def region_rows(block_bytes: Sequence[int], kernel_rows: Sequence[int]) -> list[int]:
    """Kernel rows in each region of a group (``GroupLayout`` regions: one per layer view
    when its kernel rows are adjacent, else one per kernel row)."""
    if len(block_bytes) == len(kernel_rows):
        return [int(k) for k in kernel_rows]
    if len(block_bytes) == sum(int(k) for k in kernel_rows):
        return [1] * len(block_bytes)
    raise ValueError(f"{len(block_bytes)} regions for kernel rows {list(kernel_rows)}")


def head_slices(
    local_bytes: Sequence[int],
    remote_bytes: Sequence[int],
    rows: Sequence[int],
    local_heads: int,
    remote_heads: int,
    part: RankRead,
) -> list[list[tuple[int, int, int]]]:
    """Per region: ``(local offset, remote offset, length)`` spans, one per kernel row,
    that move ``part``'s heads. Raises ``ValueError`` when a region's bytes are not
    ``rows * heads * head_bytes`` on both sides with the same ``head_bytes``."""
    if len(local_bytes) != len(remote_bytes) or len(local_bytes) != len(rows):
        raise ValueError(
            f"{len(local_bytes)} local, {len(remote_bytes)} remote regions, {len(rows)} row counts"
        )
    if local_heads < 1 or remote_heads < 1:
        raise ValueError(f"head counts {local_heads} (local), {remote_heads} (remote)")
    if (
        part.local_head0 + part.num_heads > local_heads
        or part.remote_head0 + part.num_heads > remote_heads
    ):
        raise ValueError(f"{part} outside {local_heads} local / {remote_heads} remote heads")
    out = []
    for i, (lb, rb, k) in enumerate(zip(local_bytes, remote_bytes, rows, strict=True)):
        lb, rb, k = int(lb), int(rb), int(k)
        if k < 1 or lb % (k * local_heads) or rb % (k * remote_heads):
            raise ValueError(
                f"region {i}: {lb} / {rb} bytes do not split into {k} rows of "
                f"{local_heads} / {remote_heads} heads"
            )
        hb = lb // (k * local_heads)
        if rb // (k * remote_heads) != hb:
            raise ValueError(
                f"region {i}: {hb} bytes per head here, {rb // (k * remote_heads)} on the peer"
            )
        lrow, rrow, n = lb // k, rb // k, part.num_heads * hb
        out.append(
            [
                (j * lrow + part.local_head0 * hb, j * rrow + part.remote_head0 * hb, n)
                for j in range(k)
            ]
        )
    return out


# Why Mamba models do not pair across TP sizes by default, although GDN state is re-sliced
# exactly (tests/unit/test_pd_mamba_tp.py; in the real engine the state decode READs equals the
# other size's state re-sliced byte for byte, tests/e2e/test_pd_tp.py): vLLM's CPU GDN kernel
# runs only in bfloat16 (ops/cpu/gdn_attention.py), and a bf16 state computed at another TP
# size differs from this size's own by 1-4% after the first row-parallel reduction, which can
# move a greedy output away from a local recompute. The decode instance's
# kv_connector_extra_config.allow_mamba_cross_tp=true turns it on (HybridPDConnector).
MAMBA_TP_CROSS_SWITCH = "allow_mamba_cross_tp"
MAMBA_TP_NOT_ENABLED = (
    "re-slicing its GDN state between TP sizes is exact but off by default: set "
    f"kv_connector_extra_config.{MAMBA_TP_CROSS_SWITCH}=true on the decode instance to enable it (vLLM's CPU GDN "
    "runs only in bfloat16, where state computed at another TP size is not the bits this size computes, so "
    "the output can differ from a local recompute)"
)


def heterogeneous_tp_problem(
    prefill_tp: int,
    decode_tp: int,
    mamba_group_ids: Sequence[int],
    total_kv_heads: int,
    mamba_problem: str | None = MAMBA_TP_NOT_ENABLED,
) -> str | None:
    """Why a decode instance cannot pair with a prefill instance of another TP size
    (None: it can, or the sizes are equal). ``mamba_problem``: why this instance's
    Mamba state is not re-sliced (default :data:`MAMBA_TP_NOT_ENABLED`; a kind
    :func:`spec_state_splits` refuses); None lets GDN groups pair, the prefill side's
    split then being checked field by field at the handshake."""
    problem = ratio_problem(prefill_tp, decode_tp)
    if problem or prefill_tp == decode_tp:
        return problem
    if mamba_group_ids and mamba_problem:
        return (
            f"prefill runs tensor_parallel_size={prefill_tp} and this decode instance {decode_tp}: hybridkv "
            f"does not re-slice this model's Mamba/linear-attention state (groups {list(mamba_group_ids)}: "
            f"{mamba_problem}); start both with the same --tensor-parallel-size for this model"
        )
    problem = heads_split_problem(total_kv_heads, prefill_tp, decode_tp)
    return (
        None if problem is None else f"{problem}; start both with the same --tensor-parallel-size"
    )


@dataclass(frozen=True)
class StateSplit:
    """One state array of a Mamba page on one rank, as TP splits it.

    The state occupies ``rows * sum(parts) * unit`` bytes from ``offset``: ``rows``
    repetitions (outer dimension, not split) of ``sum(parts)`` elements of ``unit`` bytes,
    element order = part order; part ``j`` holds this rank's ``parts[j]`` elements of a
    dimension of ``parts[j] * tp`` elements cut in equal pieces, rank ``r`` the ``r``-th."""

    offset: int
    rows: int
    unit: int
    parts: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.rows * sum(self.parts) * self.unit

    def to_wire(self) -> tuple[int, ...]:
        return (self.offset, self.rows, self.unit, *self.parts)

    @classmethod
    def from_wire(cls, t: Sequence[int]) -> "StateSplit":
        if len(t) < 4 or any(int(x) < 0 for x in t):
            raise ValueError(
                f"state split {list(t)}: need offset, rows, unit and >= 1 part, all >= 0"
            )
        return cls(int(t[0]), int(t[1]), int(t[2]), tuple(int(x) for x in t[3:]))


GDN_TYPE = "gdn_attn"  # MambaAttentionBackendEnum.GDN_ATTN's value (MambaSpec.mamba_type)


def gdn_state_splits(
    shapes: Sequence[Sequence[int]], dtype_sizes: Sequence[int], conv_dim_first: bool
) -> tuple[StateSplit, ...]:
    """The two states of a GDN layer on one rank, from its ``MambaSpec`` shapes and dtype
    sizes (``gated_delta_net_state_shape``: conv ``(state_len, conv_dim/tp)`` in SD,
    ``(conv_dim/tp, state_len)`` in DS, with ``conv_dim = 2 * key_dim + value_dim``;
    SSM ``(num_v_heads/tp, head_v_dim, head_k_dim)``). ``key_dim`` per rank is recovered
    the way vLLM's NixlConnector does (``derive_mamba_conv_split``): what the conv
    channels hold beyond ``value_dim``, halved. Raises ``ValueError`` when the shapes do
    not decompose so."""
    if len(shapes) != 2 or len(dtype_sizes) != 2:
        raise ValueError(
            f"GDN has 2 states (conv, ssm); the spec has {len(shapes)} shapes, {len(dtype_sizes)} dtypes"
        )
    conv, ssm = [tuple(int(x) for x in s) for s in shapes]
    if len(conv) != 2 or len(ssm) != 3 or min(conv + ssm) < 1 or min(dtype_sizes) < 1:
        raise ValueError(f"GDN state shapes {conv}, {ssm}: expected 2-D conv and 3-D SSM state")
    channels, state_len = conv if conv_dim_first else conv[::-1]
    v_heads, head_v, head_k = ssm
    value_dim = v_heads * head_v
    rest = channels - value_dim
    if rest <= 0 or rest % 2:
        raise ValueError(
            f"GDN conv channels {channels} are not 2 * key_dim + value_dim ({value_dim})"
        )
    key_dim = rest // 2
    if key_dim % head_k:
        raise ValueError(f"GDN key_dim per rank {key_dim} is not a multiple of head_k_dim {head_k}")
    cs, ss = int(dtype_sizes[0]), int(dtype_sizes[1])
    parts = (key_dim, key_dim, value_dim)
    conv_split = (
        StateSplit(0, 1, state_len * cs, parts)
        if conv_dim_first
        else StateSplit(0, state_len, cs, parts)
    )
    return conv_split, StateSplit(conv_split.nbytes, 1, head_v * head_k * ss, (v_heads,))


def spec_state_splits(
    mamba_type: str,
    shapes: Sequence[Sequence[int]],
    dtype_sizes: Sequence[int],
    conv_dim_first: bool,
    tp_replicated: bool = False,
) -> tuple[StateSplit, ...]:
    """A ``MambaSpec``'s states as :class:`StateSplit` s (``mamba_type``: its
    ``mamba_type`` value). Raises ``ValueError`` naming why a kind is not re-sliced."""
    kind = str(mamba_type).rpartition(".")[2].lower()
    if tp_replicated:
        raise ValueError(
            "the state is replicated on every rank (MambaSpec.tp_replicated), not split"
        )
    if kind != GDN_TYPE:
        raise ValueError(
            f"mamba_type {kind!r}: only {GDN_TYPE!r} (gated delta net) state is re-sliced"
        )
    return gdn_state_splits(shapes, dtype_sizes, conv_dim_first)


def state_split_problem(
    local: Sequence[StateSplit],
    remote: Sequence[StateSplit],
    local_tp: int,
    remote_tp: int,
    local_bytes: int | None = None,
    remote_bytes: int | None = None,
) -> str | None:
    """Why these two ranks' state descriptions cannot be re-sliced into each other (None:
    they can). ``*_bytes``: the page (region) size each state must fit in."""
    if not local or not remote:
        return "a side did not describe how its Mamba state is split over ranks (only GDN state is re-sliced)"
    if len(local) != len(remote):
        return f"{len(local)} states here, {len(remote)} on the peer"
    for i, (a, b) in enumerate(zip(local, remote, strict=True)):
        if a.rows != b.rows or a.unit != b.unit or len(a.parts) != len(b.parts):
            return (
                f"state {i}: rows/unit/parts {a.rows}/{a.unit}/{len(a.parts)} here, {b.rows}/{b.unit}/"
                f"{len(b.parts)} on the peer (another conv layout, dtype or model)"
            )
        for j, (x, y) in enumerate(zip(a.parts, b.parts, strict=True)):
            if x < 1 or y < 1 or x * local_tp != y * remote_tp:
                return (
                    f"state {i} part {j}: {x} x TP{local_tp} here, {y} x TP{remote_tp} on the peer "
                    "(not the same dimension split evenly)"
                )
    for side, splits, size in (("local", local, local_bytes), ("peer", remote, remote_bytes)):
        end = 0
        for i, s in enumerate(splits):
            if s.offset < end:
                return f"{side} state {i} at byte {s.offset} overlaps the state before it (ends at {end})"
            end = s.offset + s.nbytes
        if size is not None and end > int(size):
            return f"{side} states end at byte {end}, past the {int(size)}-byte page"
    return None


def mamba_slices(
    local: Sequence[StateSplit],
    remote: Sequence[StateSplit],
    local_tp: int,
    remote_tp: int,
    local_rank: int,
    remote_rank: int,
) -> list[tuple[int, int, int]]:
    """``(local offset, remote offset, length)`` spans of one layer's page that move remote
    rank ``remote_rank``'s share of every state part into local rank ``local_rank``'s
    (empty when the ranks share nothing). Adjacent spans are merged. Raises
    ``ValueError`` when :func:`state_split_problem` names a problem."""
    problem = state_split_problem(local, remote, local_tp, remote_tp)
    if problem:
        raise ValueError(problem)
    if not (0 <= local_rank < local_tp and 0 <= remote_rank < remote_tp):
        raise ValueError(f"ranks {local_rank}/{local_tp} (local), {remote_rank}/{remote_tp} (peer)")
    spans: list[tuple[int, int, int]] = []
    for a, b in zip(local, remote, strict=True):
        lrow, rrow = sum(a.parts) * a.unit, sum(b.parts) * b.unit
        lpre = rpre = 0
        runs = []
        for lp, rp in zip(a.parts, b.parts, strict=True):
            lo, hi = (
                max(local_rank * lp, remote_rank * rp),
                min((local_rank + 1) * lp, (remote_rank + 1) * rp),
            )
            if lo < hi:
                runs.append(
                    (
                        (lpre + lo - local_rank * lp) * a.unit,
                        (rpre + lo - remote_rank * rp) * a.unit,
                        (hi - lo) * a.unit,
                    )
                )
            lpre, rpre = lpre + lp, rpre + rp
        for i in range(a.rows):
            for lo_, ro_, n in runs:
                spans.append((a.offset + i * lrow + lo_, b.offset + i * rrow + ro_, n))
    merged: list[tuple[int, int, int]] = []
    for lo_, ro_, n in spans:
        if merged and merged[-1][0] + merged[-1][2] == lo_ and merged[-1][1] + merged[-1][2] == ro_:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + n)
        else:
            merged.append((lo_, ro_, n))
    return merged


def head_outermost(kv_cache_layout: str | None) -> bool:
    """Whether a head range of one kernel row is one span (``kv_cache_layout``: vLLM's
    resolved layout name, ``KVCacheConfig.kv_cache_layout``; None counts as vLLM's
    default LBHNC)."""
    name = str(kv_cache_layout or "LBHNC").rpartition(".")[2].upper()
    return name in HEAD_OUTERMOST_LAYOUTS


def read_spans(
    part: RankRead,
    local_groups: Sequence[object | None],
    peer_groups: Sequence[object | None],
    local_kernel_rows: Sequence[Sequence[int]],
    remote_block_ids: Sequence[Sequence[int]],
    decode_tp: int,
    prefill_tp: int,
    decode_rank: int,
    mamba_ranks: tuple[int, int] | None = None,
) -> list | None:
    """Per group, the spans one READ from ``part``'s prefill rank moves (None: whole blocks).

    ``local_groups`` / ``peer_groups`` are the two sides' handshake group descriptors
    (``pd_handshake.GroupDescriptor``: ``spec``, ``block_bytes``, ``kv_heads``,
    ``splits()``); ``local_kernel_rows[g]`` this side's kernel rows per layer view.
    Attention groups get head ranges (:func:`head_slices`), Mamba groups the state
    parts (:func:`mamba_slices`; ``mamba_ranks`` overrides (decode rank, prefill rank)
    there, for planted-fault benches), replicated groups (MLA latent) the whole block from
    :func:`latent_rank` and no span from any other prefill rank. The one place the worker
    and the benches build spans, so they cannot drift apart.
    """
    if part.whole:
        return None
    out: list = []
    for gid, (mine, theirs, ids) in enumerate(
        zip(local_groups, peer_groups, remote_block_ids, strict=True)
    ):
        if not ids or mine is None or theirs is None:
            out.append(None)
            continue
        if replicated_on_every_rank(mine.spec):  # type: ignore[attr-defined]
            # the same latent rows on every prefill rank: one rank's whole block, once
            whole = part.prefill_rank == latent_rank(decode_rank, decode_tp, prefill_tp)
            out.append(None if whole else [[] for _ in mine.block_bytes])  # type: ignore[attr-defined]
            continue
        if "Mamba" in mine.spec:  # type: ignore[attr-defined]
            lr, rr = mamba_ranks if mamba_ranks is not None else (decode_rank, part.prefill_rank)
            # every layer view of the group holds the same states (one spec per group)
            spans = mamba_slices(mine.splits(), theirs.splits(), decode_tp, prefill_tp, lr, rr)  # type: ignore[attr-defined]
            out.append([spans] * len(mine.block_bytes))  # type: ignore[attr-defined]
            continue
        out.append(
            head_slices(
                mine.block_bytes,
                theirs.block_bytes,  # type: ignore[attr-defined]
                region_rows(mine.block_bytes, local_kernel_rows[gid]),  # type: ignore[attr-defined]
                mine.kv_heads,
                theirs.kv_heads,
                part,
            )
        )  # type: ignore[attr-defined]
    return out


__all__ = [
    "read_spans",
    "GDN_TYPE",
    "HEAD_OUTERMOST_LAYOUTS",
    "MAMBA_TP_CROSS_SWITCH",
    "MAMBA_TP_NOT_ENABLED",
    "MAX_TP",
    "REPLICATED_SPECS",
    "RankRead",
    "StateSplit",
    "gdn_state_splits",
    "head_outermost",
    "spec_state_splits",
    "head_slices",
    "heads_split_problem",
    "heterogeneous_tp_problem",
    "latent_rank",
    "mamba_slices",
    "rank_reads",
    "ratio_problem",
    "readers_of",
    "region_rows",
    "replicated_on_every_rank",
    "state_split_problem",
]
