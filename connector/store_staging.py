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

from collections.abc import Callable

import torch

from hybridkv.connector.block_layout import GroupLayout, KVLayout
from hybridkv.connector.block_staging import BlockStager
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
        slots = max(1, min(max_batch_blocks, buffer_bytes // g.object_bytes))

        def make(
            layers: list[torch.Tensor] = layers, slots: int = slots, g: GroupLayout = g
        ) -> BlockStager:
            stager = BlockStager(
                layers,
                slots,
                num_blocks=g.num_blocks,
                device_staging_bytes=min(_MAX_DEVICE_STAGING, 2 * slots * g.object_bytes),
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
