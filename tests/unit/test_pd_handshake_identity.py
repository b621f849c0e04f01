"""The P/D handshake refuses peers whose KV identity differs (handshake version 5).

Two fp8 variants (e4m3 / e5m2) or two revisions of one checkpoint have equal block
bytes, dtypes and formats, so the geometry checks pass; only the identity
(``store.keys.kv_identity`` of a real ``VllmConfig`` over a tiny local checkpoint)
tells them apart. Each test builds two real descriptors from one real KV layout
(vLLM's own ``allocate_kv_cache``), differing ONLY in the config field under test,
and asserts the refusal names exactly that identity key; a control asserts identical
configs pass. The descriptors also cross JSON, as they do between processes.
"""

from __future__ import annotations

import json

import pytest
import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.worker.utils import allocate_kv_cache

from hybridkv.connector.block_layout import KVLayout, layout_rows
from hybridkv.connector.pd_handshake import HANDSHAKE_VERSION, LayoutDescriptor, find_mismatches
from hybridkv.store.keys import kv_identity
from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups
from tests.unit.tiny_vllm_config import model_dir, tiny_vllm_config  # noqa: F401 (model_dir: fixture)

_FIX = "both instances must serve the same model with the same --kv-cache-dtype/quantization/rope settings"


def _descriptor(vllm_config: VllmConfig) -> LayoutDescriptor:
    """One uint8 (fp8-sized) full-attention group: the same geometry for every config here."""
    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = "LBHNC"
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.uint8)
    config = get_kv_cache_config_from_groups(
        cfg, [KVCacheGroupSpec(["fa.0", "fa.1"], spec)], 1 << 20
    )
    caches = allocate_kv_cache(
        config, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout(), None
    )
    kv = KVLayout.from_kv_caches(config, caches)
    d = LayoutDescriptor.from_kv(
        kv, layout_rows(config), tp_size=1, kv_identity=kv_identity(vllm_config)
    )
    return LayoutDescriptor.from_json(d.without_addresses().to_json())  # as decode sends it


def test_identical_configs_pass(model_dir):
    a, b = _descriptor(tiny_vllm_config(model_dir)), _descriptor(tiny_vllm_config(model_dir))
    assert a.identity() == b.identity() and a.identity()["model"] == json.dumps(str(model_dir))
    assert find_mismatches(a, b) == []


def test_fp8_variants_are_refused_naming_the_cache_dtype(model_dir):
    p = _descriptor(tiny_vllm_config(model_dir, cache={"cache_dtype": "fp8_e4m3"}))
    d = _descriptor(tiny_vllm_config(model_dir, cache={"cache_dtype": "fp8_e5m2"}))
    assert p.groups == d.groups  # the geometry cannot tell them apart ...
    problems = find_mismatches(p, d)  # ... the identity does
    assert [m.field for m in problems] == ["kv_identity.kv_cache_dtype"]
    assert (
        str(problems[0])
        == f'prefill kv_identity.kv_cache_dtype="fp8_e4m3" but decode has "fp8_e5m2": {_FIX}'
    )


def test_revisions_are_refused_naming_the_revision(model_dir):
    p, d = (
        _descriptor(tiny_vllm_config(model_dir, revision="r1")),
        _descriptor(tiny_vllm_config(model_dir, revision="r2")),
    )
    problems = find_mismatches(p, d)
    assert [m.field for m in problems] == ["kv_identity.revision"]
    assert (problems[0].prefill, problems[0].decode) == ('"r1"', '"r2"')


def test_an_answer_without_identity_is_refused_naming_the_version(model_dir):
    old = _descriptor(tiny_vllm_config(model_dir)).to_json()
    del old["kv_identity"]  # what a version-4 peer sends
    with pytest.raises(ValueError, match=f"HANDSHAKE_VERSION={HANDSHAKE_VERSION}"):
        LayoutDescriptor.from_json(old)
    assert HANDSHAKE_VERSION == 9


def test_a_peer_without_a_config_is_refused(model_dir):
    """An empty identity (a worker built without one) does not match a configured peer."""
    configured = _descriptor(tiny_vllm_config(model_dir))
    bare = LayoutDescriptor(tp_size=1, groups=configured.groups)
    fields = [m.field for m in find_mismatches(configured, bare)]
    assert fields == sorted(f"kv_identity.{k}" for k in configured.identity())
