"""The store's GPU staging against vLLM's device-memory budget (CPU: arithmetic and refusal).

vLLM sizes its KV cache to fill ``gpu_memory_utilization`` of the device and has no hook
through which a connector reports device buffers of its own; vLLM 0.34 defaults that share
to 1.0 with its growable KV cache. The store allocates its GPU staging when the KV cache is
registered, after vLLM's sizing, so it must fit in the share vLLM leaves outside, or the
worker refuses to start naming the flag and the connector keys that fix it.
"""

from __future__ import annotations

import pytest
from vllm.config import CacheConfig

from hybridkv.connector.store_staging import (
    device_staging_bytes,
    stager_device_bytes,
    staging_budget_problem,
)
from hybridkv.store import vllm_compat

MiB = 1 << 20
H200 = 150_754_820_096  # torch.cuda.get_device_properties(0).total_memory on an H200
RESOLVES = hasattr(CacheConfig, "resolved_gpu_memory_utilization")  # vLLM 0.34


def test_stager_device_bytes_follows_the_stagers_own_sizing():
    # 1 MiB objects, 64 per batch, 64 MiB host buffer: 64 slots; two chunks of 64 slots
    # (128 MiB, under the 256 MiB cap) and 64 int64 block ids.
    assert stager_device_bytes(1 * MiB, 64, 64 * MiB) == 128 * MiB + 8 * 64
    # 3 MiB objects: 21 fit the buffer; two chunks of 21.
    assert stager_device_bytes(3 * MiB, 64, 64 * MiB) == 2 * 21 * 3 * MiB + 8 * 21
    # 64 KiB objects, 1024 fit but max_batch_blocks is 256: the batch bounds the slots.
    assert stager_device_bytes(64 << 10, 256, 64 * MiB) == 2 * 256 * (64 << 10) + 8 * 256
    # Small objects, many slots: the 256 MiB cap bounds the chunks (2 x 2048 x 64 KiB).
    assert stager_device_bytes(64 << 10, 8192, 1 << 30) == 256 * MiB + 8 * 8192
    # One object larger than the buffer and the cap: still one slot per chunk.
    assert stager_device_bytes(300 * MiB, 64, 64 * MiB) == 600 * MiB + 8
    # Every group, one stager per load thread (4) and one save stager.
    assert device_staging_bytes([1 * MiB, 3 * MiB], 64, 64 * MiB, 5) == 5 * (
        128 * MiB + 8 * 64 + 2 * 21 * 3 * MiB + 8 * 21
    )


@pytest.mark.skipif(not RESOLVES, reason="vLLM < 0.34 has no growable KV cache default")
def test_vllm034_default_budget_leaves_nothing_and_the_worker_refuses_naming_the_fix():
    """0.34 on CUDA: the growable KV cache is on and gpu_memory_utilization unset (1.0)."""
    cache = CacheConfig(enable_extensible_kv_cache=True)
    assert vllm_compat.gpu_memory_utilization(cache) == (1.0, False)
    needed = device_staging_bytes([1 * MiB, 3 * MiB], 64, 64 * MiB, 5)
    assert staging_budget_problem(cache, H200, needed) == (
        "HybridStoreConnector stages this GPU KV cache through 1270 MiB of device memory, "
        "which vLLM's memory budget does not include: gpu_memory_utilization=1 (vLLM's "
        "default) leaves 0 MiB of the device's 143771 MiB outside it. Start vLLM with "
        "--gpu-memory-utilization 0.98 (or lower), or lower the connector's "
        "staging_buffer_size (or max_batch_blocks)"
    )
    # The suggested value fits; so does a fixed KV cache size (vLLM then budgets nothing).
    assert staging_budget_problem(CacheConfig(gpu_memory_utilization=0.98), H200, needed) is None
    fixed = CacheConfig(enable_extensible_kv_cache=False, kv_cache_memory_bytes=80 << 30)
    assert staging_budget_problem(fixed, H200, needed) is None
    # Estimate-based sizing (growable cache off) keeps vLLM's 0.92 default: it fits.
    estimate = CacheConfig(enable_extensible_kv_cache=False)
    assert vllm_compat.gpu_memory_utilization(estimate) == (0.92, False)
    assert staging_budget_problem(estimate, H200, needed) is None


def test_an_explicit_full_budget_is_refused_on_every_version():
    cache = CacheConfig(gpu_memory_utilization=1.0)
    assert vllm_compat.gpu_memory_utilization(cache) == (1.0, True)
    assert staging_budget_problem(cache, H200, 1270 * MiB) == (
        "HybridStoreConnector stages this GPU KV cache through 1270 MiB of device memory, "
        "which vLLM's memory budget does not include: gpu_memory_utilization=1 leaves 0 MiB "
        "of the device's 143771 MiB outside it. Start vLLM with --gpu-memory-utilization "
        "0.98 (or lower), or lower the connector's staging_buffer_size (or max_batch_blocks)"
    )
    # 0.99 leaves 1437 MiB: enough for 1270 MiB, not for 1500.
    assert (
        staging_budget_problem(CacheConfig(gpu_memory_utilization=0.99), H200, 1270 * MiB) is None
    )
    assert "1437 MiB" in staging_budget_problem(
        CacheConfig(gpu_memory_utilization=0.99), H200, 1500 * MiB
    )
