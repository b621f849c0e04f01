"""A P/D READ's stats count the NIXL descriptors it posted and the (block, region) pairs
they covered: a contiguous hand-over coalesces into one descriptor per region.

Real parts: two real NIXL agents (``PDTransport``, UCX over loopback, both in this
process) over KV caches built by vLLM's ``allocate_kv_cache``, and PDWorker's read
thread. FAKE: the side channel (the peer's handshake answer is taken from the
in-process prefill agent; the lease claim and release are no-ops).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only
os.environ.setdefault("UCX_MODULES", "^ib")  # see tests/unit/test_pd_transport.py

import pytest  # noqa: E402
import torch  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

import hybridkv.connector.pd_worker as pd_worker  # noqa: E402
from hybridkv.connector.block_layout import KVLayout  # noqa: E402
from hybridkv.connector.pd_metadata import PDConnectorMetadata, ReadJob  # noqa: E402
from hybridkv.connector.pd_transport import PDTransport  # noqa: E402
from hybridkv.connector.pd_worker import PDWorker, PDWorkerSettings  # noqa: E402
from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups  # noqa: E402

LAYERS = 4
NBYTES = 4 << 20


def _kv(seed: int) -> tuple[KVLayout, torch.Tensor, list[torch.Tensor]]:
    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the CPU attention backend resolves to
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = get_kv_cache_config_from_groups(
        cfg, [KVCacheGroupSpec([f"l.{i}" for i in range(LAYERS)], spec)], NBYTES
    )
    caches = allocate_kv_cache(
        config, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout()
    )
    layout = KVLayout.from_kv_caches(config, caches)
    first = next(iter(caches.values()))
    raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
    raw.copy_(
        torch.randint(
            0, 256, (raw.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
        )
    )
    return layout, raw, list(caches.values())


@pytest.fixture
def agents():
    p_layout, p_raw, p_keep = _kv(1)
    d_layout, d_raw, d_keep = _kv(2)
    prefill = PDTransport("descr-prefill", p_layout)
    decode = PDTransport("descr-decode", d_layout)
    peer = decode.add_peer(prefill.metadata(), p_layout.groups)
    yield decode, peer, p_layout, p_raw, d_raw
    decode.shutdown()
    prefill.shutdown()
    del p_keep, d_keep


def test_contiguous_handover_counts_fewer_descriptors_than_regions(monkeypatch, agents) -> None:
    """Shown to fail on the code before the counters: the stats hold only reads / read_blocks /
    read_bytes / read_seconds (KeyError 'read_regions')."""
    decode, peer, p_layout, p_raw, d_raw = agents
    monkeypatch.setattr(PDWorker, "_peer", lambda self, job, rank: (peer, None))  # FAKE handshake
    monkeypatch.setattr(PDWorker, "_slices", lambda self, part, peer_layout, job: None)
    monkeypatch.setattr(pd_worker, "claim_lease", lambda *a, **k: 10.0)  # FAKE side channel
    monkeypatch.setattr(pd_worker, "release_blocks", lambda *a, **k: None)
    worker = PDWorker(
        PDWorkerSettings("decode", 0, 1, "127.0.0.1", 0, 10.0, 0.5, total_kv_heads=2), None
    )
    worker._transport = decode
    worker._local = object()  # registered (only its presence is checked on this path)
    remote, local = list(range(4, 12)), list(range(20, 28))  # 8 blocks, consecutive on both sides
    job = ReadJob(
        "r",
        "p-r",
        "prefill",
        "10.0.0.1",
        1000,
        [remote],
        [local],
        lease_id="0" * 32,
        remote_ports=[1000],
    )
    try:
        worker.start_load_kv(PDConnectorMetadata(reads=[job]))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with worker._lock:
                if "r" in worker._recv_done:
                    break
            time.sleep(0.01)
        stats = worker.take_stats()
        assert stats is not None
        regions = len(p_layout.groups[0].bases)
        assert regions == LAYERS  # LBHNC: a layer's K and V of one block are one row
        assert stats.data.get("reads") == 1, stats.data
        assert stats.data["read_regions"] == len(remote) * regions
        assert stats.data["read_descriptors"] == regions  # one per region: the 8 blocks are one run
        assert stats.data["read_descriptors"] < stats.data["read_regions"]
        assert stats.data["read_bytes"] == len(remote) * int(p_layout.groups[0].block_bytes.sum())
        # the bytes moved: every region of every asked block
        g = p_layout.groups[0]
        base_p, base_d = p_layout.allocations[0][0], decode.layout.allocations[0][0]
        for r_id, l_id in zip(remote, local, strict=True):
            for j in range(regions):
                n = int(g.block_bytes[j])
                src = int(g.bases[j] + r_id * g.strides[j]) - base_p
                dst = (
                    int(
                        decode.layout.groups[0].bases[j] + l_id * decode.layout.groups[0].strides[j]
                    )
                    - base_d
                )
                assert torch.equal(d_raw[dst : dst + n], p_raw[src : src + n])
    finally:
        worker.shutdown()
