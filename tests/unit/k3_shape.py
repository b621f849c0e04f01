"""The Kimi-K3 cache shape, built by vLLM's own functions (no engine).

Kimi-K3 is MLA attention + KDA linear attention (+ a drafter). vLLM picks the
attention (manager) block so that one MLA page holds at least one KDA state
(``Platform._align_hybrid_block_size``, rounded to 128 tokens for MLA) and pads the
KDA page to it; ``get_kv_cache_configs`` then groups the layers and equalises the
drafter's page by giving it another block size. Everything here comes from those
functions over a local config.json with K3's dimensions (MLA latent 512 + 64 rope,
KDA 32 heads x 128, conv kernel 4): only the layer counts are small.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec, MLAAttentionSpec

from hybridkv.connector.block_layout import KVLayout
from hybridkv.connector.pd_handshake import LayoutDescriptor
from hybridkv.store.vllm_compat import get_kv_cache_configs, mamba_state_alignment

K3_TEXT_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 32000,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "max_position_embeddings": 65536,
    "torch_dtype": "bfloat16",
    "linear_attn_config": {
        "kda_layers": [1],
        "full_attn_layers": [2],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}
MAX_MODEL_LEN = 65536
NUM_KDA_GROUPS = 3  # K3 has three KDA layers per MLA layer: three Mamba groups, one MLA group
DRAFTER_WINDOW = 2048
# The drafter's layer: half the MLA latent's bytes per token, so vLLM gives it twice the block.
DRAFTER_HEADS, DRAFTER_HEAD_SIZE = 1, 144
# FlashMLA's kernel block under the large manager block.
MLA_KERNEL_BLOCK = 64


def write_k3_config(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(K3_TEXT_CONFIG))
    return directory


def k3_vllm_config(
    model_dir: Path,
    num_speculative_tokens: int,
    tp_size: int = 1,
    max_model_len: int = MAX_MODEL_LEN,
    block_size: int | None = None,
) -> VllmConfig:
    """The target's ``VllmConfig`` after vLLM aligned its block size to the KDA state.

    ``Platform._align_hybrid_block_size`` reads ``speculative_config.num_speculative_tokens``
    (through ``KimiLinearForCausalLM.get_mamba_state_shape_from_config``: each draft token
    adds a conv-state row); a draft model's own config is not needed for that, so a
    namespace carrying the count stands in while vLLM sizes the block. ``block_size``: the
    user's ``--block-size`` (vLLM raises it only if a KDA state does not fit)."""
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend

    model = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=max_model_len,
    )
    cfg = VllmConfig(model_config=model, cache_config=CacheConfig(enable_prefix_caching=False))
    cfg.cache_config.enable_prefix_caching = True
    cfg.cache_config.mamba_cache_mode = "align"
    cfg.cache_config.kv_cache_layout = "LBHNC"
    cfg.parallel_config.tensor_parallel_size = tp_size
    if block_size is not None:
        cfg.cache_config.block_size = block_size
    if num_speculative_tokens:
        cfg.speculative_config = types.SimpleNamespace(
            num_speculative_tokens=num_speculative_tokens
        )
    try:
        Platform._align_hybrid_block_size(cfg, FlashMLABackend)
    finally:
        cfg.speculative_config = None
    return cfg


@dataclass
class K3Shape:
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    num_speculative_tokens: int
    tp_size: int

    @property
    def manager_block(self) -> int:
        return self.vllm_config.cache_config.block_size

    def group_ids(self, kind: type) -> list[int]:
        return [
            g
            for g, grp in enumerate(self.kv_cache_config.kv_cache_groups)
            if type(grp.kv_cache_spec) is kind
        ]


def k3_layer_specs(
    cfg: VllmConfig, num_speculative_tokens: int, tp_size: int = 1
) -> dict[str, object]:
    """Per layer, the spec each K3 layer reports (what ``get_kv_cache_spec`` builds)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    model_cls, _ = ModelRegistry.resolve_model_cls(
        cfg.model_config.architecture, model_config=cfg.model_config
    )
    spec_cfg = (
        types.SimpleNamespace(num_speculative_tokens=num_speculative_tokens)
        if num_speculative_tokens
        else None
    )
    shape_cfg = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp_size),
        model_config=cfg.model_config,
        speculative_config=spec_cfg,
        cache_config=cfg.cache_config,
    )
    block = cfg.cache_config.block_size
    kda = MambaSpec(
        block_size=cfg.cache_config.mamba_block_size,
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(shape_cfg)),
        dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(shape_cfg)),
        page_size_padded=cfg.cache_config.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,  # vLLM's KDA layer is a GDN subclass
        mamba_cache_mode="align",
        num_speculative_blocks=num_speculative_tokens,
    )
    specs: dict[str, object] = {f"model.layers.{i}.self_attn": kda for i in range(NUM_KDA_GROUPS)}
    specs[f"model.layers.{NUM_KDA_GROUPS}.self_attn.attn"] = MLAAttentionSpec(
        block_size=block,
        num_kv_heads=1,
        head_size=cfg.model_config.get_head_size(),
        dtype=torch.bfloat16,
        cache_dtype_str="auto",
    )
    if num_speculative_tokens:
        specs[f"model.layers.{NUM_KDA_GROUPS + 1}.self_attn.attn"] = FullAttentionSpec(
            block_size=block,
            num_kv_heads=DRAFTER_HEADS,
            head_size=DRAFTER_HEAD_SIZE,
            dtype=torch.bfloat16,
            sliding_window=DRAFTER_WINDOW,
        )
    return specs


def k3_shape(
    model_dir: Path,
    num_speculative_tokens: int,
    num_blocks: int = 64,
    tp_size: int = 1,
    max_model_len: int = MAX_MODEL_LEN,
    block_size: int | None = None,
) -> K3Shape:
    """vLLM's KV cache config for the K3 shape with room for ``num_blocks`` blocks of
    every layer (``max_model_len``: vLLM refuses memory for less than one such request)."""
    cfg = k3_vllm_config(model_dir, num_speculative_tokens, tp_size, max_model_len, block_size)
    specs = k3_layer_specs(cfg, num_speculative_tokens, tp_size)
    page = max(s.page_size_bytes for s in specs.values())
    config = get_kv_cache_configs(cfg, [specs], [num_blocks * page * len(specs)])[0]
    return K3Shape(cfg, config, num_speculative_tokens, tp_size)


# ---------------------------------------------------------------------- one TP rank's cache

KDA_PROJECTION = 32 * 128  # linear_attn_config num_heads x head_dim: q, k and v each


@dataclass
class K3Rank:
    """One TP rank's K3 KV cache as vLLM allocates it (FlashMLA's 64-token kernel blocks
    under the MLA manager block, whole blocks for KDA; every group overlays one backing
    allocation, ``raw``), and the handshake layout its P/D worker sends."""

    shape: K3Shape
    rank: int
    tensors: dict[str, torch.Tensor]
    raw: torch.Tensor
    descriptor: LayoutDescriptor

    @property
    def layout(self) -> KVLayout:
        return KVLayout.from_kv_caches(self.shape.kv_cache_config, self.tensors)

    def page(self, gid: int, block: int) -> torch.Tensor:
        """The bytes of block ``block`` of group ``gid``'s layer (vLLM's placement:
        ``offset + layer * layer_stride + block * block_stride``)."""
        kc = self.shape.kv_cache_config
        name = kc.kv_cache_groups[gid].layer_names[0]
        spec = kc.kv_cache_groups[gid].kv_cache_spec
        t = next(t for t in kc.kv_cache_tensors if name in t.layers)
        start = t.offset + t.layers.index(name) * t.layer_stride + block * t.block_stride
        return self.raw[start : start + spec.page_size_bytes]

    def states(self, gid: int) -> tuple[torch.Tensor, ...]:
        """A KDA group's (conv, recurrent) state views over every block, unpacked from the
        pages by vLLM's own ``MambaBase.bind_kv_cache``."""
        from vllm.model_executor.layers.mamba.abstract import MambaBase

        kc = self.shape.kv_cache_config
        spec = kc.kv_cache_groups[gid].kv_cache_spec
        first, second = self.page(gid, 0), self.page(gid, 1)
        stride = second.data_ptr() - first.data_ptr()
        start = first.data_ptr() - self.raw.data_ptr()
        pages = self.raw[start : start + kc.num_blocks * stride].view(kc.num_blocks, 1, 1, stride)
        layer = types.SimpleNamespace(
            get_state_shape=lambda: spec.shapes,
            get_state_dtype=lambda: spec.dtypes,
            state_alignment=mamba_state_alignment(spec),
        )
        MambaBase.bind_kv_cache(layer, pages)
        return layer.kv_cache


def k3_rank(shape: K3Shape, rank: int, poison: int) -> K3Rank:
    """Rank ``rank`` of ``shape``'s TP size, every byte ``poison``; its descriptor built as
    ``PDWorker.register_kv_caches`` builds it (per-rank KV heads, the model's KV heads,
    each KDA group's state splits, head-major packing)."""
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybridkv.connector.block_layout import layer_specs, layout_rows
    from hybridkv.connector.pd_worker import group_head_slots, group_state_splits

    kc = shape.kv_cache_config
    kernel = [
        g.kv_cache_spec.block_size if isinstance(g.kv_cache_spec, MambaSpec) else MLA_KERNEL_BLOCK
        for g in kc.kv_cache_groups
    ]
    tensors = allocate_kv_cache(
        kc,
        torch.device("cpu"),
        shape.vllm_config.cache_config.get_resolved_kv_cache_layout(),
        kernel,
    )
    first = next(iter(tensors.values()))
    raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
    assert all(t.untyped_storage().data_ptr() == raw.data_ptr() for t in tensors.values())
    raw.fill_(poison)
    descriptor = LayoutDescriptor.from_kv(
        KVLayout.from_kv_caches(kc, tensors),
        layout_rows(kc),
        shape.tp_size,
        kv_heads=[
            int(getattr(layer_specs(g)[0], "num_kv_heads", 0) or 0) for g in kc.kv_cache_groups
        ],
        total_kv_heads=shape.vllm_config.model_config.get_total_num_kv_heads(),
        state_splits=[group_state_splits(g) for g in kc.kv_cache_groups],
        head_slots=[group_head_slots(g) for g in kc.kv_cache_groups],
    )
    return K3Rank(shape, rank, tensors, raw, descriptor)


def kda_share(tp: int, rank: int, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """(conv channels, recurrent heads) of a TP1 KDA state that rank ``rank`` of TP ``tp``
    holds, as vLLM's weight loading gives them: the fused q|k|v conv1d loader of
    ``kimi_gdn_linear_attn`` (``_make_fused_conv1d_weight_loader``) applied to a weight
    whose row i is i, and ``sharded_weight_loader(0)`` (``dt_bias``: one value per head)."""
    from vllm.model_executor.layers.mamba.gdn import kimi_gdn_linear_attn as kda
    from vllm.model_executor.model_loader import weight_utils

    channels = torch.full((3 * KDA_PROJECTION // tp, 1, 1), -1.0)
    loader = kda._make_fused_conv1d_weight_loader([KDA_PROJECTION] * 3, tp, rank)
    for shard in range(3):
        loader(
            channels,
            torch.arange(KDA_PROJECTION, dtype=torch.float32)[:, None, None]
            + shard * KDA_PROJECTION,
            shard,
        )
    monkeypatch.setattr(weight_utils, "get_tensor_model_parallel_rank", lambda: rank)
    heads = torch.full((32 // tp,), -1.0)
    weight_utils.sharded_weight_loader(0)(heads, torch.arange(32, dtype=torch.float32))
    assert bool((channels >= 0).all()) and bool((heads >= 0).all())
    return channels[:, 0, 0].long(), heads.long()
