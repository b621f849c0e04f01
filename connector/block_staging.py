"""Worker-side data path: paged KV blocks <-> a host staging buffer.

The store object for (KV-cache group, block id) is the concatenation of that
block's bytes from every layer of the group, in a fixed layer order. vLLM hands
the connector one paged tensor per layer whose dim 0 is the block id, or the
kernel block id when the attention backend splits manager blocks
(``[num_blocks * k, 2, kernel_bs, heads*head_dim]`` bf16, MLA
``[num_blocks, block_size, 576]``, a Mamba page ``[num_blocks, 1, 1, page]``
int8, ...). Which bytes are manager block b of a layer is decided by
``block_layout.block_geometry`` (the rule every transport uses); the stager
keeps one row view per region it names (``stride(0)`` may be larger than one
block, e.g. a padded hybrid page).

:class:`BlockStager` owns ONE host buffer laid out ``[slot, layer, block_bytes]``
so that a slot is exactly one store object, contiguous (register the whole
buffer with the store once: :attr:`BlockStager.buffer_ptr`,
:attr:`BlockStager.buffer_nbytes`). On CUDA the buffer is pinned and

* ``gather(block_ids)`` (save): per chunk of slots, one device-side row
  gather per layer (advanced indexing ``aten.index.Tensor_out``, or
  ``index_select``) into a device staging chunk laid out exactly like the host
  slots, then ONE contiguous async D2H copy of the chunk; two device chunks
  ping-pong between a kernel stream and a copy stream so that the gather of
  chunk k+1 overlaps the DMA of chunk k. Slot i holds block_ids[i].
* ``scatter(block_ids)`` (load): the reverse: one contiguous H2D copy per
  chunk, then one row scatter per layer (``index_put_``, or ``index_copy_``)
  into the paged cache. Slot i goes to block_ids[i].

Chunks ramp (doubling from ``first_chunk_bytes`` up to half the device
staging) so that only a small gather is exposed before the first DMA starts;
a scatter ramps down instead, so that only a small scatter is left after the
last DMA. By default (``use_cuda_graphs=True``) the per-layer kernels of a
chunk are replayed from a CUDA graph: one launch instead of one per layer
(an eager launch costs tens of microseconds of host time on the worker's
thread), captured on first use per (op, chunk offset, chunk size,
buffer), at most ``max_graphs`` of them (then eager); if capture fails the
stager stays eager. bench/gpu_block_path.py measures the pipeline against
one contiguous pinned copy (docs/gpu_results.md): the row kernels outrun PCIe,
so what is left is the fixed cost of the first/last chunk plus stream/event
hops, visible only on small batches.

On CPU tensors there is no device hop: the same row kernels run straight
between the cache and the (unpinned) staging buffer. (The CPU engine can
register the cache itself with the store, zero-copy; the CPU path exists for
tests and as a fallback.)

Synchronization contract (CUDA)
-------------------------------
* ``gather_async`` records an event on the caller's CURRENT stream at call
  time and the copy streams wait on it on the device: call it after the
  forward that wrote the blocks has been *enqueued* (the forward stream is
  never blocked by the host; the gather just runs after it).
* The gathered/scattered blocks must stay allocated to their request (not
  freed, not rewritten) until the returned :class:`StagingOp` is done.
* Host slots are valid once ``op.wait()`` returns (``gather`` waits for you)
  and stay valid until the next ``gather``/``scatter`` on this stager.
* ``scatter_async`` also orders itself after the caller's current stream;
  the cache blocks are written when ``op.wait()`` returns (host side) or, on
  the device, after ``op.wait_stream(stream)``: do one of the two before a
  forward reads the loaded blocks.
* One operation in flight per stager: starting a new one host-waits for the
  previous one. Not thread-safe: use a stager from one thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    from hybridkv.connector.block_layout import BlockGeometry, block_geometry
except ImportError:  # loaded as a lone file (bench/gpu_block_path.py on a machine without hybridkv)
    import importlib.util
    import pathlib
    import sys

    _spec = importlib.util.spec_from_file_location(
        "block_layout", pathlib.Path(__file__).with_name("block_layout.py")
    )
    _layout = importlib.util.module_from_spec(_spec)
    sys.modules.setdefault("block_layout", _layout)
    _spec.loader.exec_module(_layout)
    BlockGeometry, block_geometry = _layout.BlockGeometry, _layout.block_geometry

__all__ = ["BlockStager", "StagingOp", "region_rows"]

# Widest integer element that divides every block, stride and offset: the row
# kernels move one element per thread step, so wider elements mean fewer steps
# (16-byte elements are no faster than int64).
_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

_DEFAULT_DEVICE_STAGING = 256 << 20  # two ping-pong chunks of 128 MiB


def _geometry(t: torch.Tensor, num_blocks: int | None) -> BlockGeometry:
    """Manager-block geometry from block_layout (the one addressing rule); ValueError if none."""
    if t.dim() >= 1 and t.shape[0] == 0:
        raise ValueError("a paged layer needs >= 1 block")
    return block_geometry(t, int(t.shape[0]) if num_blocks is None else num_blocks)


def region_rows(
    t: torch.Tensor, geo: BlockGeometry, num_blocks: int, width: int = 1
) -> list[torch.Tensor]:
    """Per region of ``geo``: a ``[num_blocks, region_bytes // width]`` integer view of
    the layer's storage (row b = that region of manager block b; element ``width``
    bytes: 1 uint8, 2 int16, 4 int32, 8 int64). Same storage, no copy, any device."""
    dtype = dict(_WIDTHS)[width]
    if (
        geo.stride | geo.storage_offset | sum(o | s for o, s in zip(geo.offsets, geo.sizes))
    ) % width:
        raise ValueError(f"layer geometry is not a multiple of {width} bytes")
    storage = t.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    usable = storage.nbytes() - storage.nbytes() % width
    base = base[:usable].view(dtype)
    return [
        base.as_strided(
            (num_blocks, size // width),
            (geo.stride // width if num_blocks > 1 else size // width, 1),
            (geo.storage_offset + off) // width,
        )
        for off, size in zip(geo.offsets, geo.sizes)
    ]


def _common_width(layers: Sequence[torch.Tensor], geos: Sequence[BlockGeometry]) -> int:
    """Widest element dividing every stride, offset, size and storage address."""
    vals = [v for g in geos for v in (g.stride, g.storage_offset, *g.offsets, *g.sizes)]
    vals += [t.untyped_storage().data_ptr() for t in layers]
    for width, _ in _WIDTHS:
        if all(v % width == 0 for v in vals):
            return width
    return 1


class StagingOp:
    """Handle of one gather/scatter. ``wait()`` blocks the calling thread
    until done; ``wait_stream(s)`` makes stream ``s`` (default: current) wait
    on the device instead; ``done()`` polls."""

    __slots__ = ("_event", "_device", "n")

    def __init__(self, event: torch.cuda.Event | None, n: int, device: torch.device | None = None):
        self._event = event
        self._device = device
        self.n = n

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        if self._event is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._event)


class BlockStager:
    """Moves batches of blocks between the paged layers of one KV-cache group
    and a host staging buffer ``[max_blocks_per_batch, slot_bytes]`` (slot =
    that block's bytes of every layer, in ``layers`` order).

    Parameters
    ----------
    layers: the group's paged layer tensors, all on one device, in the store
        object's layer order (each distinct view once).
    max_blocks_per_batch: slots in the staging buffer.
    num_blocks: manager blocks of the KV cache. vLLM's views have
        ``num_blocks * k`` kernel rows in dim 0 when the attention backend
        splits blocks; manager block b (what ``block_ids`` name) is then rows
        ``b*k .. b*k+k-1`` (``block_layout.block_geometry``). None: dim 0 of
        each layer is the manager block (tests, benches).
    pin: pin the host buffer (CUDA layers only).
    device_staging_bytes: device memory for the two ping-pong staging chunks
        (CUDA only; a chunk is at least one slot).
    first_chunk_bytes: size the chunk ramp starts from (None: 8 MiB with CUDA
        graphs, 32 MiB eager, where each chunk costs one launch per layer);
        0 disables the ramp (every chunk full size).
    overlap: use a second stream so the gather of one chunk overlaps the DMA
        of the previous one (False: everything on one copy stream).
    use_cuda_graphs: replay the per-layer kernels of a chunk from a graph.
    max_graphs: cap on captured graphs (eager beyond it).
    kernel: "index" (advanced indexing: ``aten.index.Tensor_out`` into the
        chunk / ``index_put_`` from it) or "index_select" (``index_select`` /
        ``index_copy_``). Both are exact byte copies; they differ in speed.
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        max_blocks_per_batch: int,
        pin: bool = True,
        *,
        num_blocks: int | None = None,
        device_staging_bytes: int = _DEFAULT_DEVICE_STAGING,
        first_chunk_bytes: int | None = None,
        overlap: bool = True,
        use_cuda_graphs: bool = True,
        max_graphs: int = 1024,
        kernel: str = "index",
    ):
        if kernel not in ("index", "index_select"):
            raise ValueError(f"unknown kernel {kernel!r}")
        self.kernel = kernel
        if not layers:
            raise ValueError("need at least one layer")
        if max_blocks_per_batch < 1:
            raise ValueError("max_blocks_per_batch must be >= 1")
        self.device = layers[0].device
        if any(t.device != self.device for t in layers):
            raise ValueError("all layers of a group must be on one device")
        geos = [_geometry(t, num_blocks) for t in layers]
        self.num_blocks = (
            min(int(t.shape[0]) for t in layers) if num_blocks is None else int(num_blocks)
        )
        self.max_blocks = int(max_blocks_per_batch)
        self.kernel_rows = [g.kernel_rows for g in geos]
        self.width = _common_width(layers, geos)
        self._dtype = dict(_WIDTHS)[self.width]
        self.block_bytes = [g.block_bytes for g in geos]
        self.layer_offsets = [sum(self.block_bytes[:i]) for i in range(len(layers))]
        self.slot_bytes = sum(self.block_bytes)
        # One row view per region (a layer's block, or each kernel row of it when the
        # rows are not adjacent), in the object's byte order.
        self._rows, self._cols, col = [], [], 0
        for t, g in zip(layers, geos):
            for rows, size in zip(region_rows(t, g, self.num_blocks, self.width), g.sizes):
                self._rows.append(rows)
                self._cols.append((col // self.width, (col + size) // self.width))
                col += size
        self.is_cuda = self.device.type == "cuda"
        self.pinned = bool(pin and self.is_cuda)
        self.host = torch.empty(
            (self.max_blocks, self.slot_bytes), dtype=torch.uint8, pin_memory=self.pinned
        )
        self._host_w = self.host.view(self._dtype)
        self._prev: StagingOp | None = None
        self.use_cuda_graphs = bool(use_cuda_graphs and self.is_cuda)
        if not self.is_cuda:
            return
        slot_elems = self.slot_bytes // self.width
        self.chunk_slots = max(
            1, min(self.max_blocks, device_staging_bytes // (2 * self.slot_bytes))
        )
        if first_chunk_bytes is None:
            first_chunk_bytes = (8 << 20) if use_cuda_graphs else (32 << 20)
        self.first_chunk_slots = (
            self.chunk_slots
            if first_chunk_bytes <= 0
            else max(1, min(self.chunk_slots, first_chunk_bytes // self.slot_bytes))
        )
        with torch.cuda.device(self.device):
            self._dev = torch.empty(
                (2, self.chunk_slots, slot_elems), dtype=self._dtype, device=self.device
            )
            self._ids_dev = torch.zeros(self.max_blocks, dtype=torch.int64, device=self.device)
            self._kstream = torch.cuda.Stream(self.device)
            self._dstream = torch.cuda.Stream(self.device) if overlap else self._kstream
            self._filled = [torch.cuda.Event() for _ in range(2)]
            self._free = [torch.cuda.Event() for _ in range(2)]
        self._ids_host = torch.zeros(self.max_blocks, dtype=torch.int64, pin_memory=True)
        self._ids_np = self._ids_host.numpy()
        self.max_graphs = max_graphs
        self._graphs: dict[tuple[str, int, int, int], torch.cuda.CUDAGraph] = {}

    # ------------------------------------------------------------------ host
    @property
    def buffer_ptr(self) -> int:
        return self.host.data_ptr()

    @property
    def buffer_nbytes(self) -> int:
        return self.host.numel()

    def slot_addresses(self, n: int) -> list[tuple[int, int]]:
        """(host_ptr, nbytes) of slots 0..n-1 (slot i = block_ids[i])."""
        if not 0 <= n <= self.max_blocks:
            raise ValueError(f"n={n} outside 0..{self.max_blocks}")
        base = self.host.data_ptr()
        return [(base + i * self.slot_bytes, self.slot_bytes) for i in range(n)]

    def slot(self, i: int) -> torch.Tensor:
        """Slot i as a uint8 tensor (a view into the staging buffer)."""
        return self.host[i]

    # ------------------------------------------------------------------- API
    def gather(self, block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Copy blocks into slots 0..n-1 and wait; returns their (ptr, nbytes)."""
        op = self.gather_async(block_ids)
        op.wait()
        return self.slot_addresses(op.n)

    def scatter(self, block_ids: Sequence[int]) -> None:
        """Copy slots 0..n-1 into blocks block_ids (distinct) and wait."""
        self.scatter_async(block_ids).wait()

    def gather_async(self, block_ids: Sequence[int]) -> StagingOp:
        ids = self._check(block_ids, unique=False)
        return self._run("gather", ids)

    def scatter_async(self, block_ids: Sequence[int]) -> StagingOp:
        ids = self._check(block_ids, unique=True)
        return self._run("scatter", ids)

    def chunks(self, n: int, op: str = "gather") -> list[tuple[int, int]]:
        """The [c0, c1) slot ranges a batch of n moves in (CUDA)."""
        sizes, size, left = [], self.first_chunk_slots, n
        while left > 0:
            sizes.append(min(size, left))
            left -= sizes[-1]
            size = min(2 * size, self.chunk_slots)
        if op == "scatter":
            sizes.reverse()
        out, c0 = [], 0
        for m in sizes:
            out.append((c0, c0 + m))
            c0 += m
        return out

    # -------------------------------------------------------------- internal
    def _check(self, block_ids: Sequence[int], unique: bool) -> list[int]:
        if isinstance(block_ids, torch.Tensor):
            block_ids = block_ids.tolist()
        ids = [int(b) for b in block_ids]
        if len(ids) > self.max_blocks:
            raise ValueError(f"{len(ids)} blocks > max_blocks_per_batch={self.max_blocks}")
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            raise ValueError(f"block id outside 0..{self.num_blocks - 1}")
        if unique and len(set(ids)) != len(ids):
            raise ValueError("scatter block ids must be distinct")
        return ids

    def _kernels(self, op: str, ids: torch.Tensor, stage: torch.Tensor, m: int) -> None:
        """Per-layer gather into / scatter from stage[:m] (rows = slots)."""
        fast = self.kernel == "index"
        for rows, (c0, c1) in zip(self._rows, self._cols):
            part = stage[:m, c0:c1]
            if op == "gather":
                if fast:
                    torch.ops.aten.index.Tensor_out(rows, [ids], out=part)
                else:
                    torch.index_select(rows, 0, ids, out=part)
            elif fast:
                rows.index_put_((ids,), part)
            else:
                rows.index_copy_(0, ids, part)

    def _run(self, op: str, ids: list[int]) -> StagingOp:
        if self._prev is not None:
            self._prev.wait()
            self._prev = None
        n = len(ids)
        if n == 0:
            return StagingOp(None, 0)
        if not self.is_cuda:
            self._kernels(op, torch.tensor(ids, dtype=torch.int64), self._host_w, n)
            return StagingOp(None, n)
        with torch.cuda.device(self.device):
            chunks = self.chunks(n, op)
            # Capture first: both streams are idle (the previous op was waited for).
            graphs = [self._graph(op, c0, c1 - c0, c % 2) for c, (c0, c1) in enumerate(chunks)]
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            self._ids_np[:n] = ids
            K, D = self._kstream, self._dstream
            K.wait_event(ready)
            with torch.cuda.stream(K):
                self._ids_dev[:n].copy_(self._ids_host[:n], non_blocking=True)
            for c, (c0, c1) in enumerate(chunks):
                m, b, graph = c1 - c0, c % 2, graphs[c]
                stage = self._dev[b]
                if op == "gather":
                    if c >= 2:
                        K.wait_event(self._free[b])
                    with torch.cuda.stream(K):
                        if graph is not None:
                            graph.replay()
                        else:
                            self._kernels(op, self._ids_dev[c0:c1], stage, m)
                    self._filled[b].record(K)
                    D.wait_event(self._filled[b])
                    with torch.cuda.stream(D):
                        self._host_w[c0:c1].copy_(stage[:m], non_blocking=True)
                    self._free[b].record(D)
                else:
                    if c >= 2:
                        D.wait_event(self._free[b])
                    with torch.cuda.stream(D):
                        stage[:m].copy_(self._host_w[c0:c1], non_blocking=True)
                    self._filled[b].record(D)
                    K.wait_event(self._filled[b])
                    with torch.cuda.stream(K):
                        if graph is not None:
                            graph.replay()
                        else:
                            self._kernels(op, self._ids_dev[c0:c1], stage, m)
                    self._free[b].record(K)
            done = torch.cuda.Event()
            done.record(D if op == "gather" else K)
        self._prev = StagingOp(done, n, self.device)
        return self._prev

    def _graph(self, op: str, c0: int, m: int, b: int) -> torch.cuda.CUDAGraph | None:
        if not self.use_cuda_graphs:
            return None
        key = (op, c0, m, b)
        g = self._graphs.get(key)
        if g is None:
            if len(self._graphs) >= self.max_graphs:
                return None
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.stream(self._kstream):
                    g.capture_begin(capture_error_mode="thread_local")
                    try:
                        self._kernels(op, self._ids_dev[c0 : c0 + m], self._dev[b], m)
                    finally:
                        g.capture_end()
            except RuntimeError:
                self.use_cuda_graphs = False  # capture unsupported here: stay eager
                return None
            self._graphs[key] = g
        return g
