"""Store keys carry every field that changes the KV bytes or their meaning.

Each test builds two real vLLM configs (``VllmConfig`` over a tiny local checkpoint,
``KVCacheConfig`` from vLLM's own spec classes) that differ ONLY in one field and
asserts the connector's key prefixes differ; a control asserts identical configs give
identical prefixes (so a prefix that changes on every call cannot pass). Where the
field is invisible to the layout rows (fp8 variants, kv_cache_layout of equal-sized
blocks, rope) the test also asserts the rows are equal, showing why the identity or
the layout field is needed.
"""

from __future__ import annotations

import json

import pytest
import torch
from vllm.config import VllmConfig
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

from hybridkv.cli.harness.kv_manager import Geometry, fa
from hybridkv.connector.block_layout import layout_rows
from hybridkv.connector.store_keys import store_key_schema
from tests.unit.tiny_vllm_config import TINY_LLAMA, model_dir, tiny_vllm_config  # noqa: F401 (model_dir: fixture)

_KV_SCHEME = {"type": "float", "num_bits": 8, "dynamic": False, "symmetric": True}


def _kvc(spec=None, layout: str | None = "LBHNC") -> KVCacheConfig:
    cfg = Geometry(specs=[spec or fa(16)], hash_block_size=16).kv_cache_config()
    cfg.kv_cache_layout = layout
    return cfg


def _prefix(vllm_config: VllmConfig, kvc: KVCacheConfig | None = None) -> str:
    return store_key_schema(vllm_config, kvc or _kvc(), namespace="").prefix


def test_identical_configs_give_identical_prefixes(model_dir):
    assert _prefix(tiny_vllm_config(model_dir)) == _prefix(tiny_vllm_config(model_dir))


def test_model_path(model_dir, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert _prefix(tiny_vllm_config(model_dir)) != _prefix(tiny_vllm_config(tmp_path))


def test_revision(model_dir):
    assert _prefix(tiny_vllm_config(model_dir, revision="r1")) != _prefix(
        tiny_vllm_config(model_dir, revision="r2")
    )


def test_code_revision(model_dir):
    assert _prefix(tiny_vllm_config(model_dir, code_revision="c1")) != _prefix(
        tiny_vllm_config(model_dir, code_revision="c2")
    )


def test_model_dtype(model_dir):
    assert _prefix(tiny_vllm_config(model_dir)) != _prefix(
        tiny_vllm_config(model_dir, dtype="float16")
    )


def test_quantization(model_dir):
    assert _prefix(tiny_vllm_config(model_dir)) != _prefix(
        tiny_vllm_config(model_dir, quantization="fp8")
    )


@pytest.mark.parametrize(
    ("a", "b"), [("fp8", "fp8_e5m2"), ("fp8_e4m3", "fp8_e5m2"), ("fp8", "fp8_e4m3")]
)
def test_kv_cache_dtype_fp8_variants(model_dir, a, b):
    """All three store uint8 pages of one size: the layout rows cannot tell them apart."""
    va, vb = (
        tiny_vllm_config(model_dir, cache={"cache_dtype": a}),
        tiny_vllm_config(model_dir, cache={"cache_dtype": b}),
    )
    specs = [
        FullAttentionSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=32,
            dtype=kv_cache_dtype_str_to_dtype(v.cache_config.cache_dtype, v.model_config),
        )
        for v in (va, vb)
    ]
    ka, kb = _kvc(specs[0]), _kvc(specs[1])
    assert specs[0].dtype == specs[1].dtype == torch.uint8
    assert layout_rows(ka) == layout_rows(kb)
    assert _prefix(va, ka) != _prefix(vb, kb)


def test_kv_cache_dtype_skip_layers(model_dir):
    assert _prefix(tiny_vllm_config(model_dir, cache={"cache_dtype": "fp8"})) != _prefix(
        tiny_vllm_config(
            model_dir, cache={"cache_dtype": "fp8", "kv_cache_dtype_skip_layers": ["0"]}
        )
    )


def test_kv_scales_scheme_of_the_checkpoint(tmp_path):
    """Same path, same revision, the checkpoint's kv_cache_scheme says per-tensor vs per-head k/v scales."""
    prefixes = []
    for strategy in ("tensor", "attn_head"):
        quant = {
            "quant_method": "fp8",
            "activation_scheme": "static",
            "kv_cache_scheme": {**_KV_SCHEME, "strategy": strategy},
        }
        (tmp_path / "config.json").write_text(
            json.dumps({**TINY_LLAMA, "quantization_config": quant})
        )
        prefixes.append(_prefix(tiny_vllm_config(tmp_path, cache={"cache_dtype": "fp8"})))
    assert prefixes[0] != prefixes[1]


def test_rope_scaling_override(model_dir):
    plain = tiny_vllm_config(model_dir)
    scaled = tiny_vllm_config(
        model_dir, hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    )
    assert layout_rows(_kvc()) == layout_rows(_kvc())
    assert _prefix(plain) != _prefix(scaled)


def test_rope_theta_in_the_checkpoint(tmp_path):
    """The same path and revision with another rope_theta in config.json (K rotates differently)."""
    prefixes = []
    for theta in (10000.0, 500000.0):
        (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "rope_theta": theta}))
        prefixes.append(_prefix(tiny_vllm_config(tmp_path)))
    assert prefixes[0] != prefixes[1]


def test_kv_cache_layout(model_dir):
    """LBHNC vs LBNHC: equal block sizes, different byte order."""
    v = tiny_vllm_config(model_dir)
    a, b = _kvc(layout="LBHNC"), _kvc(layout="LBNHC")
    assert [r["kv_cache_layout"] for r in layout_rows(a)] == ["LBHNC"]
    assert _prefix(v, a) != _prefix(v, b)


def test_block_size(model_dir):
    v = tiny_vllm_config(model_dir)
    assert _prefix(v, _kvc(fa(16))) != _prefix(v, _kvc(fa(32)))


def test_page_size(model_dir):
    """Same block size, twice the heads: twice the page bytes."""
    v = tiny_vllm_config(model_dir)
    a, b = _kvc(fa(16, heads=1)), _kvc(fa(16, heads=2))
    assert layout_rows(a)[0]["block_size"] == layout_rows(b)[0]["block_size"] == 16
    assert layout_rows(a)[0]["page_bytes"] * 2 == layout_rows(b)[0]["page_bytes"]
    assert _prefix(v, a) != _prefix(v, b)


def test_mamba_state_dtype(model_dir):
    assert _prefix(tiny_vllm_config(model_dir, cache={"mamba_cache_dtype": "float32"})) != _prefix(
        tiny_vllm_config(model_dir, cache={"mamba_cache_dtype": "float16"})
    )


def test_deployment_secret(model_dir, tmp_path, monkeypatch):
    """Two tenants on one master, same namespace, different secrets: different keys (they
    thrashed each other's objects as forgeries before); the same secret shares keys; no
    secret keeps the prefix it had; the id does not contain the secret."""
    from hybridkv.connector.pd_auth import SECRET_ENV, SECRET_FILE_ENV, write_secret_file
    from hybridkv.connector.store_auth import StoreSecret
    from hybridkv.connector.store_config import StoreConnectorConfig

    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    v = tiny_vllm_config(model_dir)

    def prefix(cfg: StoreConnectorConfig) -> str:
        return store_key_schema(
            v, _kvc(), namespace="team", tenant=StoreSecret.load(cfg).tenant
        ).prefix

    a, b = write_secret_file(tmp_path / "a"), write_secret_file(tmp_path / "b")
    with_a, with_b = (
        StoreConnectorConfig(auth_secret_file=str(a)),
        StoreConnectorConfig(auth_secret_file=str(b)),
    )
    none = StoreConnectorConfig()
    assert StoreSecret.load(none).tenant == ""
    assert prefix(none) == store_key_schema(v, _kvc(), namespace="team").prefix
    assert prefix(with_a) == prefix(StoreConnectorConfig(auth_secret_file=str(a)))
    assert len({prefix(none), prefix(with_a), prefix(with_b)}) == 3
    tenant = StoreSecret.load(with_a).tenant
    assert (
        len(tenant) == 16
        and tenant not in a.read_bytes().hex()
        and tenant.encode() not in a.read_bytes()
    )
    monkeypatch.setenv(SECRET_FILE_ENV, str(a))  # the env var names the same secret: same keys
    assert prefix(none) == prefix(with_a)
