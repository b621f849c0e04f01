"""The Kimi-K3 cache shape through vLLM's real KVCacheManager, Scheduler and KV allocation.

K3 = MLA latent attention (the target's one dense group) + KDA linear attention (Mamba
groups, padded to the MLA page) + a drafter whose sliding-window layer is booked as full
attention (``FullAttentionSpec`` with ``sliding_window`` kept) at another block size. The
shapes come from vLLM's own sizing and grouping (tests/unit/k3_shape.py): with two
speculative tokens the manager block is 2048 (1920 without: K3's serving size), the
drafter's 4096, and each KDA group carries two speculative scratch blocks per request.

Checked here: the connector's store hit equals the manager's, block for block; the strict
dense reference over MLA + drafter (report the MIN of the dense hits); the save mask
loses no hit; P/D pairs each KDA group's state column, never a scratch block; every
transport's bytes per manager block over vLLM's ``allocate_kv_cache`` (64-token MLA kernel
blocks under the 2048-token manager block, one latent row per token); P/D between TP
sizes (MLA latent replicated on every rank, KDA state split over ranks).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import random
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    compute_layer_kv_cache_shape_bytes,
    get_mamba_prefill_checkpoint_position,
)
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from hybridkv.cli.harness.kv_manager import (
    cached_keys,
    make_request,
    nonnull_positions,
    run_prefill,
)
from hybridkv.connector.block_layout import KVLayout, layout_rows
from hybridkv.connector.dense_reference import reconciled_computed_blocks_for_connector
from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.connector.pd_handshake import LayoutDescriptor, find_mismatches
from hybridkv.connector.pd_metadata import PDHandshakeMetadata, PDWorkerMetadata
from hybridkv.connector.pd_params import Refused
from hybridkv.connector.pd_tp import latent_rank, rank_reads, read_spans, spec_state_splits
from hybridkv.connector.pd_transport import read_descriptors
from hybridkv.connector.store_staging import build_stager_pools
from hybridkv.store.geometry import CoordinatorParams, GroupGeometry
from hybridkv.store.mirror import StoreMirror
from tests.unit.k3_shape import (
    DRAFTER_WINDOW,
    KDA_PROJECTION,
    MAX_MODEL_LEN,
    MLA_KERNEL_BLOCK,
    NUM_KDA_GROUPS,
    K3Rank,
    K3Shape,
    k3_rank,
    k3_shape,
    kda_share,
    write_k3_config,
)
from tests.unit.pd_real_scheduler import pd_request, prefill_leg, worker_reply
from tests.unit.tiny_vllm_config import TINY_LLAMA

NUM_SPEC = 2
KDA = list(range(NUM_KDA_GROUPS))
MLA, DRAFTER = NUM_KDA_GROUPS, NUM_KDA_GROUPS + 1
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-k3-")) / "secret"))
# The scheduler's ModelConfig only bounds lengths: the tiny local Llama config, 64k positions.
_LLAMA_64K = {**TINY_LLAMA, "max_position_embeddings": MAX_MODEL_LEN}


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory) -> Path:
    init_none_hash(sha256)
    return write_k3_config(tmp_path_factory.mktemp("k3"))


@pytest.fixture(scope="module")
def shape(k3_dir) -> K3Shape:
    return k3_shape(k3_dir, NUM_SPEC)


def _resolved(shape: K3Shape) -> tuple[int, int]:
    """(scheduler block, hash block) as ``EngineCore`` resolves them, written into the config."""
    cfg, kc = shape.vllm_config, shape.kv_cache_config
    block, hash_block = resolve_kv_cache_block_sizes(kc, cfg)
    kc.hash_block_size = hash_block
    kc.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(kc, cfg, block, hash_block)
    return block, hash_block


def test_vllm_sizes_the_k3_blocks(k3_dir, shape):
    """vLLM's own picks: manager block 1920 without a drafter (K3's serving size), 2048 with
    two speculative tokens (each adds a conv-state row); MLA and KDA at the manager block,
    the drafter at twice it with its window kept; every page equal; scratch blocks on KDA."""
    plain = k3_shape(k3_dir, 0)
    assert plain.manager_block == 1920
    plain_groups = [g.kv_cache_spec for g in plain.kv_cache_config.kv_cache_groups]
    assert [type(s) for s in plain_groups] == [MambaSpec] * 3 + [MLAAttentionSpec]
    assert {s.page_size_bytes for s in plain_groups} == {1920 * 1152}

    groups = [g.kv_cache_spec for g in shape.kv_cache_config.kv_cache_groups]
    assert shape.manager_block == 2048
    assert [type(s) for s in groups] == [MambaSpec] * 3 + [MLAAttentionSpec, FullAttentionSpec]
    assert [s.block_size for s in groups] == [2048] * 4 + [4096]
    assert [s.num_speculative_blocks for s in groups[:3]] == [NUM_SPEC] * 3
    assert groups[MLA].head_size == 576 and groups[MLA].num_kv_heads == 1
    assert groups[DRAFTER].sliding_window == DRAFTER_WINDOW
    assert {s.page_size_bytes for s in groups} == {2048 * 1152}
    assert _resolved(shape) == (4096, 2048)


# ---------------------------------------------------------------------- KVCacheManager


def _manager(shape: K3Shape, num_blocks: int = 600) -> tuple[KVCacheManager, types.SimpleNamespace]:
    """The manager the Scheduler builds for this config (EAGLE block drop on: a drafter)."""
    block, hash_block = _resolved(shape)
    kc = dataclasses.replace(shape.kv_cache_config, num_blocks=num_blocks)
    manager = KVCacheManager(
        kc,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=block,
        hash_block_size=hash_block,
        use_eagle=True,
        num_prefill_lookahead=1,
    )
    geo = types.SimpleNamespace(
        hash_block_size=hash_block, scheduler_block_size=block, use_eagle=True
    )
    return manager, geo


def _tokens(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 30000), k=n)


PROMPT = _tokens(5 * 4096 + 700, 1)
OTHER = PROMPT[: 3 * 4096 + 100] + _tokens(4000, 2)


def _queries() -> list[list[int]]:
    out = [PROMPT + _tokens(300, 3), list(PROMPT), OTHER + [5]]
    out += [PROMPT[:cut] + [7] for cut in range(2048, len(PROMPT), 2048)]
    return out


def _mirror(manager: KVCacheManager) -> StoreMirror:
    return StoreMirror(GroupGeometry.from_params(CoordinatorParams.from_kv_cache_manager(manager)))


def _store_vs_manager(manager: KVCacheManager, geo) -> list[int]:
    """Per query: the store mirror's hit over the manager's cached blocks equals the
    manager's own hit, in every group's positions and keys. Returns the hits."""
    contents = cached_keys(manager)
    mirror = _mirror(manager)
    hits = []
    for q in _queries():
        req = make_request(geo, q)
        blocks, want, _ = manager.get_computed_blocks(req)
        got = mirror.longest_hit(req.block_hashes, req.num_tokens - 1, contents)
        assert got.tokens == want, (len(q), got.tokens, want)
        for gid, group_blocks in enumerate(blocks.blocks):
            assert [i for i, _ in got.blocks[gid]] == nonnull_positions(group_blocks), (len(q), gid)
        hits.append(want)
    return hits


def test_store_hit_equals_the_managers_hit(shape):
    manager, geo = _manager(shape)
    run_prefill(manager, geo, PROMPT, random.Random(0))
    run_prefill(manager, geo, OTHER, random.Random(1))
    hits = _store_vs_manager(manager, geo)
    # The extension of PROMPT hits PROMPT's EAGLE checkpoint (vLLM's rule, one scheduler
    # block below the non-drafter checkpoint).
    assert hits[0] == get_mamba_prefill_checkpoint_position(len(PROMPT), 4096, True) == 4 * 4096
    # OTHER (3 * 4096 + 100 tokens of PROMPT, then its own) plus one token: OTHER's own checkpoint.
    assert hits[2] == get_mamba_prefill_checkpoint_position(len(OTHER), 4096, True) == 3 * 4096
    # The drafter's cached blocks evicted: no hit anywhere (the drafter is a dense group),
    # and the store mirror agrees.
    manager.evict_blocks(_cached_ids(manager, DRAFTER))
    assert _store_vs_manager(manager, geo)[0] == 0


def _cached_ids(manager: KVCacheManager, gid: int) -> set[int]:
    from vllm.v1.core.kv_cache_utils import get_group_id

    from hybridkv.store import vllm_compat

    cached = vllm_compat.cached_block_ids(manager.block_pool.cached_block_hash_to_block)
    return {b for key, ids in cached.items() if get_group_id(key) == gid for b in ids}


def test_strict_dense_reference_reports_the_min_over_mla_and_drafter(shape):
    """The drafter's group evicted from token 8192 on, MLA still whole: vLLM's own
    connector lookup reports the MLA group's hit (its single dense reference), which the
    drafter's blocks do not cover; hybridkv reports the MIN over both dense groups (the
    drafter's 8192 less the EAGLE drop) and every dense list covers exactly that."""
    manager, geo = _manager(shape)
    req = run_prefill(manager, geo, PROMPT, random.Random(0), free=False)
    table = manager.get_block_ids(req.request_id)
    manager.free(req)
    manager.evict_blocks(set(table[DRAFTER][2:]))  # drafter blocks of 4096 tokens: keep [0, 8192)
    query = make_request(geo, PROMPT + _tokens(300, 3))
    _, vllm_len, _, _ = manager.get_computed_blocks_for_connector(query)
    geometry = GroupGeometry.from_kv_cache_manager(manager)
    assert list(geometry.dense_group_ids) == [MLA, DRAFTER]
    blocks, ours, _, diverged = reconciled_computed_blocks_for_connector(manager, geometry, query)
    assert vllm_len == 4 * 4096, "vLLM's single dense reference: the MLA group"
    assert ours == 4096, "the drafter's two blocks, less the EAGLE drop"
    assert len(blocks.blocks[MLA]) == 2 and len(blocks.blocks[DRAFTER]) == 1
    # The KDA state at 8192 was not kept (only the prompt's checkpoint and the chunk ends).
    _, at = manager.coordinator.find_longest_cache_hit_per_group(query.block_hashes, ours)
    assert diverged == any(at[g] != ours for g in KDA)


def test_save_mask_keeps_every_local_hit_and_only_kda_checkpoints(shape):
    """The KDA groups save only the prompt's EAGLE checkpoint (block 7: the state at
    16384), MLA and drafter every block; a store holding only the masked blocks serves
    every query at least what vLLM's own cache serves after the same prefill, and the
    extension of the prompt its checkpoint."""
    manager, geo = _manager(shape)
    run_prefill(manager, geo, PROMPT, random.Random(0))
    mirror = _mirror(manager)
    req = make_request(geo, PROMPT)
    masked = set()
    for g in mirror.geometry.groups:
        n_blocks = len(PROMPT) // g.block_size
        mask = mirror.save_mask(g.group_id, 0, n_blocks, num_prompt_tokens=len(PROMPT))
        want = [i == 7 for i in range(n_blocks)] if g.group_id in KDA else [True] * n_blocks
        assert mask == want, g.group_id
        masked |= {
            mirror.block_key(g.group_id, req.block_hashes, (i + 1) * g.block_size)
            for i in range(n_blocks)
            if mask[i]
        }
    served = []
    for q in _queries():
        r = make_request(geo, q)
        hit = mirror.longest_hit(r.block_hashes, r.num_tokens - 1, masked).tokens
        assert hit >= manager.get_computed_blocks(r)[1], len(q)
        served.append(hit)
    assert served[0] == served[1] == 4 * 4096


# ---------------------------------------------------------------------- P/D, real Scheduler


def _pd_scheduler(
    model_dir: Path,
    shape: K3Shape,
    role: str,
    *,
    num_blocks: int | None = 400,
    max_model_len: int = MAX_MODEL_LEN,
    **extra: object,
) -> Scheduler:
    """What ``EngineCore`` builds for a P/D instance over the K3 config at the shape's TP
    size (one step prefills a whole prompt: the budget holds it). ``num_blocks`` None: the
    shape's own (block ids then address its allocation); ``extra``: more
    ``kv_connector_extra_config``."""
    block, hash_block = _resolved(shape)
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=max_model_len,
        ),
        cache_config=CacheConfig(
            block_size=hash_block, enable_prefix_caching=True, mamba_cache_mode="align"
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=shape.tp_size),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=32768,
            max_num_seqs=4,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridPDConnector",
            kv_role=role,
            kv_connector_module_path="hybridkv.connector",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"auth_secret_file": SECRET, **extra},
        ),
    )
    kc = shape.kv_cache_config
    if num_blocks is not None:
        kc = dataclasses.replace(kc, num_blocks=num_blocks)
    vllm_config.cache_config.num_gpu_blocks = kc.num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kc,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block,
        hash_block_size=hash_block,
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llama-64k")
    (d / "config.json").write_text(json.dumps(_LLAMA_64K))
    return d


def test_pd_reads_each_kda_state_column_never_a_scratch_block(llama_dir, shape):
    """Prefill and decode both real Schedulers over the K3 config (two scratch blocks after
    each KDA state block). Decode's READ pairs, per KDA group, the prefill side's block at
    the state column ``cdiv(T, 2048) - 1`` of its table with decode's block at the same
    column (T: the hand-over); MLA and drafter pair block by block up to T."""
    prompt = _tokens(10_000, 11)
    prefill = _pd_scheduler(llama_dir, shape, "kv_producer")
    params = prefill_leg(prefill, pd_request("cmpl-k3-p", prompt, {"do_remote_decode": True}, 2048))
    handover = int(params["remote_num_tokens"])
    column = cdiv(handover, 2048) - 1
    remote = params["remote_block_ids"]
    print(f"hand-over {handover}, prefill tables {remote}")
    for g in KDA:
        assert remote[g][column], (
            f"KDA group {g}: the prefill side lists no state block at column {column}"
        )

    decode = _pd_scheduler(llama_dir, shape, "kv_consumer")
    req = pd_request(
        "cmpl-k3-d", prompt, params | {"do_remote_prefill": True, "do_remote_decode": False}, 2048
    )
    decode.add_request(req)
    out = decode.schedule()
    reads = out.kv_connector_metadata.reads
    assert len(reads) == 1 and req.num_computed_tokens == handover
    local = decode.kv_cache_manager.get_block_ids(req.request_id)
    print(f"decode tables {local}, READ {reads[0].remote_block_ids} -> {reads[0].local_block_ids}")
    for g in KDA:
        assert len(local[g]) == column + 1 + NUM_SPEC, "the state column, then two scratch blocks"
        assert reads[0].remote_block_ids[g] == [remote[g][column]], (g, remote[g])
        assert reads[0].local_block_ids[g] == [local[g][column]], (g, local[g])
    assert reads[0].remote_block_ids[MLA] == list(remote[MLA][: cdiv(handover, 2048)])
    assert reads[0].local_block_ids[MLA] == list(local[MLA][: cdiv(handover, 2048)])
    assert reads[0].remote_block_ids[DRAFTER] == list(remote[DRAFTER][: cdiv(handover, 4096)])
    assert reads[0].local_block_ids[DRAFTER] == list(local[DRAFTER][: cdiv(handover, 4096)])


# ---------------------------------------------------------------------- block layout


@pytest.fixture(scope="module")
def caches(k3_dir):
    """A K3 worker's KV cache as vLLM allocates it: FlashMLA's 64-token kernel blocks under
    the MLA manager block and the drafter's, whole blocks for KDA; random bytes everywhere."""
    s = k3_shape(k3_dir, NUM_SPEC, num_blocks=8, max_model_len=8192)
    kc = s.kv_cache_config
    kernel = [2048] * NUM_KDA_GROUPS + [MLA_KERNEL_BLOCK, MLA_KERNEL_BLOCK]
    tensors = allocate_kv_cache(
        kc, torch.device("cpu"), s.vllm_config.cache_config.get_resolved_kv_cache_layout(), kernel
    )
    first = next(iter(tensors.values()))
    raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
    raw.copy_(
        torch.randint(
            0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
        )
    )
    return s, kc, tensors, raw


def _page(kc, spec_of, name: str, b: int) -> tuple[int, int]:
    """vLLM's placement contract: layer ``name``'s content of block ``b`` in the allocation."""
    for t in kc.kv_cache_tensors:
        if name in t.layers:
            start = t.offset + t.layers.index(name) * t.layer_stride + b * t.block_stride
            return start, start + math.prod(
                compute_layer_kv_cache_shape_bytes(spec_of(name), 1)[1:]
            )
    raise KeyError(name)


def test_mla_cache_is_one_latent_row_per_token_in_64_token_kernel_blocks(caches):
    s, kc, tensors, _ = caches
    mla = kc.kv_cache_groups[MLA].layer_names[0]
    t = tensors[mla]
    # [kernel blocks, 1 latent "head", 64 tokens, 576]: no K/V dimension (K/V caches have a 2).
    assert tuple(t.shape) == (kc.num_blocks * 2048 // MLA_KERNEL_BLOCK, 1, MLA_KERNEL_BLOCK, 576)


def test_every_transport_moves_exactly_each_manager_block(caches):
    """Per group, the bytes GroupLayout addresses for block b (NIXL READ descriptors and the
    store's zero-copy puts) and the staged gather (the store's pinned-buffer path) are
    exactly vLLM's placement of block b: MLA 2048 x 1152 bytes (32 kernel blocks), the
    drafter 4096 x 576, KDA its state bytes."""
    s, kc, tensors, raw = caches
    layout = KVLayout.from_kv_caches(kc, tensors)
    mem = raw.numpy()

    def spec_of(name: str):
        return next(g.kv_cache_spec for g in kc.kv_cache_groups if name in g.layer_names)

    want_bytes = {MLA: 2048 * 1152, DRAFTER: 4096 * 2 * 144 * 2}
    for gid, group in enumerate(kc.kv_cache_groups):
        g = layout.groups[gid]
        name = group.layer_names[0]
        lo, hi = _page(kc, spec_of, name, 0)
        assert g.object_bytes == hi - lo == want_bytes.get(gid, hi - lo)
        if gid in KDA:
            assert g.object_bytes == sum(
                np.prod(sh) * dt.itemsize
                for sh, dt in zip(group.kv_cache_spec.shapes, group.kv_cache_spec.dtypes)
            )
        ids = [5, 0, 3]
        addrs, sizes = g.regions(ids)
        stager = build_stager_pools(layout, tensors, 8, 1 << 30, lambda ptr, n: None)[gid][
            "save"
        ].acquire()
        slots = stager.gather(ids)
        for k, (b, a, n) in enumerate(zip(ids, addrs, sizes)):
            lo, hi = _page(kc, spec_of, name, b)
            expected = mem[lo:hi].tobytes()
            assert b"".join(ctypes.string_at(x, m) for x, m in zip(a, n)) == expected, (gid, b)
            assert ctypes.string_at(*slots[k]) == expected, (gid, b)


# ---------------------------------------------------------------------- TP sizes


def _descriptor(k3_dir, tp: int, block_size: int | None = None) -> LayoutDescriptor:
    """One rank's handshake layout, from vLLM's allocation of the K3 config at ``tp``."""
    s = k3_shape(
        k3_dir, NUM_SPEC, num_blocks=8, tp_size=tp, max_model_len=8192, block_size=block_size
    )
    kc = s.kv_cache_config
    kernel = [
        g.kv_cache_spec.block_size if isinstance(g.kv_cache_spec, MambaSpec) else MLA_KERNEL_BLOCK
        for g in kc.kv_cache_groups
    ]
    tensors = allocate_kv_cache(
        kc, torch.device("cpu"), s.vllm_config.cache_config.get_resolved_kv_cache_layout(), kernel
    )
    mamba = [isinstance(g.kv_cache_spec, MambaSpec) for g in kc.kv_cache_groups]
    # As pd_worker describes its rank: each Mamba group's state splits, each attention
    # group's KV heads on this rank, the model's KV heads.
    splits = [
        spec_state_splits(
            str(g.kv_cache_spec.mamba_type),
            g.kv_cache_spec.shapes,
            [d.itemsize for d in g.kv_cache_spec.dtypes],
            False,
        )
        if m
        else ()
        for g, m in zip(kc.kv_cache_groups, mamba)
    ]
    heads = [0 if m else g.kv_cache_spec.num_kv_heads for g, m in zip(kc.kv_cache_groups, mamba)]
    return LayoutDescriptor.from_kv(
        KVLayout.from_kv_caches(kc, tensors),
        layout_rows(kc),
        tp,
        kv_heads=heads,
        total_kv_heads=s.vllm_config.model_config.get_total_num_kv_heads(),
        state_splits=splits,
    )


def _problems(k3_dir, block_size: int | None = None) -> set[tuple[str, str]]:
    """What the handshake finds between a TP2 prefill and a TP1 decode of K3."""
    return {
        (m.where, m.name)
        for m in find_mismatches(_descriptor(k3_dir, 2, block_size), _descriptor(k3_dir, 1))
    }


def test_k3_manager_block_depends_on_tp_size(k3_dir):
    """The KDA state per rank halves at TP2, so vLLM's aligned manager block halves: a
    TP2 prefill and a TP1 decode of K3 run different block sizes unless both pin one."""
    assert k3_shape(k3_dir, NUM_SPEC, tp_size=2).manager_block == 1024
    assert k3_shape(k3_dir, NUM_SPEC, tp_size=2, block_size=2048).manager_block == 2048
    assert k3_shape(k3_dir, NUM_SPEC, tp_size=1).manager_block == 2048


def test_pd_across_tp_sizes_is_refused_with_the_causes_named(k3_dir):
    """Prefill TP2 -> decode TP1 on K3 with its drafter: the handshake refuses (decode
    recomputes, never reads wrong bytes). By default every group's block size differs
    (vLLM's alignment depends on TP). With --block-size 2048 pinned on the prefill, only
    the drafter's group remains: its one KV head is replicated on every rank (per-rank
    heads 1 x TP 2 is not the model config's 4), and the handshake carries no KV-head count
    of the drafter's own. The MLA latent pairs (read whole from one rank), and so do the
    KDA groups' GDN state splits (re-sliced)."""
    default = _problems(k3_dir)
    assert {(w, n) for w, n in default if n == "block_size"} == {
        (f"group {g}", "block_size") for g in range(5)
    }
    assert _problems(k3_dir, block_size=2048) == {(f"group {DRAFTER}", "kv_heads")}


# K3 without its drafter at one manager block on both TP sizes: 1920 is vLLM's own pick at
# TP1 and is pinned with --block-size at TP2 (whose own pick is 1024, which a TP1 decode
# refuses: test_pd_across_tp_sizes_refuses_unequal_blocks_naming_the_field).
TP_BLOCK = 1920
TP_MODEL_LEN = 8192
POISON = 0xA5
# The schedulers' ModelConfig bounds lengths and gives the connector the model's KV heads:
# K3's num_key_value_heads, 4 (they decide each decode rank's plan of prefill ranks).
_LLAMA_4KV = {**_LLAMA_64K, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16}


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llama-4kv")
    (d / "config.json").write_text(json.dumps(_LLAMA_4KV))
    return d


def _tp_shape(k3_dir, tp: int, block_size: int | None = TP_BLOCK) -> K3Shape:
    return k3_shape(
        k3_dir, 0, num_blocks=4, tp_size=tp, max_model_len=TP_MODEL_LEN, block_size=block_size
    )


def _tp_handover(
    k3_dir,
    llama4_dir,
    prefill_tp: int,
    decode_tp: int,
    prefill_block: int | None = TP_BLOCK,
    prompt_len: int = 7000,
):
    """One prefill leg through a real prefill Scheduler at ``prefill_tp`` (every rank's
    handshake port known), handed to a real decode Scheduler at ``decode_tp`` with
    allow_mamba_cross_tp on. Returns (prefill shape, decode shape, decode scheduler, the
    decode request, its READ jobs, the hand-over in tokens)."""
    pre, dec = _tp_shape(k3_dir, prefill_tp, prefill_block), _tp_shape(k3_dir, decode_tp)
    prompt = _tokens(prompt_len, 21)
    prefill = _pd_scheduler(
        llama4_dir, pre, "kv_producer", num_blocks=None, max_model_len=TP_MODEL_LEN
    )
    prefill.connector.set_xfer_handshake_metadata(
        {r: PDHandshakeMetadata("127.0.0.1", 45678 + r, r) for r in range(prefill_tp)}
    )
    req = pd_request("cmpl-k3tp-p", prompt, {"do_remote_decode": True}, pre.manager_block)
    prefill.add_request(req)
    out = prefill.schedule()
    done = prefill.update_from_output(
        out,
        worker_reply(out, {req.request_id: [7]}, kv_connector_worker_meta=PDWorkerMetadata({})),
    )
    (params,) = [o.kv_transfer_params for eo in done.values() for o in eo.outputs]
    assert params["remote_ports"] == [45678 + r for r in range(prefill_tp)]
    decode = _pd_scheduler(
        llama4_dir,
        dec,
        "kv_consumer",
        num_blocks=None,
        max_model_len=TP_MODEL_LEN,
        allow_mamba_cross_tp=True,
    )
    dreq = pd_request(
        "cmpl-k3tp-d",
        prompt,
        params | {"do_remote_prefill": True, "do_remote_decode": False},
        dec.manager_block,
    )
    decode.add_request(dreq)
    reads = decode.schedule().kv_connector_metadata.reads
    return pre, dec, decode, dreq, reads, int(params["remote_num_tokens"])


def _channels_first(conv: torch.Tensor) -> torch.Tensor:
    """A conv state as (channels, state_len) whatever vLLM's conv layout (SD stores the
    transpose)."""
    return conv if is_conv_state_dim_first() else conv.transpose(-1, -2)


class _TpWorld:
    """The prefill ranks' caches holding one request's blocks, and decode ranks reading
    them as ``PDWorker._read`` does (``rank_reads`` -> ``read_spans`` over the handshake
    descriptors -> ``read_descriptors``), each row copied with memmove (what NIXL's READ
    does). Each prefill MLA block is random bytes, the SAME on every prefill rank (vLLM
    replicates the latent); each KDA state block a random TP1 state, of which every rank
    holds its share (``kda_share``: vLLM's weight-loading split)."""

    def __init__(self, pre: K3Shape, dec: K3Shape, job, monkeypatch) -> None:  # noqa: ANN001
        self.pre, self.dec, self.job = pre, dec, job
        self.share = {
            (tp, r): kda_share(tp, r, monkeypatch)
            for tp in {pre.tp_size, dec.tp_size}
            for r in range(tp)
        }
        gen = torch.Generator().manual_seed(5)
        groups = pre.kv_cache_config.kv_cache_groups
        self.latent = {
            b: torch.randint(
                0,
                256,
                (groups[MLA].kv_cache_spec.page_size_bytes,),
                dtype=torch.uint8,
                generator=gen,
            )
            for b in job.remote_block_ids[MLA]
        }
        state_len = _channels_first(torch.empty(groups[KDA[0]].kv_cache_spec.shapes[0])).shape[-1]
        self.state = {
            (g, b): (
                torch.randn(3 * KDA_PROJECTION, state_len, generator=gen).to(
                    groups[g].kv_cache_spec.dtypes[0]
                ),
                torch.randn(32, 128, 128, generator=gen).to(groups[g].kv_cache_spec.dtypes[1]),
            )
            for g in KDA
            for b in job.remote_block_ids[g]
        }
        self.ranks = []
        for p in range(pre.tp_size):
            rank = k3_rank(pre, p, POISON)
            self._place(rank, {g: {b: b for b in job.remote_block_ids[g]} for g in [*KDA, MLA]})
            self.ranks.append(rank)

    def _place(self, rank: K3Rank, blocks: dict[int, dict[int, int]]) -> None:
        """Write into ``rank`` what it holds of each source block ``src`` of group ``g`` at
        block ``blocks[g][src]``: the latent whole, its share of a KDA state."""
        for src, dst in blocks[MLA].items():
            rank.page(MLA, dst).copy_(self.latent[src])
        channels, heads = self.share[rank.shape.tp_size, rank.rank]
        for g in KDA:
            conv, ssm = rank.states(g)
            for src, dst in blocks[g].items():
                full_conv, full_ssm = self.state[g, src]
                _channels_first(conv[dst]).copy_(full_conv[channels])
                ssm[dst].copy_(full_ssm[heads])

    def expected(self, decode_rank: int) -> torch.Tensor:
        """Decode rank ``decode_rank``'s whole allocation after a correct READ: the latent
        and its KDA shares in the local blocks, poison everywhere else (padding included)."""
        want = k3_rank(self.dec, decode_rank, POISON)
        j = self.job
        pairs = {
            g: dict(zip(j.remote_block_ids[g], j.local_block_ids[g], strict=True))
            for g in [*KDA, MLA]
        }
        self._place(want, pairs)
        return want.raw

    def read(self, decode_rank: int, fault=None) -> tuple[torch.Tensor, int]:  # noqa: ANN001
        """Decode rank ``decode_rank``'s allocation after its READs, and the MLA bytes they
        moved. ``fault(part, spans, remote_ids)`` plants a fault into each READ's plan."""
        dec = k3_rank(self.dec, decode_rank, POISON)
        dtp, ptp = self.dec.tp_size, self.pre.tp_size
        layout = dec.layout
        rows = [() if g is None else g.kernel_rows for g in layout.groups]
        mla_pages = [
            (dec.page(MLA, b).data_ptr(), dec.page(MLA, b).data_ptr() + dec.page(MLA, b).numel())
            for b in self.job.local_block_ids[MLA]
        ]
        mla_bytes = 0
        for part in rank_reads(decode_rank, dtp, ptp, dec.descriptor.total_kv_heads):
            src = self.ranks[part.prefill_rank]
            assert find_mismatches(src.descriptor, dec.descriptor) == []
            remote = [list(ids) for ids in self.job.remote_block_ids]
            spans = read_spans(
                part,
                dec.descriptor.groups,
                src.descriptor.groups,
                rows,
                remote,
                dtp,
                ptp,
                decode_rank,
            )
            if fault is not None:
                spans, remote = fault(part, spans, remote)
            local_rows, remote_rows = read_descriptors(
                layout.groups, src.layout.groups, remote, self.job.local_block_ids, slices=spans
            )
            for (la, n, _), (ra, _, _) in zip(
                local_rows.tolist(), remote_rows.tolist(), strict=True
            ):
                ctypes.memmove(la, ra, n)
                mla_bytes += n if any(lo <= la < hi for lo, hi in mla_pages) else 0
        return dec.raw, mla_bytes


def _mla_spans(spans, regions: int, whole: bool):  # noqa: ANN001, ANN202
    """``spans`` with the MLA group's replaced: the whole block (None) or nothing."""
    spans = list(spans) if spans is not None else [None] * (MLA + 1)
    spans[MLA] = None if whole else [[] for _ in range(regions)]
    return spans


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_pd_across_tp_sizes_reads_the_mla_latent_from_one_rank(
    k3_dir, llama4_dir, monkeypatch, prefill_tp, decode_tp
):
    """K3 (MLA + three KDA groups) between TP sizes, through real prefill and decode
    Schedulers: the handshake pairs every group; each decode rank's READs bring the MLA
    latent whole from ONE prefill rank (``latent_rank``: prefill TP2 -> decode TP1 reads it
    from rank 0 only, TP1 -> TP2 each decode rank from rank 0) and each KDA state as its
    own share re-sliced from the prefill ranks', so its allocation equals the expected
    image byte for byte (poison elsewhere), and the MLA bytes moved are the latent blocks
    exactly once. Planted faults: the MLA block ids one block shifted, the latent read from
    no rank (bytes differ), the latent read from every prefill rank (bytes equal, traffic
    doubled: the count sees it)."""
    pre, dec, decode, req, reads, handover = _tp_handover(k3_dir, llama4_dir, prefill_tp, decode_tp)
    assert pre.manager_block == dec.manager_block == TP_BLOCK
    assert len(reads) == 1 and req.num_computed_tokens == handover
    job = reads[0]
    assert job.remote_ports == [45678 + r for r in range(prefill_tp)]
    n_mla = cdiv(handover, TP_BLOCK)
    assert len(job.remote_block_ids[MLA]) == n_mla >= 2
    assert all(len(job.remote_block_ids[g]) == 1 for g in KDA), "each KDA group: its state block"
    world = _TpWorld(pre, dec, job, monkeypatch)
    page = TP_BLOCK * 1152  # one latent row of 576 bf16 per token
    for r in range(decode_tp):
        assert latent_rank(r, decode_tp, prefill_tp) == 0
        got, mla_bytes = world.read(r)
        assert torch.equal(got, world.expected(r)), f"decode rank {r}"
        assert mla_bytes == n_mla * page, f"decode rank {r}: the latent once"

    def shifted(part, spans, remote):  # noqa: ANN001, ANN202
        remote[MLA] = remote[MLA][1:] + remote[MLA][:1]
        return spans, remote

    def nowhere(part, spans, remote):  # noqa: ANN001, ANN202
        return _mla_spans(spans, regions, whole=False), remote

    def everywhere(part, spans, remote):  # noqa: ANN001, ANN202
        return _mla_spans(spans, regions, whole=True), remote

    regions = len(world.ranks[0].descriptor.groups[MLA].block_bytes)
    want = world.expected(0)
    assert not torch.equal(world.read(0, shifted)[0], want)
    assert not torch.equal(world.read(0, nowhere)[0], want)
    got, mla_bytes = world.read(0, everywhere)
    assert torch.equal(got, want)  # the ranks' latents are equal: only the traffic differs
    assert mla_bytes == prefill_tp * n_mla * page


def test_pd_across_tp_sizes_refuses_unequal_blocks_naming_the_field(k3_dir, llama4_dir):
    """Unequal manager blocks are refused, not handled: decode would have to map each of
    the prefill side's block columns onto its own (the KDA state column and the MLA blocks
    move with the block size), and neither the scheduler's pairing nor the handshake does.
    vLLM's own block for K3 at TP2 (1024) against its TP1 block (1920): a TP1 decode's real
    Scheduler refuses the TP2 prefill's hand-over of 5120 tokens (no READ: the prompt is
    computed locally) naming its block_size, and the handshake names block_size for every
    group (the MLA group's block bytes and kernel-block split follow from it)."""
    pre, dec, decode, req, reads, handover = _tp_handover(
        k3_dir, llama4_dir, 2, 1, prefill_block=None
    )
    assert (pre.manager_block, dec.manager_block, handover) == (1024, TP_BLOCK, 5120)
    assert reads == []
    refused = decode.connector._scheduler.params(req)
    assert isinstance(refused, Refused) and refused.field == "remote_block_sizes", refused
    assert "groups have block_size=1024, this instance's block_size=1920" in str(refused)
    problems = find_mismatches(
        k3_rank(pre, 0, POISON).descriptor, k3_rank(dec, 0, POISON).descriptor
    )
    assert {(m.where, m.name) for m in problems if m.name == "block_size"} == {
        (f"group {g}", "block_size") for g in range(4)
    }
    assert {(m.where, m.name) for m in problems if m.name != "block_size"} == {
        (f"group {MLA}", "block_formats"),
        (f"group {MLA} layer 0", "block_bytes"),
    }


def test_pd_refusal_of_unequal_blocks_names_block_size_on_short_handovers(k3_dir, llama4_dir):
    pre, dec, decode, req, reads, handover = _tp_handover(
        k3_dir, llama4_dir, 2, 1, prefill_block=None, prompt_len=2500
    )
    assert (handover, reads) == (1024, [])
    refused = decode.connector._scheduler.params(req)
    assert isinstance(refused, Refused) and refused.field == "remote_block_sizes", refused
