"""The connector side and the store side decide truncation with ONE predicate.

Not a textual check: custom specs registered with vLLM's KVCacheSpecRegistry
flip the predicate, and both the connector's dense-reference reconciliation and
the store mirror change their answers together.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from hybridkv.cli.harness.kv_manager import Geometry, fa, make_request, mamba
from hybridkv.connector.dense_reference import reconcile_dense_hits
from hybridkv.store.geometry import GroupGeometry
from hybridkv.store.mirror import StoreMirror
from hybridkv.store.truncation import is_downward_closed


@dataclass(frozen=True, kw_only=True)
class PrefixScanProbeSpec(FullAttentionSpec):
    """Custom spec whose manager keeps vLLM's prefix-scan finder."""


@dataclass(frozen=True, kw_only=True)
class BoundaryProbeSpec(FullAttentionSpec):
    """Custom spec whose manager decides hits by the boundary block only."""


class PrefixScanProbeManager(FullAttentionManager):
    pass


class BoundaryProbeManager(FullAttentionManager):
    @classmethod
    def find_longest_cache_hit(cls, *args, **kwargs):
        # Same scan, but the class now owns its finder: hybridkv must treat it
        # as not downward-closed (it cannot know the override keeps the rule).
        return super().find_longest_cache_hit(*args, **kwargs)


KVCacheSpecRegistry._ensure_registered()
KVCacheSpecRegistry.register(PrefixScanProbeSpec, PrefixScanProbeManager, FullAttentionSpec)
KVCacheSpecRegistry.register(BoundaryProbeSpec, BoundaryProbeManager, FullAttentionSpec)


def _spec(cls, block_size):
    base = fa(block_size, heads=3)
    return cls(block_size=block_size, num_kv_heads=3, head_size=base.head_size, dtype=base.dtype)


def _geometry(spec_cls) -> tuple[Geometry, GroupGeometry]:
    geo = Geometry(
        specs=[fa(16), _spec(spec_cls, 32), mamba(32)], hash_block_size=16, num_blocks=200
    )
    return geo, GroupGeometry.from_kv_cache_manager(geo.manager())


def test_predicate_follows_the_manager_class():
    assert is_downward_closed(FullAttentionManager)
    assert is_downward_closed(PrefixScanProbeManager)
    assert not is_downward_closed(BoundaryProbeManager)


@pytest.mark.parametrize(
    "spec_cls,closed", [(PrefixScanProbeSpec, True), (BoundaryProbeSpec, False)]
)
def test_custom_spec_flips_connector_and_store_together(spec_cls, closed):
    geo, geometry = _geometry(spec_cls)
    assert geometry.groups[1].manager_cls.__name__ == spec_cls.__name__.replace("Spec", "Manager")
    assert geometry.groups[1].downward_closed is closed

    # Connector side: FA16 hit 128, probe group 64, Mamba 96.
    hits = [128, 64, 96]
    r = reconcile_dense_hits(hits, [g.downward_closed for g in geometry.groups])
    if closed:
        assert (r.fallback, r.reported_tokens) == (False, 64)  # min over two dense
    else:
        assert (r.fallback, r.reported_tokens) == (False, 128)  # probe group is sparse

    # Store side, same geometry object: the local dense prefix is skipped for
    # the probe group only if it is dense, and its save mask follows its
    # manager.
    mirror = StoreMirror(geometry)
    req = make_request(geo, list(range(300)))
    probe = mirror.probe_keys(req.block_hashes, req.num_tokens - 1, local_dense_tokens=128)
    local = {bytes(h) for h in req.block_hashes[: 128 // 16]}
    probed_local = [k for k in probe if k[0] == 1 and k[1] in local]
    assert (len(probed_local) == 0) is closed
