"""KV caches laid out as vLLM lays them out, on any device: a scenario (groups, layout, block and
kernel sizes) -> vLLM's ``KVCacheConfig``, one int8 allocation viewed by vLLM's own
``create_kv_cache_views``, filled from a seed or poisoned, and the image the allocation must equal
after blocks are moved into it. The GPU benchmarks (bench/gpu_*.py) and their CPU checks use it;
vLLM is imported inside the functions, so a benchmark can first choose which vLLM to import.

A scenario: ``dict(layout="LBHNC", num_blocks=N, groups=[dict(kind="fa", layers, block, kernel,
heads, head) | dict(kind="mamba", layers, block, shapes, [dtypes], [mamba_type])])``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

POISON = 0xA5


def build_config(sc: dict):
    """(KVCacheConfig, kernel_block_sizes, KVCacheLayout) for a scenario, vLLM's layer-outer plan."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    specs = []
    for g in sc["groups"]:
        if g["kind"] == "fa":
            specs.append(
                FullAttentionSpec(
                    block_size=g["block"],
                    num_kv_heads=g["heads"],
                    head_size=g["head"],
                    dtype=torch.bfloat16,
                )
            )
    page = max(s.page_size_bytes for s in specs)
    for g in sc["groups"]:
        if g["kind"] == "mamba":
            extra = {}
            if g.get(
                "mamba_type"
            ):  # e.g. "GDN_ATTN" (bench/gpu_pd_tp.py: GDN state is re-sliced across TP)
                from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

                extra["mamba_type"] = MambaAttentionBackendEnum[g["mamba_type"]]
            specs.append(
                MambaSpec(
                    block_size=g["block"],
                    shapes=tuple(tuple(x) for x in g["shapes"]),
                    dtypes=tuple(g.get("dtypes", (torch.bfloat16,) * len(g["shapes"]))),
                    page_size_padded=page,
                    mamba_cache_mode="align",
                    **extra,
                )
            )
    assert all(s.page_size_bytes == page for s in specs), [s.page_size_bytes for s in specs]
    nb, layers = sc["num_blocks"], max(g["layers"] for g in sc["groups"])
    size = page * nb * layers
    groups, tensors, kernels = [], [], []
    for gi, (g, spec) in enumerate(zip(sc["groups"], specs)):
        names = [
            f"model.layers.{i}.{'attn' if g['kind'] == 'fa' else 'mixer'}.g{gi}"
            for i in range(g["layers"])
        ]
        groups.append(KVCacheGroupSpec(names, spec))
        if sc["layout"].startswith("BL"):  # block-outermost: a block's layers back to back
            tensors.append(
                KVCacheTensor(
                    size=size, layers=names, layer_stride=page, block_stride=page * layers
                )
            )
        else:
            tensors.append(
                KVCacheTensor(size=size, layers=names, layer_stride=page * nb, block_stride=page)
            )
        kernels.append(g.get("kernel", g["block"]))
    return (
        KVCacheConfig(num_blocks=nb, kv_cache_tensors=tensors, kv_cache_groups=groups),
        kernels,
        KVCacheLayout[sc["layout"]],
    )


def allocate(kvc, device, layout, kernel_block_sizes, buf=None):
    """vLLM 0.33 ``allocate_kv_cache`` (v1/worker/utils.py), its loop copied; views by its own
    ``create_kv_cache_views``. Returns (backing int8 buffer, {layer: view}); ``buf``: view an
    existing buffer of the same size instead (the checks' expected image)."""
    import torch
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    sizes = {t.size for t in kvc.kv_cache_tensors}
    assert len(sizes) == 1
    if buf is None:
        buf = torch.zeros(sizes.pop(), dtype=torch.int8, device=device)
    caches = {}
    for tensor in kvc.kv_cache_tensors:
        gid, group = next(
            (i, g) for i, g in enumerate(kvc.kv_cache_groups) if tensor.layers[0] in g.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        kbs = (
            kernel_block_sizes[gid]
            if kernel_block_sizes is not None and gid < len(kernel_block_sizes)
            else None
        )
        views = create_kv_cache_views(
            buf, spec, kvc.num_blocks_of(tensor), layout, tensor, kernel_block_size=kbs
        )
        caches.update(zip(tensor.layers, views))
    return buf, caches


def check_vllm(scenarios: dict) -> int:
    """CPU, vLLM importable with its config stack: layouts here == vLLM's own (``scenarios``:
    name -> scenario); 0 when every one matches."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups

    bad = 0
    for name, sc in scenarios.items():
        sc = dict(sc, num_blocks=16)
        kvc, kernels, layout = build_config(sc)
        cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
        cfg.cache_config.kv_cache_layout = layout.name
        ref = get_kv_cache_config_from_groups(
            cfg, kvc.kv_cache_groups, kvc.kv_cache_tensors[0].size
        )
        same_cfg = ref.num_blocks == kvc.num_blocks and [
            (t.size, t.layers, t.layer_stride, t.block_stride, t.offset)
            for t in ref.kv_cache_tensors
        ] == [
            (t.size, t.layers, t.layer_stride, t.block_stride, t.offset)
            for t in kvc.kv_cache_tensors
        ]
        buf, mine = allocate(kvc, torch.device("cpu"), layout, kernels)
        theirs = allocate_kv_cache(kvc, torch.device("cpu"), layout, kernels)
        tb = next(iter(theirs.values())).untyped_storage().data_ptr()
        same_views = all(
            (
                tuple(mine[n].shape),
                mine[n].stride(),
                mine[n].data_ptr() - buf.data_ptr(),
                mine[n].dtype,
            )
            == (
                tuple(theirs[n].shape),
                theirs[n].stride(),
                theirs[n].data_ptr() - tb,
                theirs[n].dtype,
            )
            for n in mine
        ) and set(mine) == set(theirs)
        ex = {
            n: (tuple(v.shape), v.stride())
            for n, v in list(mine.items())[:1] + list(mine.items())[-1:]
        }
        print(
            f"{name}: config == get_kv_cache_config_from_groups: {same_cfg}; "
            f"views == allocate_kv_cache: {same_views}; e.g. {ex}"
        )
        bad += not (same_cfg and same_views)
    return 1 if bad else 0


@dataclass
class Cache:
    """One scenario's KV cache on a device plus what the checks need."""

    kvc: object
    buf: object  # int8 backing allocation
    views: dict
    layout: object  # hybridkv KVLayout
    vllm_layout: object  # KVCacheLayout
    kernels: list
    manager_views: dict  # layer -> vLLM group_kernel_blocks view as bytes [num_blocks, -1]


def make_cache(sc: dict, device, num_blocks: int | None = None) -> Cache:
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    from hybridkv.connector.block_layout import KVLayout

    sc = dict(sc, num_blocks=num_blocks or sc["num_blocks"])
    kvc, kernels, layout = build_config(sc)
    buf, views = allocate(kvc, device, layout, kernels)
    klayout = KVLayout.from_kv_caches(kvc, views)
    mv = {}
    for g in kvc.kv_cache_groups:
        for n in g.layer_names:
            v = group_kernel_blocks(views[n], kvc.num_blocks)  # vLLM's own regrouping
            mv[n] = v
    return Cache(kvc, buf, views, klayout, layout, kernels, mv)


def block_bytes_ref(cache: Cache, group_blocks: list[list[int]]) -> list[list]:
    """Per group, per layer: the source blocks' bytes via vLLM's views (a copy), [n, ...]."""
    import torch

    out = []
    for g, ids in zip(cache.kvc.kv_cache_groups, group_blocks):
        idx = torch.tensor(ids, dtype=torch.long, device=cache.buf.device)
        out.append([cache.manager_views[n].index_select(0, idx).clone() for n in g.layer_names])
    return out


def expected_after(cache: Cache, ref: list[list], dst: list[list[int]]):
    """The whole allocation as it must be: poison, with ref written at dst through vLLM's own views
    (``create_kv_cache_views`` + ``group_kernel_blocks`` over a second buffer)."""
    import torch
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    exp = torch.full_like(cache.buf, POISON - 256)
    _, views = allocate(cache.kvc, cache.buf.device, cache.vllm_layout, cache.kernels, buf=exp)
    for g, refs, ids in zip(cache.kvc.kv_cache_groups, ref, dst):
        if not ids:
            continue
        idx = torch.tensor(ids, dtype=torch.long, device=cache.buf.device)
        for n, r in zip(g.layer_names, refs):
            group_kernel_blocks(views[n], cache.kvc.num_blocks).index_copy_(0, idx, r)
    return exp


def poison(cache: Cache) -> None:
    cache.buf.fill_(POISON - 256)


def fill_random(cache: Cache, seed: int) -> None:
    import torch

    gen = torch.Generator(device=cache.buf.device).manual_seed(seed)
    cache.buf.view(torch.uint8).random_(0, 256, generator=gen)


def pick_blocks(
    cache: Cache, n: int, rng: random.Random
) -> tuple[list[list[int]], list[list[int]]]:
    """n manager blocks split over the groups; ids distinct across groups (one pool), src != dst."""
    groups = len(cache.kvc.kv_cache_groups)
    ids = rng.sample(range(1, cache.kvc.num_blocks), 2 * n)
    src, dst = ids[:n], ids[n:]
    per = [n // groups + (i < n % groups) for i in range(groups)]
    out_s, out_d, k = [], [], 0
    for p in per:
        out_s.append(src[k : k + p])
        out_d.append(dst[k : k + p])
        k += p
    return out_s, out_d


def shifted(dst: list[list[int]], cache: Cache) -> list[list[int]]:
    """The planted fault: the first block of the first group lands one block off."""
    used = {b for ids in dst for b in ids}
    out = [list(ids) for ids in dst]
    b = out[0][0]
    cand = b + 1 if b + 1 < cache.kvc.num_blocks and b + 1 not in used else b - 1
    assert cand not in used and cand >= 0
    out[0][0] = cand
    return out


def batch_bytes(cache: Cache, group_blocks: list[list[int]]) -> int:
    return sum(cache.layout.groups[g].object_bytes * len(ids) for g, ids in enumerate(group_blocks))
