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
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
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
from hybridkv.connector.pd_tp import spec_state_splits
from hybridkv.connector.store_staging import build_stager_pools
from hybridkv.store.geometry import CoordinatorParams, GroupGeometry
from hybridkv.store.mirror import StoreMirror
from tests.unit.k3_shape import (
    DRAFTER_WINDOW,
    MAX_MODEL_LEN,
    MLA_KERNEL_BLOCK,
    NUM_KDA_GROUPS,
    K3Shape,
    k3_shape,
    write_k3_config,
)
from tests.unit.pd_real_scheduler import pd_request, prefill_leg

NUM_SPEC = 2
KDA = list(range(NUM_KDA_GROUPS))
MLA, DRAFTER = NUM_KDA_GROUPS, NUM_KDA_GROUPS + 1
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-k3-")) / "secret"))
_LLAMA_64K = {  # the scheduler's ModelConfig only bounds lengths: a tiny local Llama config
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}


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


def _pd_scheduler(model_dir: Path, shape: K3Shape, role: str) -> Scheduler:
    """What ``EngineCore`` builds for a P/D instance over the K3 config (one step prefills
    a whole prompt: the budget holds it)."""
    block, hash_block = _resolved(shape)
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
        ),
        cache_config=CacheConfig(
            block_size=hash_block, enable_prefix_caching=True, mamba_cache_mode="align"
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=32768,
            max_num_seqs=4,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridPDConnector",
            kv_role=role,
            kv_connector_module_path="hybridkv.connector",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"auth_secret_file": SECRET},
        ),
    )
    kc = dataclasses.replace(shape.kv_cache_config, num_blocks=400)
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
    """Prefill TP2 -> decode TP1 on K3: the handshake refuses (decode recomputes, never
    reads wrong bytes). By default every group's block size differs (vLLM's alignment
    depends on TP). With --block-size 2048 pinned on the prefill, only the two attention
    groups remain: the MLA latent and the drafter's one KV head are replicated on every
    rank (per-rank heads 1 x TP 2 is not the model config's 4). The KDA groups' GDN
    state splits pair: their re-slice is accepted."""
    default = _problems(k3_dir)
    assert {(w, n) for w, n in default if n == "block_size"} == {
        (f"group {g}", "block_size") for g in range(5)
    }
    assert _problems(k3_dir, block_size=2048) == {
        (f"group {MLA}", "kv_heads"),
        (f"group {DRAFTER}", "kv_heads"),
    }


@pytest.mark.xfail(
    strict=True,
    reason=(
        "connector/pd_tp.py and pd_handshake._heterogeneous_group_mismatches model every attention "
        "group as KV heads sharded over ranks (per-rank heads x TP must equal the model config's KV "
        "heads); an MLA latent is one row per token REPLICATED on every rank (MLAAttentionSpec "
        "num_kv_heads=1 at any TP), so between TP sizes decode should read it whole from one prefill "
        "rank; today the MLA group is refused (kv_heads) and K3 P/D across TP sizes always recomputes"
    ),
)
def test_pd_across_tp_sizes_reads_the_mla_latent_from_one_rank(k3_dir):
    assert (f"group {MLA}", "kv_heads") not in _problems(k3_dir, block_size=2048)
