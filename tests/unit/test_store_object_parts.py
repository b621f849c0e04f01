"""The store's zero-copy path moves an object in as few parts as its layout allows, and counts them.

A block-outermost KV cache (every layer of a block back to back: vLLM's BL layouts) makes each
object ONE part; a layer-outermost one (a block's layers ``num_blocks`` pages apart) keeps one
part per layer. Real parts: a ``StoreWorker`` saving to and loading from a real
``mooncake_master``-backed segment; the loaded bytes are compared whole.
(Shown to fail on the code before ``object_regions`` and the counters: no save_parts in the stats.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hybridkv.store.embedded_master import EmbeddedMaster
from tests.unit import test_store_trailer_regions as tr


class BlockOutermostRig(tr.Rig):
    """tr.Rig with its 3 layers as views of ONE ``[block, layer, ...]`` allocation."""

    def __init__(self, master: EmbeddedMaster) -> None:
        g = torch.Generator().manual_seed(17)
        whole = torch.randn(tr.NUM_BLOCKS, tr.LAYERS, 2, 16, 64, generator=g).to(torch.bfloat16)
        real = tr.StoreWorker.register_kv_caches
        tr.StoreWorker.register_kv_caches = lambda self, kv: real(  # type: ignore[method-assign]
            self, {n: whole[:, i] for i, n in enumerate(kv)}
        )
        try:
            super().__init__(master)
        finally:
            tr.StoreWorker.register_kv_caches = real  # type: ignore[method-assign]
        self.kv = {n: whole[:, i] for i, n in enumerate(self.names)}


@pytest.fixture(scope="module")
def master() -> Iterator[EmbeddedMaster]:
    with EmbeddedMaster() as m:
        yield m


@pytest.mark.parametrize(("rig_class", "parts"), [(BlockOutermostRig, 1), (tr.Rig, tr.LAYERS)])
def test_an_object_moves_in_its_layouts_parts(
    master: EmbeddedMaster, rig_class: type, parts: int
) -> None:
    rig = rig_class(master)
    try:
        rig.save("parts", 1)
        got = rig.worker.take_stats()
        assert got is not None and got.data.get("save_parts") == parts, got.data if got else None
        assert rig.load("parts", 5) is True
        assert rig.block(5) == rig.block(1)
        got = rig.worker.take_stats()
        assert got is not None and got.data.get("load_parts") == parts, got.data if got else None
    finally:
        rig.close()
