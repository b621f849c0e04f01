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

Mamba / linear-attention state (conv and SSM parts, each split by heads in its own
way) is not re-sliced here: such groups need equal TP sizes (refused otherwise, with
the field named, by :func:`heterogeneous_tp_problem` and the handshake).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A layout name in which H (heads) comes before N (tokens/states) and C (content):
# a head range of one kernel row is one contiguous span.
HEAD_OUTERMOST_LAYOUTS = ("LBHNC", "BLHNC")  # vllm.v1.kv_cache_layout.KVCacheLayout names

MAX_TP = 256


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
        return (f"prefill tensor_parallel_size={prefill_tp} and decode {decode_tp}: one must divide the other "
                "(each decode rank's heads must come from whole prefill ranks, or lie inside one)")
    return None


def rank_reads(decode_rank: int, decode_tp: int, prefill_tp: int, total_heads: int) -> list[RankRead]:
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
    if total_heads < 1 or total_heads % prefill_tp or total_heads % decode_tp:
        raise ValueError(
            f"{total_heads} KV heads cannot be split evenly over TP {prefill_tp} and {decode_tp} "
            "(vLLM replicates heads when there are fewer heads than ranks)"
        )
    hd, hp = total_heads // decode_tp, total_heads // prefill_tp
    lo, hi = decode_rank * hd, (decode_rank + 1) * hd
    out = []
    for p in range(prefill_tp):
        a, b = max(lo, p * hp), min(hi, (p + 1) * hp)
        if a < b:
            out.append(RankRead(p, a - lo, a - p * hp, b - a, False))
    return out


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
        raise ValueError(f"{len(local_bytes)} local, {len(remote_bytes)} remote regions, {len(rows)} row counts")
    if local_heads < 1 or remote_heads < 1:
        raise ValueError(f"head counts {local_heads} (local), {remote_heads} (remote)")
    if part.local_head0 + part.num_heads > local_heads or part.remote_head0 + part.num_heads > remote_heads:
        raise ValueError(f"{part} outside {local_heads} local / {remote_heads} remote heads")
    out = []
    for i, (lb, rb, k) in enumerate(zip(local_bytes, remote_bytes, rows, strict=True)):
        lb, rb, k = int(lb), int(rb), int(k)
        if k < 1 or lb % (k * local_heads) or rb % (k * remote_heads):
            raise ValueError(f"region {i}: {lb} / {rb} bytes do not split into {k} rows of "
                             f"{local_heads} / {remote_heads} heads")
        hb = lb // (k * local_heads)
        if rb // (k * remote_heads) != hb:
            raise ValueError(f"region {i}: {hb} bytes per head here, {rb // (k * remote_heads)} on the peer")
        lrow, rrow, n = lb // k, rb // k, part.num_heads * hb
        out.append([(j * lrow + part.local_head0 * hb, j * rrow + part.remote_head0 * hb, n) for j in range(k)])
    return out


def heterogeneous_tp_problem(prefill_tp: int, decode_tp: int, mamba_group_ids: Sequence[int],
                             total_kv_heads: int) -> str | None:
    """Why a decode instance cannot pair with a prefill instance of another TP size
    (None: it can, or the sizes are equal)."""
    problem = ratio_problem(prefill_tp, decode_tp)
    if problem or prefill_tp == decode_tp:
        return problem
    if mamba_group_ids:
        return (f"prefill runs tensor_parallel_size={prefill_tp} and this decode instance {decode_tp}: hybridkv "
                f"re-slices attention heads between TP sizes but not Mamba/linear-attention state (groups "
                f"{list(mamba_group_ids)}); start both with the same --tensor-parallel-size for this model")
    if total_kv_heads < max(prefill_tp, decode_tp) or total_kv_heads % prefill_tp or total_kv_heads % decode_tp:
        return (f"the model's {total_kv_heads} KV heads do not split evenly over prefill TP {prefill_tp} and "
                f"decode TP {decode_tp}; start both with the same --tensor-parallel-size")
    return None


def head_outermost(kv_cache_layout: str | None) -> bool:
    """Whether a head range of one kernel row is one span (``kv_cache_layout``: vLLM's
    resolved layout name, ``KVCacheConfig.kv_cache_layout``; None counts as vLLM's
    default LBHNC)."""
    name = str(kv_cache_layout or "LBHNC").rpartition(".")[2].upper()
    return name in HEAD_OUTERMOST_LAYOUTS


__all__ = [
    "HEAD_OUTERMOST_LAYOUTS",
    "MAX_TP",
    "RankRead",
    "head_outermost",
    "head_slices",
    "heterogeneous_tp_problem",
    "rank_reads",
    "ratio_problem",
    "readers_of",
    "region_rows",
]
