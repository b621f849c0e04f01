"""bench/gpu_pd_tp.py's CPU-checkable parts (hybridkv.cli.harness.pd_tp_model): its expected-bytes
model, its geometry, its planted faults.

The GPU bench (docs/gpu_results.md) calls a hand-over right when the decode allocation equals
``expected_image(expected_groups(...))``: poison everywhere except each decode rank's share of
the prefill ranks' attention heads and GDN conv / SSM state, computed by torch slicing alone. Here,
on CPU KV caches made by the same bench code (vLLM's ``create_kv_cache_views``, the bench's
qwen3-next-like overlay at fewer blocks and layers), hybridkv's own decode plan is applied the way
``PDWorker._read`` builds it (``rank_reads`` -> ``read_spans`` over handshake descriptors made as
``PDWorker.register_kv_caches`` makes them, with ``group_state_splits``) and the rows
``read_descriptors`` returns are copied byte for byte with ``memmove`` (what NIXL's READ does).
The result must equal the bench's model exactly (==) for TP2->TP1 and TP1->TP2, with attention
kernel blocks split (32 tokens) and not (544), so the model and the plan cannot both be wrong
the same way unnoticed; and the bench's two planted faults (prefill ranks' shares swapped; SSM
span one v head off) must make it differ, in the bytes they touch.
"""

from __future__ import annotations

import ctypes
import types

import pytest
import torch

from hybridkv.cli.harness import kv_views
from hybridkv.cli.harness import pd_tp_model as model
from hybridkv.connector.block_layout import layout_rows
from hybridkv.connector.pd_handshake import LayoutDescriptor
from hybridkv.connector.pd_tp import rank_reads, read_spans
from hybridkv.connector.pd_transport import read_descriptors
from hybridkv.connector.pd_worker import group_state_splits, mamba_reslice_problem

NUM_BLOCKS, LAYERS = 8, 1
CPU = torch.device("cpu")


class Rank:
    """One rank's cache (bench code) and its handshake descriptor (as PDWorker makes it)."""

    def __init__(self, tp: int, kernel: int, seed: int | None) -> None:
        self.tp = tp
        self.cache = kv_views.make_cache(
            model.scenario(tp, NUM_BLOCKS, layers=LAYERS, kernel=kernel), CPU
        )
        if seed is not None:
            kv_views.fill_random(self.cache, seed)
        kvc = self.cache.kvc
        heads = [
            int(getattr(gr.kv_cache_spec, "num_kv_heads", 0) or 0) for gr in kvc.kv_cache_groups
        ]
        self.desc = LayoutDescriptor.from_kv(
            self.cache.layout,
            layout_rows(kvc),
            tp,
            kv_heads=heads,
            total_kv_heads=model.TOTAL_KV_HEADS,
            state_splits=[group_state_splits(gr) for gr in kvc.kv_cache_groups],
        )


def _apply(dec: Rank, pre: list[Rank], rank: int, src, dst, plan=None, slices=None) -> None:  # noqa: ANN001
    """hybridkv's plan for decode rank ``rank``, rows copied with memmove (CPU stand-in for NIXL READ)."""
    dtp, ptp = dec.tp, len(pre)
    plan = plan or rank_reads(rank, dtp, ptp, model.TOTAL_KV_HEADS)
    rows = [() if gl is None else gl.kernel_rows for gl in dec.cache.layout.groups]
    for part in plan:
        p = pre[part.prefill_rank]
        sl = read_spans(part, dec.desc.groups, p.desc.groups, rows, src, dtp, ptp, rank)
        if slices is not None:
            sl = slices(part, sl)
        loc, rem = read_descriptors(
            dec.cache.layout.groups, p.cache.layout.groups, src, dst, slices=sl
        )
        for (la, n, _), (ra, _, _) in zip(loc.tolist(), rem.tolist(), strict=True):
            ctypes.memmove(la, ra, n)


def _setup(ptp: int, dtp: int, kernel: int):
    pre = [Rank(ptp, kernel, 1000 * ptp + r) for r in range(ptp)]
    decs = [Rank(dtp, kernel, None) for _ in range(dtp)]
    src, dst = model.pick(pre[0].cache.kvc, 3, __import__("random").Random(3))
    return pre, decs, src, dst


def _model(dec: Rank, pre: list[Rank], rank: int, src, dst):  # noqa: ANN001
    ref = model.expected_groups(
        dec.cache.kvc, [p.cache.views for p in pre], rank, dec.tp, len(pre), src
    )
    return model.expected_image(dec.cache, ref, dst), ref


CASES = [(2, 1), (1, 2)]


@pytest.mark.parametrize("kernel", [model.KERNEL, model.BLOCK])
@pytest.mark.parametrize("ptp,dtp", CASES)
def test_model_equals_hybridkv_plan(ptp: int, dtp: int, kernel: int) -> None:
    pre, decs, src, dst = _setup(ptp, dtp, kernel)
    for rank, dec in enumerate(decs):
        exp, ref = _model(dec, pre, rank, src, dst)
        kv_views.poison(dec.cache)
        _apply(dec, pre, rank, src, dst)
        assert torch.equal(dec.cache.buf, exp), int((dec.cache.buf != exp).sum())
        # what the model writes: every attention head byte of the blocks and the GDN state, no padding
        written = sum(r.numel() * r.element_size() for gr in ref for r in gr)
        page_fa = dec.cache.kvc.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        (rows, ch), (vh, hv, hk) = model.gdn_shapes(dec.tp)
        state = 2 * (rows * ch + vh * hv * hk)
        assert written == LAYERS * (len(src[0]) * page_fa + model.GDN_GROUPS * state)


@pytest.mark.parametrize("ptp,dtp", CASES)
def test_planted_faults_differ_from_model(ptp: int, dtp: int) -> None:
    """The bench's planted faults (its own functions) make the bytes differ from the model:
    swap -> attention and GDN wrong; ssm -> only SSM state bytes wrong."""
    pre, decs, src, dst = _setup(ptp, dtp, model.KERNEL)
    for rank, dec in enumerate(decs):
        exp, _ = _model(dec, pre, rank, src, dst)
        worker = types.SimpleNamespace(
            _s=types.SimpleNamespace(
                tp_size=dtp, tp_rank=rank, total_kv_heads=model.TOTAL_KV_HEADS
            ),
            _local=dec.desc,
        )
        swapped = model.swapped_plan(
            worker, lambda job: rank_reads(rank, dtp, ptp, model.TOTAL_KV_HEADS)
        )
        job = types.SimpleNamespace(remote_ports=[0] * ptp)
        kv_views.poison(dec.cache)
        _apply(dec, pre, rank, src, dst, plan=swapped(job))
        assert not torch.equal(dec.cache.buf, exp)

        ssm = model.ssm_off_by_one(worker, lambda part, pl, j: j)  # mutates the spans it is given
        kv_views.poison(dec.cache)
        _apply(dec, pre, rank, src, dst, slices=lambda part, sl: ssm(part, None, sl))
        wrong = torch.nonzero(dec.cache.buf != exp).flatten()
        assert len(wrong) > 0
        # every wrong byte lies in an SSM state of a destination GDN page
        kvc = dec.cache.kvc
        page = kvc.kv_cache_tensors[0].block_stride
        _, conv_bytes, head = model.part_bytes(dec.tp)
        ssm_bytes = model.GDN_V_HEADS // dec.tp * head
        gdn_dst = {b for ids in dst[1:] for b in ids}
        off = wrong % (page * NUM_BLOCKS)
        blocks, in_page = off // page, off % page
        assert set(blocks.tolist()) <= gdn_dst
        assert int(in_page.min()) >= conv_bytes and int(in_page.max()) < conv_bytes + ssm_bytes


def test_geometry_is_vllms() -> None:
    """The bench's GDN shapes are vLLM's gated_delta_net_state_shape; its KV cache config is
    get_kv_cache_config_from_groups' and its views allocate_kv_cache's; the GDN groups are
    re-sliceable (mamba_reslice_problem None) with the conv in SD order (dim last)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    for tp in (1, 2):
        want = MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp,
            model.GDN_K_HEADS,
            model.GDN_V_HEADS,
            model.GDN_HEAD_K,
            model.GDN_HEAD_V,
            model.GDN_KERNEL,
        )
        assert tuple(map(tuple, want)) == model.gdn_shapes(tp)
        r = Rank(tp, model.KERNEL, None)
        assert mamba_reslice_problem(r.cache.kvc) is None
        conv, ssm = r.desc.groups[1].splits()
        assert (conv.offset, conv.rows, conv.unit) == (0, model.GDN_KERNEL - 1, 2)
        assert ssm.offset == conv.nbytes and ssm.parts == (model.GDN_V_HEADS // tp,)
    assert (
        kv_views.check_vllm(
            {
                f"TP{tp} k{k}": model.scenario(tp, kernel=k)
                for tp in (1, 2)
                for k in (model.KERNEL, model.BLOCK)
            }
        )
        == 0
    )
