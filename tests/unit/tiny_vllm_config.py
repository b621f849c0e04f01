"""A real ``VllmConfig`` over a tiny local Llama checkpoint (config.json only).

Shared by the tests that compare KV identities (store keys, the P/D handshake): each
builds two configs differing in ONE field, so both must start from the same base.
"""

from __future__ import annotations

import json

import pytest
from vllm.config import CacheConfig, ModelConfig, VllmConfig

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


def tiny_vllm_config(model_dir, cache: dict | None = None, **model_kw) -> VllmConfig:
    """The tiny model's config; ``cache`` / ``model_kw`` set the one field under test."""
    kw = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": 4096,
        **model_kw,
    }
    return VllmConfig(
        model_config=ModelConfig(**kw), cache_config=CacheConfig(block_size=16, **(cache or {}))
    )
