"""Host staging for KV caches the store client cannot read in place.

A GPU KV cache cannot be handed to a TCP Mooncake client (and the object trailer's
checksum is computed on the host), so each batch of blocks goes through a registered
host buffer: ``BlockStager`` gathers a group's blocks into contiguous slots
(one slot = one store object, the same bytes in the same layer order as the
zero-copy path, so objects are interchangeable between the two) and scatters
loaded slots back. A host cache is staged only when ``staging="always"``,
which runs this exact path on the CPU engine in tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.connector.block_layout import GroupLayout, KVLayout
from hybridkv.connector.block_staging import BlockStager
from hybridkv.store import vllm_compat
from hybridkv.store.call_pool import CallPool

_MAX_DEVICE_STAGING = 256 << 20


class StagerPool(CallPool[BlockStager]):
    """Stagers of one group and direction (see :class:`~hybridkv.store.call_pool.CallPool`)."""

    def __init__(self, make: Callable[[], BlockStager]) -> None:
        self.slots = 0

        def make_counted() -> BlockStager:
            stager = make()
            self.slots = stager.max_blocks
            return stager

        super().__init__(make_counted, prebuild=True)


def group_tensors(layout: GroupLayout, kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The group's distinct layer views in the layout's order (the object's byte order):
    exactly the views ``KVLayout`` derived the group's regions from."""
    return [kv_caches[name] for name in layout.tensor_names]


def needs_staging(kv_caches: dict[str, torch.Tensor], mode: str) -> bool:
    return mode == "always" or any(t.device.type != "cpu" for t in kv_caches.values())


def _slots(object_bytes: int, max_batch_blocks: int, buffer_bytes: int) -> int:
    """Staging slots of one stager: objects that fit ``buffer_bytes``, at least one."""
    return max(1, min(max_batch_blocks, buffer_bytes // object_bytes))


def _device_chunk_bytes(object_bytes: int, slots: int) -> int:
    """What a stager of ``slots`` slots is given for its two device ping-pong chunks."""
    return min(_MAX_DEVICE_STAGING, 2 * slots * object_bytes)


def stager_device_bytes(object_bytes: int, max_batch_blocks: int, buffer_bytes: int) -> int:
    """Device memory one CUDA ``BlockStager`` of these objects allocates: two chunks of
    ``chunk_slots`` slots (``BlockStager``'s own rule) and the int64 block-id vector."""
    slots = _slots(object_bytes, max_batch_blocks, buffer_bytes)
    given = _device_chunk_bytes(object_bytes, slots)
    chunk_slots = max(1, min(slots, given // (2 * object_bytes)))
    return 2 * chunk_slots * object_bytes + 8 * slots


def device_staging_bytes(
    object_bytes: list[int], max_batch_blocks: int, buffer_bytes: int, stagers_per_group: int
) -> int:
    """Device memory of a GPU KV cache's staging: ``stagers_per_group`` stagers for each
    group's objects (as many as transfers can use at once: one per load thread, one save)."""
    return stagers_per_group * sum(
        stager_device_bytes(b, max_batch_blocks, buffer_bytes) for b in object_bytes
    )


def staging_budget_problem(
    cache_config: Any, device_total_bytes: int, staging_bytes: int
) -> str | None:
    """Why vLLM's memory budget leaves no room for ``staging_bytes`` of device staging.

    vLLM sizes the KV cache to fill ``gpu_memory_utilization`` of the device and measures
    only its own use, so memory a connector allocates on the device afterwards must come
    from the share outside that budget (vLLM 0.34 defaults it to 1.0 with its growable KV
    cache: no share at all). None: it fits, or ``kv_cache_memory_bytes`` fixes the KV
    cache's size and vLLM does not budget the device at all."""
    if getattr(cache_config, "kv_cache_memory_bytes", None):
        return None
    utilization, explicit = vllm_compat.gpu_memory_utilization(cache_config)
    outside = int(device_total_bytes * (1.0 - utilization))
    if staging_bytes <= outside:
        return None
    mib = 1 << 20
    # Two decimals down, one more step for the staging's CUDA streams and graphs.
    fits = math.floor((1.0 - staging_bytes / device_total_bytes) * 100) / 100 - 0.01
    source = "" if explicit else " (vLLM's default)"
    return (
        f"HybridStoreConnector stages this GPU KV cache through {staging_bytes // mib} MiB of "
        f"device memory, which vLLM's memory budget does not include: gpu_memory_utilization="
        f"{utilization:g}{source} leaves {outside // mib} MiB of the device's "
        f"{device_total_bytes // mib} MiB outside it. Start vLLM with "
        f"--gpu-memory-utilization {fits:.2f} (or lower), or lower the connector's "
        f"staging_buffer_size (or max_batch_blocks)"
    )


def build_stager_pools(
    layout: KVLayout,
    kv_caches: dict[str, torch.Tensor],
    max_batch_blocks: int,
    buffer_bytes: int,
    register: Callable[[int, int], None],
) -> dict[int, dict[str, StagerPool]]:
    """Per group id: a pool for loads and one for saves (they run on different threads)."""
    pools: dict[int, dict[str, StagerPool]] = {}
    for g in layout.groups:
        if g is None:
            continue
        layers = group_tensors(g, kv_caches)
        slots = _slots(g.object_bytes, max_batch_blocks, buffer_bytes)

        def make(
            layers: list[torch.Tensor] = layers, slots: int = slots, g: GroupLayout = g
        ) -> BlockStager:
            stager = BlockStager(
                layers,
                slots,
                num_blocks=g.num_blocks,
                device_staging_bytes=_device_chunk_bytes(g.object_bytes, slots),
            )
            if stager.slot_bytes != g.object_bytes:
                raise RuntimeError(
                    f"group {g.group_id}: staging slot of {stager.slot_bytes} B but objects of "
                    f"{g.object_bytes} B; the layer views disagree with the KV layout"
                )
            register(stager.buffer_ptr, stager.buffer_nbytes)
            return stager

        pools[g.group_id] = {"load": StagerPool(make), "save": StagerPool(make)}
    return pools


def device_fence(kv_caches_on_cuda: bool) -> "torch.cuda.Event | None":
    """An event after the work already enqueued on the forward's stream (None on the host).

    Saves run on a background thread whose current stream is not the forward's:
    gathering there must wait for the forward that wrote the blocks.
    """
    if not kv_caches_on_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event
