"""P/D across tensor-parallel sizes: the rank plan, the head spans, and the bytes they move.

KV caches are built by vLLM's own ``allocate_kv_cache`` (LBHNC, as the CPU backend
resolves it): a TP1 cache with 4 KV heads per layer, and the two TP2 ranks' caches with 2
heads each, filled with the head halves of the TP1 cache (what vLLM's head split gives
each rank). The spans of ``pd_tp`` go through ``pd_transport.read_descriptors`` (the
same rows a NIXL READ gets) and are applied with ``memmove``; the decode side's blocks
must then equal the expected heads exactly and every other byte stay poison. The NIXL
READ itself is exercised end to end in tests/e2e/test_pd_tp.py.

Planted faults (each must fail the byte check): the two prefill ranks swapped, a span one
head off, and whole-block copying (no slicing) across TP sizes.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.worker.utils import allocate_kv_cache

from hybridkv.connector.block_layout import KVLayout, layout_rows
from hybridkv.connector.pd_auth import DeploymentKey
from hybridkv.connector.pd_handshake import GroupDescriptor, LayoutDescriptor, find_mismatches
from hybridkv.connector.pd_params import (
    LocalLayout,
    PromptView,
    Refused,
    RemotePrefill,
    issue_remote_prefill,
    parse_kv_transfer_params,
)
from hybridkv.connector.pd_tp import (
    RankRead,
    head_slices,
    heterogeneous_tp_problem,
    latent_rank,
    rank_reads,
    read_spans,
    readers_of,
    region_rows,
)
from hybridkv.connector.pd_transport import read_descriptors
from hybridkv.connector.pd_worker import group_head_slots
from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups

TOTAL_HEADS = 4
POISON = 0xA5


def _groups(heads: int, **packing: object) -> list[KVCacheGroupSpec]:
    """``packing``: vLLM 0.34's page packing fields of both specs (none: one slot per head)."""
    return [
        KVCacheGroupSpec(
            ["sw.0", "sw.1"],
            SlidingWindowSpec(
                block_size=32,
                num_kv_heads=heads,
                head_size=64,
                dtype=torch.bfloat16,
                sliding_window=64,
                **packing,
            ),
        ),
        KVCacheGroupSpec(
            ["fa.0", "fa.1"],
            FullAttentionSpec(
                block_size=32, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16, **packing
            ),
        ),
    ]


class Cache:
    """One rank's KV cache (``heads`` KV heads per layer, 16 blocks; ``packing``: see
    :func:`_groups`, a function of ``heads``)."""

    def __init__(self, heads: int, packing=None) -> None:  # noqa: ANN001
        cfg = VllmConfig()
        cfg.cache_config.kv_cache_layout = "LBHNC"
        page = 32 * heads * 128 * 2
        self.heads = heads
        groups = _groups(heads, **(packing(heads) if packing else {}))
        assert all(g.kv_cache_spec.page_size_bytes == page for g in groups)
        self.config = get_kv_cache_config_from_groups(cfg, groups, 16 * page * 2)
        self.caches = allocate_kv_cache(
            self.config, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout()
        )
        self.layout = KVLayout.from_kv_caches(self.config, self.caches)
        first = next(iter(self.caches.values()))
        self.raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
        self.raw.fill_(POISON)

    def descriptor(self, tp: int) -> LayoutDescriptor:
        return LayoutDescriptor.from_kv(
            self.layout,
            layout_rows(self.config),
            tp,
            kv_heads=[self.heads] * 2,
            total_kv_heads=TOTAL_HEADS,
            head_slots=[group_head_slots(g) for g in self.config.kv_cache_groups],
        )


@pytest.fixture(scope="module")
def caches():
    """(TP1 cache with random KV, [rank 0, rank 1] of TP2 holding its head halves)."""
    full = Cache(TOTAL_HEADS)
    gen = torch.Generator().manual_seed(7)
    full.raw.copy_(torch.randint(0, 256, (full.raw.numel(),), dtype=torch.uint8, generator=gen))
    ranks = [Cache(TOTAL_HEADS // 2) for _ in range(2)]
    for p, rank in enumerate(ranks):
        for name, t in rank.caches.items():
            t.view(torch.int16).copy_(full.caches[name][:, 2 * p : 2 * p + 2].view(torch.int16))
    return full, ranks


def _apply(local: Cache, remote: Cache, remote_ids, local_ids, slices) -> None:
    """What a NIXL READ of these descriptor rows does, done with memmove in this process."""
    l_rows, r_rows = read_descriptors(
        local.layout.groups, remote.layout.groups, remote_ids, local_ids, slices=slices
    )
    for (la, n, _), (ra, n2, _) in zip(l_rows.tolist(), r_rows.tolist(), strict=True):
        assert n == n2
        ctypes.memmove(int(la), int(ra), int(n))


def _spans(local: Cache, remote: Cache, part: RankRead):
    out = []
    for lg, rg in zip(local.layout.groups, remote.layout.groups, strict=True):
        out.append(
            head_slices(
                lg.block_bytes,
                rg.block_bytes,
                region_rows(lg.block_bytes, lg.kernel_rows),
                local.heads,
                remote.heads,
                part,
            )
        )
    return out


REMOTE_IDS = [[3, 5], [4, 9, 11]]
LOCAL_IDS = [[12, 1], [7, 2, 14]]


def _expected_ok(local: Cache, source, heads_of) -> bool:  # noqa: ANN001
    """Every moved block of every layer holds the expected heads; every other byte is poison."""
    # (groups overlay one allocation: block b of every group is the same memory, vLLM's
    # block pool hands a block id to one group at a time)
    written = torch.zeros(local.config.num_blocks, dtype=torch.bool)
    for gid, group in enumerate(local.config.kv_cache_groups):
        for name in group.layer_names:
            t = local.caches[name]
            for r, l_ in zip(REMOTE_IDS[gid], LOCAL_IDS[gid], strict=True):
                # compared as raw 16-bit words: random bytes read as bf16 hold NaNs (NaN != NaN)
                if not torch.equal(t[l_].view(torch.int16), heads_of(name, r).view(torch.int16)):
                    return False
                written[l_] = True
    for name, t in local.caches.items():
        untouched = t[~written].contiguous().view(torch.uint8)
        if not bool((untouched == POISON).all()):
            return False
    return True


def _p2_to_d1(
    full: Cache, ranks: list[Cache], plan: list[RankRead], sources: list[Cache], slicing=True
) -> bool:
    decode = Cache(TOTAL_HEADS)
    for part, src in zip(plan, sources, strict=True):
        _apply(decode, src, REMOTE_IDS, LOCAL_IDS, _spans(decode, src, part) if slicing else None)
    return _expected_ok(decode, full, lambda name, r: full.caches[name][r])


def test_rank_plans_are_exact():
    assert rank_reads(0, 2, 2, 4) == [RankRead(0, 0, 0, 2, True)]
    assert rank_reads(1, 2, 2, 4) == [RankRead(1, 0, 0, 2, True)]
    assert rank_reads(0, 1, 2, 4) == [RankRead(0, 0, 0, 2, False), RankRead(1, 2, 0, 2, False)]
    assert rank_reads(0, 2, 1, 4) == [RankRead(0, 0, 0, 2, False)]
    assert rank_reads(1, 2, 1, 4) == [RankRead(0, 0, 2, 2, False)]
    assert rank_reads(1, 2, 4, 8) == [RankRead(2, 0, 0, 2, False), RankRead(3, 2, 0, 2, False)]
    assert rank_reads(3, 4, 2, 8) == [RankRead(1, 0, 2, 2, False)]
    assert [readers_of(0, 2, 1), readers_of(0, 1, 2), readers_of(1, 4, 2)] == [2, 1, 2]
    with pytest.raises(ValueError, match="one must divide the other"):
        rank_reads(0, 2, 3, 6)
    with pytest.raises(ValueError, match="replicates heads"):
        rank_reads(0, 1, 2, 1)


def test_prefill_tp2_to_decode_tp1_assembles_every_head_exactly(caches):
    full, ranks = caches
    plan = rank_reads(0, 1, 2, TOTAL_HEADS)
    assert _p2_to_d1(full, ranks, plan, ranks)
    # planted faults: ranks swapped; a span one head off; whole blocks copied across sizes
    assert not _p2_to_d1(full, ranks, plan, ranks[::-1])
    shifted = [plan[0], replace(plan[1], local_head0=1)]
    assert not _p2_to_d1(full, ranks, shifted, ranks)
    with pytest.raises(ValueError, match="per-layer block bytes differ"):
        _p2_to_d1(full, ranks, plan, ranks, slicing=False)


@pytest.mark.parametrize("rank", [0, 1])
def test_prefill_tp1_to_decode_tp2_takes_this_ranks_half(caches, rank):
    full, ranks = caches
    (part,) = rank_reads(rank, 2, 1, TOTAL_HEADS)
    decode = Cache(TOTAL_HEADS // 2)
    _apply(decode, full, REMOTE_IDS, LOCAL_IDS, _spans(decode, full, part))
    assert _expected_ok(decode, full, lambda name, r: full.caches[name][r, 2 * rank : 2 * rank + 2])
    wrong = Cache(TOTAL_HEADS // 2)  # planted: the other rank's half
    _apply(
        wrong,
        full,
        REMOTE_IDS,
        LOCAL_IDS,
        _spans(wrong, full, replace(part, remote_head0=2 - 2 * rank)),
    )
    assert not _expected_ok(
        wrong, full, lambda name, r: full.caches[name][r, 2 * rank : 2 * rank + 2]
    )


def test_handshake_accepts_attention_across_sizes_and_names_what_it_refuses(caches):
    full, ranks = caches
    assert find_mismatches(ranks[0].descriptor(2), full.descriptor(1)) == []
    assert find_mismatches(full.descriptor(1), ranks[1].descriptor(2)) == []
    lbnhc = ranks[0].descriptor(2)
    lbnhc = replace(lbnhc, groups=tuple(replace(g, kv_cache_layout="LBNHC") for g in lbnhc.groups))
    problems = [str(m) for m in find_mismatches(lbnhc, full.descriptor(1))]
    assert problems and all("kv_cache_layout" in p and "LBHNC" in p for p in problems), problems
    replicated = replace(full.descriptor(1), total_kv_heads=1)
    assert any(
        "total_kv_heads" in str(m) for m in find_mismatches(ranks[0].descriptor(2), replicated)
    )
    odd = [
        str(m)
        for m in find_mismatches(replace(ranks[0].descriptor(2), tp_size=3), full.descriptor(2))
    ]
    assert odd == [
        "prefill tp_size=3 but decode has 2: prefill tensor_parallel_size=3 and decode 2: one must "
        "divide the other (each decode rank's heads must come from whole prefill ranks, or lie inside "
        "one)"
    ]


def test_heterogeneous_problem_names_mamba_groups():
    assert heterogeneous_tp_problem(2, 2, (0,), 2) is None
    assert heterogeneous_tp_problem(2, 1, (), 4) is None
    assert (
        heterogeneous_tp_problem(2, 1, (0,), 4, None) is None
    )  # GDN state, enabled: checked at the handshake
    msg = heterogeneous_tp_problem(2, 1, (0,), 4)  # the default: not enabled, and why
    assert (
        msg
        and "(groups [0]: re-slicing its GDN state between TP sizes is exact but off by default"
        in msg
    )
    assert (
        "kv_connector_extra_config.allow_mamba_cross_tp=true on the decode instance" in msg
    )  # the switch
    assert "runs only in bfloat16" in msg and "--tensor-parallel-size" in msg
    msg = heterogeneous_tp_problem(
        2, 1, (0,), 4, "mamba_type 'mamba2': only 'gdn_attn' state is re-sliced"
    )
    assert (
        msg
        and "does not re-slice this model's Mamba/linear-attention state (groups [0]: mamba_type 'mamba2'"
        in msg
    )
    assert "--tensor-parallel-size" in msg
    assert heterogeneous_tp_problem(2, 2, (0,), 2, "not GDN") is None  # equal sizes copy whole
    assert "do not split evenly" in heterogeneous_tp_problem(4, 1, (), 2)


def test_latent_rank_is_the_one_rank_each_decode_rank_reads_the_mla_latent_from():
    """Every pair of TP sizes one divides: of the prefill ranks a decode rank reads
    (rank_reads), read_spans moves an MLA latent group whole from exactly one, latent_rank,
    and nothing of it from the others. Planted: ``decode_rank % prefill_tp`` (one plausible
    choice) names, for decode rank 1 of TP2 reading TP4, rank 1, which that decode rank
    never reads (its plan is ranks 2 and 3): its latent would stay unread."""
    mla = GroupDescriptor(
        0, "MLAAttentionSpec", 64, "torch.bfloat16", None, (64 * 1152,), kv_heads=1
    )
    for ptp, dtp in [
        (p, d) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8) if p % d == 0 or d % p == 0
    ]:
        for r in range(dtp):
            plan = rank_reads(r, dtp, ptp, 8)
            lr = latent_rank(r, dtp, ptp)
            whole = []
            for part in plan:
                spans = read_spans(part, [mla], [mla], [(1,)], [[3]], dtp, ptp, r)
                whole.append(spans is None or spans[0] is None)
                assert whole[-1] or spans == [[[]]], (ptp, dtp, r, spans)
            assert whole == [part.prefill_rank == lr for part in plan], (ptp, dtp, r)
    assert [latent_rank(r, 2, 4) for r in range(2)] == [0, 2]
    assert [latent_rank(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]
    assert 1 % 4 not in [part.prefill_rank for part in rank_reads(1, 2, 4, 8)]


needs_head_major_slots = pytest.mark.skipif(
    "kv_head_major_slots" not in getattr(FullAttentionSpec, "__dataclass_fields__", {}),
    reason="attention specs carry kv_head_major_slots from vLLM 0.34 on: this vLLM builds no "
    "head-major page (the 0.34 pass runs this test)",
)


def _head_major(heads: int) -> dict:
    """Each KV head's K and V as two adjacent slots (vLLM's H2ND, kv_head_major_slots), as
    MiniMax-M3's sparse backend customises its spec (bf16 content here)."""
    return {"num_head_slots": 2 * heads, "state_content_bytes": 64 * 2, "kv_head_major_slots": True}


def _slot_major(heads: int) -> dict:
    """Two slots (K, V) each holding every head's content, not grouped by head."""
    return {"num_head_slots": 2, "state_content_bytes": heads * 64 * 2}


def _split(packing, slot_of_heads) -> tuple[Cache, list[Cache]]:  # noqa: ANN001
    """A TP1 cache with random bytes and the two TP2 ranks vLLM's split gives it:
    ``slot_of_heads(t, p)`` is rank ``p``'s part of TP1 view ``t`` (``[B, slots, N, C]``)."""
    full = Cache(TOTAL_HEADS, packing)
    gen = torch.Generator().manual_seed(8)
    full.raw.copy_(torch.randint(0, 256, (full.raw.numel(),), dtype=torch.uint8, generator=gen))
    ranks = [Cache(TOTAL_HEADS // 2, packing) for _ in range(2)]
    for p, rank in enumerate(ranks):
        for name, t in rank.caches.items():
            t.view(torch.int16).copy_(slot_of_heads(full.caches[name].view(torch.int16), p))
    return full, ranks


@needs_head_major_slots
def test_head_major_slots_pair_across_tp_sizes_and_slice_exactly():
    """vLLM 0.34 pages whose slots are grouped by KV head (kv_head_major_slots: head h's K
    and V slots side by side) keep every head one run, so head slicing serves them: the
    handshake pairs TP2 with TP1 and the decode blocks equal the TP1 blocks exactly."""
    full, ranks = _split(_head_major, lambda t, p: t[:, 4 * p : 4 * p + 4])
    assert [g.kv_head_major_slots for g in full.descriptor(1).groups] == [True, True]
    assert find_mismatches(ranks[0].descriptor(2), full.descriptor(1)) == []
    decode = Cache(TOTAL_HEADS, _head_major)
    for part in rank_reads(0, 1, 2, TOTAL_HEADS):
        src = ranks[part.prefill_rank]
        _apply(decode, src, REMOTE_IDS, LOCAL_IDS, _spans(decode, src, part))
    assert _expected_ok(decode, full, lambda name, r: full.caches[name][r])


def test_slots_not_grouped_by_head_are_refused_across_tp_sizes_naming_the_field():
    """Two slots (K, V) each holding every head's content (``num_head_slots``, in vLLM
    0.32 to 0.34): a head's bytes are not one run. The handshake refuses TP2 -> TP1 naming num_head_slots and the fix (equal TP sizes still
    pair: whole blocks); ignoring the refusal, head slicing moves other heads' bytes."""
    n = 64  # int16 words of one head's content in a slot
    full, ranks = _split(_slot_major, lambda t, p: t[..., 2 * n * p : 2 * n * p + 2 * n])
    problems = find_mismatches(ranks[0].descriptor(2), full.descriptor(1))
    fix = (
        "the prefill side's attention backend packs 2 slots per page for 2 KV heads without "
        "grouping them by head (kv_head_major_slots false), so a head's bytes are not one run "
        "that head slicing can cut; start both instances with the same --tensor-parallel-size, "
        "or a backend whose slots are grouped by KV head"
    )
    assert [(m.field, m.prefill, m.decode, m.fix) for m in problems] == [
        (f"group {g} num_head_slots", 2, 2, fix) for g in range(2)
    ]
    assert find_mismatches(ranks[0].descriptor(2), ranks[1].descriptor(2)) == []
    decode = Cache(TOTAL_HEADS, _slot_major)
    for part in rank_reads(0, 1, 2, TOTAL_HEADS):
        src = ranks[part.prefill_rank]
        _apply(decode, src, REMOTE_IDS, LOCAL_IDS, _spans(decode, src, part))
    assert not _expected_ok(decode, full, lambda name, r: full.caches[name][r])


# ------------------------------------------------------------------- remote_ports in kv_transfer_params

KEY = DeploymentKey(b"k" * 32)
HASHES = [bytes([i]) * 32 for i in range(4)]


def _params(ports: tuple[int, ...]) -> dict:
    p = RemotePrefill(
        engine_id="p",
        request_id="r",
        host="127.0.0.1",
        port=ports[0],
        block_ids=((1, 2), (3, 4)),
        num_tokens=64,
        lease_id="a" * 32,
        ports=ports,
    )
    return issue_remote_prefill(p, KEY, HASHES, 32)


def _parse(raw: dict, tp: int = 1, mamba: tuple[int, ...] = (), **kw):
    local = LocalLayout(
        True, True, (32, 32), 100, 32, tp_size=tp, mamba_group_ids=mamba, total_kv_heads=4, **kw
    )
    return parse_kv_transfer_params(raw, PromptView(100, HASHES), local, KEY)


def test_remote_ports_are_signed_and_validated():
    raw = _params((4000, 4001))
    assert raw["remote_ports"] == [4000, 4001]
    got = _parse(raw, tp=2)
    assert isinstance(got, RemotePrefill) and got.rank_ports == (4000, 4001)
    assert isinstance(_parse(raw, tp=1), RemotePrefill)  # attention only: TP2 -> TP1 re-slices
    refused = _parse(raw, tp=1, mamba=(0,))
    assert isinstance(refused, Refused) and refused.field == "remote_ports"
    assert "lists 2 prefill ranks" in str(
        refused
    ) and "does not re-slice this model's Mamba" in str(refused)
    assert "exact but off by default" in str(refused) and "allow_mamba_cross_tp=true" in str(
        refused
    )  # default
    assert isinstance(
        _parse(raw, tp=1, mamba=(0,), mamba_problem=None), RemotePrefill
    )  # GDN: re-sliced
    for bad, what in (
        ([4000, True], "not a TCP port"),
        ([4000, 70000], "not a TCP port"),
        ("4000", "not a list"),
        ([4001, 4000], "rank 0's port"),
        ([], "not a list"),
    ):
        r = _parse({**raw, "remote_ports": bad}, tp=2)
        assert isinstance(r, Refused) and r.field == "remote_ports" and what in str(r), (bad, r)
    swapped = {**raw, "remote_ports": [4000, 4002]}  # another rank's port: the MAC covers the list
    r = _parse(swapped, tp=2)
    assert isinstance(r, Refused) and r.field == "remote_mac"
    one = _params((4000,))
    assert isinstance(_parse({k: v for k, v in one.items() if k != "remote_ports"}), RemotePrefill)
    r = _parse({k: v for k, v in one.items() if k != "remote_ports"}, tp=2, mamba=(0,))
    assert isinstance(r, Refused) and r.field == "remote_ports"
