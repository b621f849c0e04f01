"""Write tiny hybrid-attention checkpoints for tests that run the real vLLM engine.

No model hub is reachable from the test machines, so every model the end-to-end tests
boot is written here: a ``config.json`` and a ``model.safetensors`` with seeded random
bf16 weights, plus a small offline-trained tokenizer (:mod:`hybridkv.cli.harness.tiny_tokenizer`)
so the OpenAI server can take text. The end-to-end tests may still run with
``skip_tokenizer_init=True`` and token-id prompts.

Why not ``load_format="dummy"``: vLLM's dummy weights are uniform in [-1e-3, 1e-3], so
attention is nearly uniform and the output barely depends on the context. A check such as
"output with loaded KV == output with recomputed KV" then passes even when a block of KV
is wrong. The weights written here are scaled so that the context matters:

* every RMSNorm keeps gain 1 (so activations stay O(1) through the layers), except the
  per-head q/k norms, whose gain ``_QK_GAIN`` makes the attention logits a few units wide
  instead of ~1, so each query attends to a few keys rather than to all of them evenly;
* projections are normal with std ``1/sqrt(fan_in)``, so each layer's output is as large
  as its input and a change anywhere in the context propagates instead of vanishing;
* LM heads are untied from the embeddings (a tied random head keeps predicting the
  current token: greedy output was one token repeated 16 times);
* the output rows of the special tokens (pad/eos/bos = 0/1/2) are zero, so greedy decoding
  never emits EOS and outputs always have the requested length.

Kinds (each yields a distinct hybrid KV-cache layout in vLLM 0.32):

* ``gemma3``: ``Gemma3ForCausalLM`` (text), sliding-window + full attention layers
  -> a SlidingWindowSpec group and a FullAttentionSpec group.
* ``qwen3next``: ``Qwen3NextForCausalLM``, Gated-DeltaNet linear attention + full
  attention -> MambaSpec groups + a FullAttentionSpec group. vLLM requires at least one
  MoE layer for this architecture, so every second layer is MoE.
* ``gemma4``: ``Gemma4ForCausalLM`` (text), one sliding layer and two full layers with
  different head sizes -> two FullAttentionSpec groups at different block sizes.

Drafter kinds (``DRAFTER_KINDS``; not servable alone, passed to vLLM as
``speculative_config={"method": "eagle", "model": DIR, ...}`` next to their target):

* ``eagle-gemma3``: an EAGLE-1 head (``EagleLlamaForCausalLM``, one Llama layer) for the
  ``gemma3`` target, with head_dim 128 where the target has 64. Its per-token KV bytes
  are twice the target's, so vLLM gives the drafter layer half the block size (128 vs
  256) and keeps it in a KV cache group of its own: a full-attention group at another
  block size than the target's. No ``embed_tokens``/``lm_head`` in the checkpoint: vLLM
  shares the target's.
* ``eagle-gemma4``: the same head for the ``gemma4`` target (equal hidden size and vocab),
  with one KV head of 64 where the target's layers have two: half the target's smallest
  per-token KV bytes, so vLLM gives the drafter layer twice the largest target block (512)
  in a group of its own (a spec equal to a target layer's would join that layer's group).
* ``eagle-qwen3next``: the same head for the ``qwen3next`` target, head_dim 128 (target 64):
  a drafter full-attention group at another block size next to the Mamba groups.

Usage: ``python -m hybridkv.cli.harness.tiny_models KIND OUT_DIR [--seed N]``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import pathlib
import zlib
from collections.abc import Callable

import torch
from safetensors.torch import save_file

from hybridkv.cli.harness.tiny_tokenizer import write_tiny_tokenizer

__all__ = [
    "DRAFTER_KINDS",
    "KINDS",
    "pinned_engine_args",
    "pinned_server_args",
    "write_tiny_model",
    "main",
]

# Bump when the config or the initialisation changes, so stale folders are rewritten.
_FORMAT_VERSION = 3  # 2: a tokenizer is written too; 3: qwen3next uses all experts
_STAMP = ".hybridkv_tiny_model.json"

_VOCAB = 2048
_HIDDEN = 256
_MAX_LEN = 4096
# Gain of the per-head q/k RMSNorms. With unit-RMS q and k the scaled dot product has
# std ~1 over the keys; the gain multiplies it by _QK_GAIN**2 (~4 here), which makes
# attention peaked enough that single tokens far back in the prompt change the output.
_QK_GAIN = 2.0
# Qwen3-Next has no post-norms, so the raw embedding stays in the residual stream; at std 1
# it dominates and the model acts like a bigram model (one changed token 5 positions into
# a 1000-token prompt changed 0/16 greedy tokens). At 0.25 the context wins (13/16).
_QWEN_EMBED_STD = 0.25
_SPECIAL_TOKENS = (0, 1, 2)  # pad, eos, bos
# Keys every kind's config.json carries alike.
_COMMON_CONFIG = {
    "pad_token_id": _SPECIAL_TOKENS[0],
    "eos_token_id": _SPECIAL_TOKENS[1],
    "bos_token_id": _SPECIAL_TOKENS[2],
    "torch_dtype": "bfloat16",
    "use_cache": True,
}

# A recipe for one tensor: shape and how to fill it.
_Init = tuple[tuple[int, ...], Callable[[torch.Generator, tuple[int, ...]], torch.Tensor]]


def _normal(std: float) -> Callable[[torch.Generator, tuple[int, ...]], torch.Tensor]:
    return lambda g, shape: torch.randn(shape, generator=g) * std


def _const(value: float) -> Callable[[torch.Generator, tuple[int, ...]], torch.Tensor]:
    return lambda g, shape: torch.full(shape, float(value))


def _linear(out_f: int, in_f: int) -> _Init:
    """A weight of shape [out, in] whose output has the scale of its input."""
    return (out_f, in_f), _normal(1.0 / math.sqrt(in_f))


def _output_rows(vocab: int, hidden: int, std: float) -> _Init:
    """Embedding/LM-head rows; special tokens get zero rows so they are never predicted."""

    def fill(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.randn(shape, generator=g) * std
        t[list(_SPECIAL_TOKENS)] = 0.0
        return t

    return (vocab, hidden), fill


# Norms in Gemma3 and Qwen3-Next are "1 + weight" (GemmaRMSNorm): gain 1 is weight 0.
def _gemma_norm(dim: int, gain: float = 1.0) -> _Init:
    return (dim,), _const(gain - 1.0)


# Norms in Gemma4 (and Qwen3-Next's gated GDN norm) multiply by the weight: gain = weight.
def _plain_norm(dim: int, gain: float = 1.0) -> _Init:
    return (dim,), _const(gain)


# ---------------------------------------------------------------------------- gemma3


def _attention_and_mlp(
    t: dict[str, _Init],
    p: str,
    h: int,
    nq: int,
    nkv: int,
    d: int,
    inter: int,
    qk_norm: _Init | None,
) -> None:
    """One decoder layer's attention and gated-MLP projections (Llama/Gemma/Qwen names)."""
    t[p + "self_attn.q_proj.weight"] = _linear(nq * d, h)
    t[p + "self_attn.k_proj.weight"] = _linear(nkv * d, h)
    t[p + "self_attn.v_proj.weight"] = _linear(nkv * d, h)
    t[p + "self_attn.o_proj.weight"] = _linear(h, nq * d)
    if qk_norm is not None:
        t[p + "self_attn.q_norm.weight"] = qk_norm
        t[p + "self_attn.k_norm.weight"] = qk_norm
    t[p + "mlp.gate_proj.weight"] = _linear(inter, h)
    t[p + "mlp.up_proj.weight"] = _linear(inter, h)
    t[p + "mlp.down_proj.weight"] = _linear(h, inter)


def _gemma3_config() -> dict:
    head_dim = 64
    layer_types = ["sliding_attention", "full_attention"] * 2
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": 512,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        # Gemma scales queries by query_pre_attn_scalar**-0.5; head_dim gives the usual
        # 1/sqrt(d) so that _QK_GAIN alone sets the attention temperature.
        "query_pre_attn_scalar": head_dim,
        "sliding_window": 128,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "max_position_embeddings": _MAX_LEN,
        "rope_parameters": {
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        # Untied: with a tied head the input token's own embedding, still large in the
        # residual stream, makes every random model predict its last token forever.
        "tie_word_embeddings": False,
        "use_bidirectional_attention": False,
        **_COMMON_CONFIG,
    }


def _gemma3_tensors(cfg: dict) -> dict[str, _Init]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nq, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    # The embedding is multiplied by sqrt(hidden) in the forward pass: std 1/sqrt(hidden)
    # gives O(1) residual entries. The LM head is untied (see the config) and scaled for
    # logits of std ~1.
    t: dict[str, _Init] = {
        "model.embed_tokens.weight": ((cfg["vocab_size"], h), _normal(1.0 / math.sqrt(h))),
        "model.norm.weight": _gemma_norm(h),
        "lm_head.weight": _output_rows(cfg["vocab_size"], h, 1.0 / math.sqrt(h)),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        _attention_and_mlp(t, p, h, nq, nkv, d, inter, _gemma_norm(d, _QK_GAIN))
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            t[p + f"{norm}_layernorm.weight"] = _gemma_norm(h)
    return t


# ------------------------------------------------------------------------- qwen3next


def _qwen3next_config() -> dict:
    layer_types = ["linear_attention", "full_attention"] * 2
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        # MoE on every second layer (layers 1 and 3); vLLM refuses a Qwen3-Next without
        # any MoE layer, and the dense layers keep the plain MLP path exercised too.
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
        "num_experts": 4,
        # Every token uses every expert: with top-2 of 4, near-tied router logits flip
        # the expert choice between a cached run and a recompute (a 0.37 logprob jump
        # seen in the demo), which is noise for an exact-match KV check.
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "intermediate_size": 512,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": _MAX_LEN,
        "tie_word_embeddings": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        **_COMMON_CONFIG,
    }


def _qwen3next_tensors(cfg: dict) -> dict[str, _Init]:
    h = cfg["hidden_size"]
    nq, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    key_dim = nk * cfg["linear_key_head_dim"]
    value_dim = nv * cfg["linear_value_head_dim"]
    kernel = cfg["linear_conv_kernel_dim"]
    t: dict[str, _Init] = {
        # No embedding scaling and no post-norms in Qwen3-Next: small embeddings keep the
        # current token from dominating the residual stream over what the layers read
        # from the context. LM head scaled for logits of std ~1.
        "model.embed_tokens.weight": ((cfg["vocab_size"], h), _normal(_QWEN_EMBED_STD)),
        "model.norm.weight": _gemma_norm(h),
        "lm_head.weight": _output_rows(cfg["vocab_size"], h, 1.0 / math.sqrt(h)),
    }
    for i, layer_type in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = _gemma_norm(h)
        t[p + "post_attention_layernorm.weight"] = _gemma_norm(h)
        if layer_type == "full_attention":
            # q_proj also produces the sigmoid output gate (attn_output_gate), hence 2x.
            t[p + "self_attn.q_proj.weight"] = _linear(2 * nq * d, h)
            t[p + "self_attn.k_proj.weight"] = _linear(nkv * d, h)
            t[p + "self_attn.v_proj.weight"] = _linear(nkv * d, h)
            t[p + "self_attn.o_proj.weight"] = _linear(h, nq * d)
            t[p + "self_attn.q_norm.weight"] = _gemma_norm(d, _QK_GAIN)
            t[p + "self_attn.k_norm.weight"] = _gemma_norm(d, _QK_GAIN)
        else:
            a = p + "linear_attn."
            t[a + "in_proj_qkvz.weight"] = _linear(2 * key_dim + 2 * value_dim, h)
            t[a + "in_proj_ba.weight"] = _linear(2 * nv, h)
            conv_channels = 2 * key_dim + value_dim
            t[a + "conv1d.weight"] = ((conv_channels, 1, kernel), _normal(1.0 / math.sqrt(kernel)))
            # Decay rate A in [1, 16] and a small dt (softplus(dt_bias) ~ 0.001-0.1) as in
            # the reference init: per-token decay 0.2-0.999, so the state keeps a memory.
            t[a + "A_log"] = ((nv,), _log_uniform_a())
            t[a + "dt_bias"] = ((nv,), _inv_softplus_dt())
            t[a + "norm.weight"] = _plain_norm(cfg["linear_value_head_dim"])
            t[a + "out_proj.weight"] = _linear(h, value_dim)
        if (i + 1) % cfg["decoder_sparse_step"] == 0 and i not in cfg["mlp_only_layers"]:
            m, inter = p + "mlp.", cfg["moe_intermediate_size"]
            t[m + "gate.weight"] = _linear(cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                t[m + f"experts.{e}.gate_proj.weight"] = _linear(inter, h)
                t[m + f"experts.{e}.up_proj.weight"] = _linear(inter, h)
                t[m + f"experts.{e}.down_proj.weight"] = _linear(h, inter)
            s_inter = cfg["shared_expert_intermediate_size"]
            t[m + "shared_expert.gate_proj.weight"] = _linear(s_inter, h)
            t[m + "shared_expert.up_proj.weight"] = _linear(s_inter, h)
            t[m + "shared_expert.down_proj.weight"] = _linear(h, s_inter)
            t[m + "shared_expert_gate.weight"] = _linear(1, h)
        else:
            inter = cfg["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = _linear(inter, h)
            t[p + "mlp.up_proj.weight"] = _linear(inter, h)
            t[p + "mlp.down_proj.weight"] = _linear(h, inter)
    return t


def _log_uniform_a() -> Callable[[torch.Generator, tuple[int, ...]], torch.Tensor]:
    """A_log = log(A) with A uniform in [1, 16], as in the reference initialisation."""
    return lambda g, shape: torch.log(1.0 + 15.0 * torch.rand(shape, generator=g))


def _inv_softplus_dt() -> Callable[[torch.Generator, tuple[int, ...]], torch.Tensor]:
    def fill(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
        lo, hi = math.log(0.001), math.log(0.1)
        dt = torch.exp(lo + (hi - lo) * torch.rand(shape, generator=g))
        return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)

    return fill


# ---------------------------------------------------------------------------- gemma4


def _gemma4_config() -> dict:
    # Layer 1 has head_dim 128, layer 2 head_dim 64: equal per-token bytes are impossible,
    # so vLLM equalises page sizes by giving the two full-attention layers different block
    # sizes, which keeps them in two FullAttentionSpec groups. (A model with only
    # full-attention layers would be merged into one group; the sliding layer prevents it.)
    layer_types = ["sliding_attention", "full_attention", "full_attention"]
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": _VOCAB,
        "vocab_size_per_layer_input": _VOCAB,
        "hidden_size": _HIDDEN,
        "hidden_size_per_layer_input": 0,
        "intermediate_size": 512,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "per_layer_config": {"1": {"head_dim": 128}},
        "sliding_window": 64,
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "final_logit_softcapping": None,
        "max_position_embeddings": _MAX_LEN,
        "rope_parameters": {
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": False,
        "use_bidirectional_attention": None,
        **_COMMON_CONFIG,
    }


def _gemma4_tensors(cfg: dict) -> dict[str, _Init]:
    h, inter, nq = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    t: dict[str, _Init] = {
        "model.embed_tokens.weight": ((cfg["vocab_size"], h), _normal(1.0 / math.sqrt(h))),
        "model.norm.weight": _plain_norm(h),
        "lm_head.weight": _output_rows(cfg["vocab_size"], h, 1.0 / math.sqrt(h)),
    }
    for i in range(cfg["num_hidden_layers"]):
        layer = {**cfg, **cfg["per_layer_config"].get(str(i), {})}
        d, nkv = layer["head_dim"], layer["num_key_value_heads"]
        # Gemma4 attends with scaling 1.0 (no 1/sqrt(d)): unit-RMS q, k give logits of std
        # sqrt(d). A q/k gain of _QK_GAIN / d**0.25 brings that back to _QK_GAIN**2, the
        # same temperature as the other kinds, for either head size.
        qk_gain = _QK_GAIN / d**0.25
        p = f"model.layers.{i}."
        _attention_and_mlp(t, p, h, nq, nkv, d, inter, _plain_norm(d, qk_gain))
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            t[p + f"{norm}_layernorm.weight"] = _plain_norm(h)
        t[p + "layer_scalar"] = ((1,), _const(1.0))
    return t


# ---------------------------------------------------------------- eagle drafter


def _eagle_gemma3_config() -> dict:
    # EAGLE-1 head for the gemma3 target: hidden and vocab must equal the target's (the
    # head reads the target's hidden states and shares its embedding and LM head).
    # head_dim 128 (target: 64) doubles the per-token KV bytes of the drafter layer, so
    # vLLM equalises page sizes with a smaller block and the drafter's full-attention
    # layer gets its own KV cache group.
    target = _gemma3_config()
    return {
        "architectures": ["EagleLlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": target["vocab_size"],
        "hidden_size": target["hidden_size"],
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": _MAX_LEN,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        **_COMMON_CONFIG,
    }


def _eagle_gemma4_config() -> dict:
    return {**_eagle_gemma3_config(), "num_key_value_heads": 1, "head_dim": 64}


def _eagle_qwen3next_config() -> dict:
    target = _qwen3next_config()
    return {
        **_eagle_gemma3_config(),
        "vocab_size": target["vocab_size"],
        "hidden_size": target["hidden_size"],
    }


def _eagle_llama_tensors(cfg: dict) -> dict[str, _Init]:
    # EAGLE-1 checkpoint names (vLLM prefixes "model."): fc mixes [embedding, target
    # hidden state]; layer 0 has no input_layernorm (vLLM replaces it by Identity) and
    # the head has no final norm. Llama norms multiply by the weight: gain 1 = weight 1.
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nq, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t: dict[str, _Init] = {"fc.weight": _linear(h, 2 * h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        _attention_and_mlp(t, p, h, nq, nkv, d, inter, None)
        if i > 0:
            t[p + "input_layernorm.weight"] = _plain_norm(h)
        t[p + "post_attention_layernorm.weight"] = _plain_norm(h)
    return t


# ------------------------------------------------------------------------- qwen3 (dense)
def _qwen3_config() -> dict:
    """Full attention only (one KV-cache group, 16 KiB of KV per token): the common ground
    with connectors that are not hybrid-aware (bench/pd_vs_nixl_connector.py)."""
    layers = 4
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": 512,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "tie_word_embeddings": False,
        **_COMMON_CONFIG,
    }


def _qwen3_tensors(cfg: dict) -> dict[str, _Init]:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv, inter = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
    )
    t: dict[str, _Init] = {
        "model.embed_tokens.weight": _output_rows(cfg["vocab_size"], h, 1.0),
        "lm_head.weight": _output_rows(cfg["vocab_size"], h, 1.0 / math.sqrt(h)),
        "model.norm.weight": _plain_norm(h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        _attention_and_mlp(t, p, h, nq, nkv, d, inter, _plain_norm(d, _QK_GAIN))
        t[p + "input_layernorm.weight"] = _plain_norm(h)
        t[p + "post_attention_layernorm.weight"] = _plain_norm(h)
    return t


_Builder = tuple[Callable[[], dict], Callable[[dict], dict[str, _Init]]]
_BUILDERS: dict[str, _Builder] = {
    "gemma3": (_gemma3_config, _gemma3_tensors),
    "qwen3next": (_qwen3next_config, _qwen3next_tensors),
    "gemma4": (_gemma4_config, _gemma4_tensors),
    "qwen3": (_qwen3_config, _qwen3_tensors),
}
# Speculative-decoding heads: written like the targets, served only next to theirs.
_DRAFTERS: dict[str, _Builder] = {
    "eagle-gemma3": (_eagle_gemma3_config, _eagle_llama_tensors),
    "eagle-gemma4": (_eagle_gemma4_config, _eagle_llama_tensors),
    "eagle-qwen3next": (_eagle_qwen3next_config, _eagle_llama_tensors),
}
KINDS: tuple[str, ...] = tuple(_BUILDERS)
DRAFTER_KINDS: tuple[str, ...] = tuple(_DRAFTERS)


# ---------------------------------------------------------------------------- writer


def _tensor_seed(seed: int, name: str) -> int:
    """One generator per tensor, keyed by name: a tensor's values do not depend on which
    other tensors exist or on their order."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _stamp_for(kind: str, seed: int) -> dict:
    return {"kind": kind, "seed": seed, "format_version": _FORMAT_VERSION}


def _is_current(out: pathlib.Path, kind: str, seed: int) -> bool:
    try:
        stamp = json.loads((out / _STAMP).read_text())
    except (OSError, ValueError):
        return False
    files_present = all(
        (out / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")
    )
    return files_present and stamp == _stamp_for(kind, seed)


# What the tiny models pin so that every x86 CPU runs them with the same state dtypes (the CPU
# kernels themselves still differ: AVX-512 or AVX2 builds, GDN backends).
# Gated-DeltaNet's SSM state: vLLM 0.32's CPU platform keeps 'auto' (= the model's bf16)
# unless the CPU has AVX512-BF16, where it resets 'auto' to float32 for its accelerated GDN
# kernel (vllm/platforms/cpu.py). The tests' numbers were set on such CPUs (Intel, AMX); on an
# AMD EPYC without AVX-512 (2026-12-03) the state was bf16: a TP state-layout check saw 8192-
# byte SSM rows instead of 16384, and two planted-fault controls lost to near-ties. float32,
# set explicitly, is what every CPU then uses (the platform leaves an explicit float32 alone).
_LINEAR_ATTENTION_PINS = {"mamba_ssm_cache_dtype": "float32"}


def pinned_engine_args(model_dir: str | os.PathLike) -> dict[str, str]:
    """Engine arguments (LLM keyword names) a tiny model written here is run with on every CPU:
    float32 Gated-DeltaNet SSM state for a model with linear attention (see above); {} for
    any other folder, a model not written by write_tiny_model included."""
    out = pathlib.Path(model_dir)
    try:
        json.loads((out / _STAMP).read_text())
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if "linear_attention" in (config.get("layer_types") or []):
        return dict(_LINEAR_ATTENTION_PINS)
    return {}


def pinned_server_args(model_dir: str | os.PathLike) -> list[str]:
    """pinned_engine_args as `vllm serve` flags (--mamba-ssm-cache-dtype float32)."""
    return [
        a for k, v in pinned_engine_args(model_dir).items() for a in ("--" + k.replace("_", "-"), v)
    ]


def write_tiny_model(kind: str, out_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Write the tiny ``kind`` model into ``out_dir`` and return the folder.

    Idempotent: when ``out_dir`` already holds this kind, seed and format version (a stamp
    file written last), nothing is rewritten. The stamp is removed first and written only
    after both files are complete, so an interrupted write is redone on the next call.
    """
    builders = {**_BUILDERS, **_DRAFTERS}
    if kind not in builders:
        raise ValueError(
            f"unknown tiny model kind {kind!r}; choose one of {', '.join(KINDS + DRAFTER_KINDS)}"
        )
    out = pathlib.Path(out_dir)
    if _is_current(out, kind, seed):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One writer at a time (the test suite's two lanes, two engines of a demo): without the
    # lock two processes share model.safetensors.tmp and the second os.replace finds it gone.
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_current(out, kind, seed):  # another process may have written it meanwhile
            _write(out, kind, seed, builders)
    return out


def _write(out: pathlib.Path, kind: str, seed: int, builders: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / _STAMP).unlink(missing_ok=True)

    make_config, make_tensors = builders[kind]
    config = make_config()
    tensors = {}
    for name, (shape, fill) in sorted(make_tensors(config).items()):
        g = torch.Generator().manual_seed(_tensor_seed(seed, name))
        tensors[name] = fill(g, shape).to(torch.bfloat16).contiguous()

    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)  # safetensors creates the file 0600; other users/containers may read it
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tiny_tokenizer(out, config["vocab_size"])
    (out / _STAMP).write_text(json.dumps(_stamp_for(kind, seed)) + "\n")


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m hybridkv.cli.harness.tiny_models KIND OUT_DIR [--seed N]``; prints the folder."""
    parser = argparse.ArgumentParser(
        prog="python -m hybridkv.cli.harness.tiny_models", description=__doc__.splitlines()[0]
    )
    parser.add_argument("kind", choices=KINDS + DRAFTER_KINDS)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_tiny_model(args.kind, args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
