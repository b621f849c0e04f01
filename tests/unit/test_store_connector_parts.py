"""Fast checks of the connector's parts: config validation, block addressing, plugin, stats."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from hybridkv.cli.harness.kv_manager import fa, mamba
from hybridkv.connector.block_layout import KVLayout, LayoutError, layout_rows
from hybridkv.connector.store_config import ConfigError, StoreConnectorConfig, parse_size
from hybridkv.connector.store_metadata import StoreWorkerMetadata
from hybridkv.connector.store_stats import HybridStoreStats


def test_defaults_and_sizes():
    cfg = StoreConnectorConfig.from_extra_config({})
    assert cfg.master_address is None and cfg.global_segment_size == 512 << 20
    assert cfg.max_pinned_save_fraction == 0.5
    assert (
        StoreConnectorConfig.from_extra_config(
            {"max_pinned_save_fraction": 1}
        ).max_pinned_save_fraction
        == 1.0
    )
    assert parse_size("x", "512MiB") == 512 << 20
    assert parse_size("x", "2GB") == 2 << 30
    assert parse_size("x", 4096) == 4096


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"master_adress": "h:1"}, "unknown key(s) ['master_adress']"),
        ({"master_address": "nohost"}, "master_address='nohost'"),
        ({"global_segment_size": "lots"}, "global_segment_size='lots'"),
        ({"global_segment_size": 0}, "leaves the store with no memory"),
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"protocol": "udp"}, "protocol='udp'"),
        ({"save_decode": "yes"}, "save_decode='yes'"),
        ({"pin_mooncake_listeners": 1}, "pin_mooncake_listeners=1: expected true or false"),
        ({"populate_segment": "yes"}, "populate_segment='yes': expected true or false"),
        ({"read_wait_nice": 20}, "read_wait_nice=20: expected a nice level from 0"),
        ({"read_wait_nice": True}, "read_wait_nice=True: expected a nice level from 0"),
        ({"malloc_trim_interval_s": -1}, "malloc_trim_interval_s=-1: expected seconds >= 0"),
        ({"malloc_trim_interval_s": "10"}, "malloc_trim_interval_s='10': expected seconds >= 0"),
        ({"max_batch_blocks": -1}, "max_batch_blocks=-1"),
        (
            {"max_pinned_save_fraction": 0},
            "max_pinned_save_fraction=0: expected a share of the KV cache in (0, 1]",
        ),
        ({"max_pinned_save_fraction": 1.5}, "max_pinned_save_fraction=1.5"),
        ({"max_pinned_save_fraction": True}, "max_pinned_save_fraction=True"),
        ({"namespace": 3}, "namespace=3"),
        ({"staging": "sometimes"}, "staging='sometimes'"),
        ({"staging_buffer_size": 0}, "staging_buffer_size=0"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(extra, needle):
    with pytest.raises(ConfigError) as e:
        StoreConnectorConfig.from_extra_config(extra)
    assert needle in str(e.value)


def _config(specs, num_blocks=6):
    groups = [KVCacheGroupSpec([f"layer{i}a", f"layer{i}b"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def test_block_regions_cover_exactly_each_layers_block():
    cfg = _config([fa(16, heads=2), mamba(32)])
    buf = torch.zeros(1 << 16, dtype=torch.int8)
    # Two attention layers [B, 2, bs, heads*dim] bf16 and two Mamba pages, views of one buffer.
    att = [
        buf[i * 6 * 512 : (i + 1) * 6 * 512].view(torch.bfloat16).view(6, 2, 16, 8)
        for i in range(2)
    ]
    mam = [
        buf[8192 + i * 6 * 1000 : 8192 + (i + 1) * 6 * 1000].view(6, 1, 1, 1000) for i in range(2)
    ]
    layout = KVLayout.from_kv_caches(
        cfg, {"layer0a": att[0], "layer0b": att[1], "layer1a": mam[0], "layer1b": mam[1]}
    )
    assert layout.allocations == ((buf.data_ptr(), buf.numel()),)
    addrs, sizes = layout.groups[0].regions([3, 1])
    assert addrs[0] == [att[0][3].data_ptr(), att[1][3].data_ptr()]
    assert sizes[1] == [512, 512]
    assert layout.groups[1].object_bytes == 2000
    assert layout.groups[1].regions([5])[0][0] == [mam[0][5].data_ptr(), mam[1][5].data_ptr()]


def test_non_contiguous_blocks_are_refused_with_the_layout_named():
    cfg = _config([fa(16)])
    t = torch.zeros(2, 6, 16, 8, dtype=torch.bfloat16).transpose(
        0, 1
    )  # K/V outermost: block not contiguous
    with pytest.raises(LayoutError, match="one block is not contiguous"):
        KVLayout.from_kv_caches(cfg, {"layer0a": t, "layer0b": t})


def test_layout_rows_separate_block_sizes_and_layer_counts():
    a = layout_rows(_config([fa(16), mamba(32)]))
    b = layout_rows(_config([fa(32), mamba(32)]))
    assert a != b and a[1]["spec"] == "MambaSpec"


def test_plugin_registration_is_idempotent():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from hybridkv.connector.plugin import register

    register()
    register()
    cls = KVConnectorFactory.get_connector_class_by_name("HybridStoreConnector")
    assert cls.__name__ == "HybridStoreConnector"


def test_worker_metadata_sums_acks_and_stats_reduce():
    a = StoreWorkerMetadata()
    a.finished_saves.update({1: 1, 2: 1})
    b = StoreWorkerMetadata()
    b.finished_saves.update({1: 1})
    assert a.aggregate(b).finished_saves == {1: 2, 2: 1}
    s = HybridStoreStats()
    s.add("query_tokens", 1000)
    s.add("hit_tokens", 250)
    other = HybridStoreStats(data={"hit_tokens": 250})
    assert s.aggregate(other).reduce()["hit_rate"] == 0.5
    assert HybridStoreStats().is_empty()


def test_latencies_aggregate_as_lists_and_reach_prometheus_histograms():
    import prometheus_client

    from hybridkv.connector.store_stats import HybridStorePromMetrics

    a, b = HybridStoreStats(), HybridStoreStats()
    for ms in (1, 2, 3):
        a.add_latency("load", ms / 1e3)
    b.add_latency("load", 0.5)
    b.add_latency("lookup", 0.004)
    merged = a.aggregate(b)
    assert merged.data["lat.load"] == [0.001, 0.002, 0.003, 0.5]
    out = merged.reduce()
    assert out["load_p50_ms"] == 3.0 and out["load_p99_ms"] == 500.0 and out["lookup_p50_ms"] == 4.0
    assert "lat.load" not in out

    registry = prometheus_client.CollectorRegistry()

    def scoped(cls):  # noqa: ANN001, ANN202 - register into a private registry
        return lambda *args, **kw: cls(*args, registry=registry, **kw)

    types = {
        prometheus_client.Gauge: scoped(prometheus_client.Gauge),
        prometheus_client.Counter: scoped(prometheus_client.Counter),
        prometheus_client.Histogram: scoped(prometheus_client.Histogram),
    }
    from vllm.config import VllmConfig

    prom = HybridStorePromMetrics(VllmConfig(), types, ["engine"], {0: ["0"]})
    prom.observe(merged.data, 0)
    count = registry.get_sample_value(
        "vllm:hybridkv_store_load_latency_seconds_count", {"engine": "0"}
    )
    slow = registry.get_sample_value(
        "vllm:hybridkv_store_load_latency_seconds_bucket", {"engine": "0", "le": "0.25"}
    )
    assert count == 4 and slow == 3  # the 0.5 s call sits above the 0.25 s bucket
