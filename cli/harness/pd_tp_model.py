"""What a P/D hand-over across TP sizes must write, for a qwen3-next-like geometry (full attention
+ GDN state), computed by torch slicing alone, independently of hybridkv's read plan; and two
planted faults of that plan. bench/gpu_pd_tp.py checks hybridkv's READs on a GPU against it,
tests/unit/test_gpu_pd_tp_plan.py checks the plan on CPU against it.

Geometry: qwen3-next-80B-A3B's per-layer shapes, fewer layers (bench/gpu_pd_tp.py's docstring).
"""

from __future__ import annotations

import random

from hybridkv.cli.harness.kv_views import POISON, allocate

# qwen3-next-80B-A3B (config.json): attention and GDN geometry, all ranks together
TOTAL_KV_HEADS, HEAD_DIM = 2, 256
GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD_K, GDN_HEAD_V, GDN_KERNEL = 16, 32, 128, 128, 4
ATTN_LAYERS, GDN_GROUPS = 4, 3  # 4 attention + 12 GDN layers, groups of 4 layers
BLOCK, KERNEL = 544, 32
NUM_BLOCKS = 80
SIZES = (4, 16, 64)


def gdn_shapes(tp: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One rank's GDN state shapes as vLLM 0.33's ``gated_delta_net_state_shape`` gives them with
    the default ``SD`` conv layout (checked equal on CPU): conv ``(kernel - 1, conv_dim / tp)``,
    SSM ``(v_heads / tp, head_v, head_k)``."""
    conv_dim = 2 * GDN_K_HEADS * GDN_HEAD_K + GDN_V_HEADS * GDN_HEAD_V
    assert conv_dim % tp == 0 and GDN_V_HEADS % tp == 0
    return (GDN_KERNEL - 1, conv_dim // tp), (GDN_V_HEADS // tp, GDN_HEAD_V, GDN_HEAD_K)


def scenario(
    tp: int, num_blocks: int = NUM_BLOCKS, layers: int = ATTN_LAYERS, kernel: int = KERNEL
) -> dict:
    """A gpu_data_path-style scenario for one rank at TP ``tp`` (LBHNC, layer-outer overlay);
    ``kernel``: attention kernel block tokens (``BLOCK``: no splitting, what FlashAttention's
    any-multiple-of-16 sizes give)."""
    import torch

    groups = [
        dict(
            kind="fa",
            layers=layers,
            block=BLOCK,
            kernel=kernel,
            heads=TOTAL_KV_HEADS // tp,
            head=HEAD_DIM,
        )
    ]
    groups += [
        dict(
            kind="mamba",
            layers=layers,
            block=BLOCK,
            shapes=gdn_shapes(tp),
            mamba_type="GDN_ATTN",
            dtypes=(torch.bfloat16, torch.bfloat16),
        )
        for _ in range(GDN_GROUPS)
    ]
    return dict(layout="LBHNC", num_blocks=num_blocks, batches=SIZES, groups=groups)


def part_bytes(tp: int) -> tuple[list[int], int, int]:
    """Per rank: conv channel-part widths in bytes (q, k, v), conv bytes, SSM bytes per v head."""
    (rows, ch), (vh, hv, hk) = gdn_shapes(tp)
    key = GDN_K_HEADS * GDN_HEAD_K // tp
    widths = [key * 2, key * 2, (ch - 2 * key) * 2]
    return widths, rows * ch * 2, hv * hk * 2


def share_of(parts: list, rank: int, tp: int, dim: int):
    """Rank ``rank``'s ``1/tp`` piece of the concatenation of ``parts`` along ``dim`` (torch)."""
    import torch

    whole = torch.cat(parts, dim=dim)
    n = whole.shape[dim] // tp
    return whole.narrow(dim, rank * n, n)


def manager_blocks(view, num_blocks: int):
    """vLLM's ``group_kernel_blocks`` view, with a kernel-row dim of 1 where the view is not split
    (attention: ``[blocks, kernel rows, H, N, C]`` either way, heads at dim 2)."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    v = group_kernel_blocks(view, num_blocks)
    return v.unsqueeze(1) if view.shape[0] == num_blocks else v


def expected_groups(
    kvc,
    prefill_views: list[dict],
    decode_rank: int,
    decode_tp: int,
    prefill_tp: int,
    src: list[list[int]],
) -> list[list]:
    """Per group, per layer: the bytes decode rank ``decode_rank`` must hold for source blocks
    ``src`` (uint8 / int16 tensors, [n, ...]), from the prefill ranks' vLLM views, by torch
    slicing alone: attention = cat of the ranks' KV heads, this rank's heads; GDN = per conv
    channel part (q | k | v) and for the SSM v heads, cat of the ranks' pieces, this rank's piece,
    conv then SSM from byte 0 of the page (vLLM's ``MambaBase.bind_kv_cache`` order), the rest
    of the page left as it is (padding)."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    out = []
    pw, pconv, phead = part_bytes(prefill_tp)
    for g, ids in zip(kvc.kv_cache_groups, src):
        layers = []
        if not ids:
            out.append(layers)
            continue
        idx = torch.tensor(
            ids, dtype=torch.long, device=next(iter(prefill_views[0].values())).device
        )
        for n in g.layer_names:
            blocks = [
                manager_blocks(v[n], kvc.num_blocks).index_select(0, idx) for v in prefill_views
            ]
            if isinstance(g.kv_cache_spec, MambaSpec):
                pages = [b.reshape(len(ids), -1).view(torch.uint8) for b in blocks]
                rows = GDN_KERNEL - 1
                convs = [p[:, :pconv].reshape(len(ids), rows, -1) for p in pages]
                conv_parts, off = [], 0
                for w in pw:  # each q | k | v part is split over the ranks on its own
                    conv_parts.append(
                        share_of([c[:, :, off : off + w] for c in convs], decode_rank, decode_tp, 2)
                    )
                    off += w
                ssm = share_of(
                    [
                        p[:, pconv : pconv + GDN_V_HEADS // prefill_tp * phead].reshape(
                            len(ids), -1, phead
                        )
                        for p in pages
                    ],
                    decode_rank,
                    decode_tp,
                    1,
                )
                layers.append(
                    torch.cat(
                        [torch.cat(conv_parts, 2).reshape(len(ids), -1), ssm.reshape(len(ids), -1)],
                        1,
                    )
                )
            else:  # [n, kernel rows, H, N, C]: heads are dim 2
                layers.append(
                    share_of([b.view(torch.int16) for b in blocks], decode_rank, decode_tp, 2)
                )
        out.append(layers)
    return out


def expected_image(cache, ref: list[list], dst: list[list[int]]):
    """The decode allocation as it must be: poison, with ``ref`` written at ``dst`` through vLLM's
    own views of a second buffer (GDN: from byte 0 of each page; padding stays poison)."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    exp = torch.full_like(cache.buf, POISON - 256)
    _, views = allocate(cache.kvc, cache.buf.device, cache.vllm_layout, cache.kernels, buf=exp)
    for g, refs, ids in zip(cache.kvc.kv_cache_groups, ref, dst):
        if not ids:
            continue
        idx = torch.tensor(ids, dtype=torch.long, device=cache.buf.device)
        for n, r in zip(g.layer_names, refs):
            v = manager_blocks(views[n], cache.kvc.num_blocks)
            if isinstance(g.kv_cache_spec, MambaSpec):
                flat = v.reshape(v.shape[0], -1).view(torch.uint8)
                assert flat.data_ptr() == v.data_ptr() and flat.stride(0) == v.stride(
                    0
                )  # a view, not a copy
                flat[:, : r.shape[1]].index_copy_(0, idx, r)
            else:
                v.view(torch.int16).index_copy_(0, idx, r)
    return exp


def pick(kvc, n: int, rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """One hand-over: n attention blocks + 1 block per GDN group (a request's state), ids
    distinct across groups (one block pool: the groups overlay the same pages); src on the
    prefill side, dst on the decode side."""
    k = len(kvc.kv_cache_groups)
    counts = [n] + [1] * (k - 1)

    def one():
        ids = rng.sample(range(1, kvc.num_blocks), sum(counts))
        out, i = [], 0
        for c in counts:
            out.append(ids[i : i + c])
            i += c
        return out

    return one(), one()


def swapped_plan(worker, plan_fn):
    """``swap``: the prefill ranks' shares swapped in the plan the worker reads by."""
    from dataclasses import replace

    def plan(job):
        parts = plan_fn(job)
        ptp, dtp = len(job.remote_ports), worker._s.tp_size
        if ptp > 1:  # several prefill ranks: each part read from the other rank
            return [replace(p, prefill_rank=ptp - 1 - p.prefill_rank) for p in parts]
        from hybridkv.connector.pd_tp import (
            rank_reads,
        )  # one prefill rank: the other decode rank's share

        return rank_reads(dtp - 1 - worker._s.tp_rank, dtp, ptp, worker._s.total_kv_heads)

    return plan


def ssm_off_by_one(worker, slices_fn):
    """``ssm``: the SSM span (the one written into the local SSM state) one v head off:
    remote offset + one head's bytes, one head shorter (stays inside both pages)."""

    def slices(part, peer_layout, job):
        out = slices_fn(part, peer_layout, job)
        if out is None:
            return out
        hits = 0
        for gid, per in enumerate(out):
            g = worker._local.groups[gid]
            if per is None or g is None or "Mamba" not in g.spec:
                continue
            ssm_local = g.splits()[1]
            hb = ssm_local.unit
            new = []
            for spans in per:
                row = []
                for lo, ro, n in spans:
                    if (
                        ssm_local.offset <= lo < ssm_local.offset + ssm_local.nbytes
                    ):  # lands in the SSM state
                        lo, ro, n = lo, ro + hb, n - hb
                        hits += 1
                    row.append((lo, ro, n))
                new.append(row)
            out[gid] = new
        assert hits, "no SSM span found to plant"
        return out

    return slices
