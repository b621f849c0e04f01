"""HybridPDConnector with tensor parallelism: real vLLM CPU engines at TP2 and TP1, real NIXL + gRPC.

Each rank of an engine runs on its own core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``; a TP1
engine on the second core). The prefill instance tells decode every rank's handshake
port (``remote_ports``); each decode rank reads what its heads need:

* gemma3 (sliding + full attention) TP2 -> TP2, TP2 -> TP1 and TP1 -> TP2, and qwen3-next's
  TP2 -> TP2 (GDN state included) run through the servers and the proxy
  (tests/e2e/test_pd_tp_proxy.py, which replaced their in-process twins here);
* qwen3-next across sizes (decode's ``allow_mamba_cross_tp`` on): first the GDN state a TP2
  prefill computes, assembled into TP1's layout by ``pd_tp.mamba_slices`` (conv q/k/v channel
  parts, SSM v heads), equals a TP1 engine's own state bit for bit in the first GDN layer and
  within bf16 TP noise after (a wrong rank or part is far off). Then P/D TP2 -> TP1 and
  TP1 -> TP2, 2 turns each: right after each decode rank's READs (on its read thread, before
  any forward step) its blocks are copied out and compared with the prefill ranks' blocks,
  byte for byte: attention KV as the prefill ranks' kernel rows side by side (heads outermost)
  sliced for this rank's heads, GDN conv and SSM state as ``mamba_slices`` assembles it, every
  layer, 0 bytes may differ; the provenance line counts exactly those bytes. The output is
  compared with a recompute on decode for information only: the CPU GDN kernel runs only in
  bfloat16 and state computed at another TP size is not this size's bits
  (``pd_tp.MAMBA_TP_NOT_ENABLED``). Planted in the real READs' spans, each must make bytes
  differ: the prefill ranks' shares swapped, and the SSM state one v head off.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import uuid

import pytest

from hybridkv.cli.agentic_demo import common_prefix
from hybridkv.cli.harness.llm_engine import (
    Session,
    compare,
    generate,
    make_llm,
    metric,
    shutdown,
    tiny_model,
)
from hybridkv.cli.harness.llm_engine import pd_decode as _decode
from hybridkv.cli.harness.llm_engine import pd_prefill as _prefill
from hybridkv.store.cpu_affinity import usable_cpus
from tests.docs_tables import observe
from tests.e2e.test_pd_connector import _expected_blocks, pd_config

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")

_CPUS = sorted(usable_cpus())
BIND = {2: f"{_CPUS[0]}|{_CPUS[-1]}", 1: f"{_CPUS[-1]}"}
# gemma3 (here TP2 -> TP2; across sizes through the proxy, tests/e2e/test_pd_tp_proxy.py, also in
# float32): float32, because KV a TP2 prefill computes is not the bits a
# TP1 engine computes (another reduction order in the row-parallel layers): in bfloat16 a
# correct TP2 -> TP1 hand-over matched its recompute for 7 tokens, then split at a greedy
# near-tie the check could not excuse (and the TP2 engine's own output differed from the
# TP1 recompute at token 4). In float32 those differences are far below the check's tolerance,
# while another block's KV or another rank's heads still change the output.
MODELS = {"gemma3": {"dtype": "float32"}, "qwen3next": {"block_size": 256}}

_TP_LINE = re.compile(
    r"hybridkv P/D: read (\d+) blocks \((\d+) bytes\) for (\S+) from \S+ at \S+ \(per group \[([\d, ]*)\]\) "
    r"rank (\d+)/(\d+) <- prefill ranks \[([\d, ]*)\]/(\d+)"
)
_FAILED = re.compile(
    r"hybridkv P/D: (READ for \S+ .*failed or was refused|read of \S+ .*(failed|discarded|refused))"
)


@pytest.fixture(scope="module", autouse=True)
def _env():
    if len(_CPUS) < 2:
        pytest.fail(f"TP2 needs two usable CPUs (one per rank), this runner has {_CPUS}")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(callable)
    yield
    mp.undo()


def start(kind: str, role: str, tp: int, **extra):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", BIND[tp])
    try:
        return make_llm(
            tiny_model(kind),
            pd_config(role, **extra),
            tensor_parallel_size=tp,
            max_model_len=2048,
            disable_log_stats=False,
            **MODELS[kind],
        )
    finally:
        mp.undo()  # the engine's processes have their environment already


def _geometry(worker):  # noqa: ANN001, ANN202 - runs in each decode worker
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group()._worker
    return [
        (
            int(g.kv_cache_spec.block_size),
            0 if lg is None else lg.object_bytes,
            "Mamba" in type(g.kv_cache_spec).__name__,
        )
        for g, lg in zip(
            w._kv_cache_config.kv_cache_groups, w._transport.layout.groups, strict=True
        )
    ]


def provenance(log: str, decode_tp: int, prefill_tp: int, want: list[int], geometries) -> None:
    """One line per decode rank, each naming the prefill ranks its heads come from, the
    blocks per group and its own whole blocks' bytes; no failed or refused READ."""
    failed = [line for line in log.splitlines() if _FAILED.search(line)]
    # The cause is logged on its own line before the summary (a side-channel HandshakeError,
    # a refused job, a crash's traceback): shown with it, so a failure in CI names its cause.
    causes = [
        line
        for line in log.splitlines()
        if ("WARNING" in line or "ERROR" in line or "Traceback" in line) and "hybridkv" in line
    ]
    assert not failed, (
        f"a READ failed or was refused: {failed}; hybridkv warnings and errors: {causes}"
    )
    lines = _TP_LINE.findall(log)
    assert sorted(int(x[4]) for x in lines) == list(range(decode_tp)), (
        f"one read line per decode rank: {lines}"
    )
    for blocks, nbytes, _req, groups, rank, dtp, pranks, ptp in lines:
        rank = int(rank)
        assert (int(dtp), int(ptp)) == (decode_tp, prefill_tp)
        per_group = [int(x) for x in groups.split(",")] if groups.strip() else []
        assert per_group == want, f"rank {rank}: blocks per group {per_group}, expected {want}"
        if prefill_tp == decode_tp:
            ranks = [rank]
        elif prefill_tp > decode_tp:
            k = prefill_tp // decode_tp
            ranks = list(range(rank * k, rank * k + k))
        else:
            ranks = [rank * prefill_tp // decode_tp]
        assert [int(x) for x in pranks.split(",")] == ranks, (
            f"rank {rank} read prefill ranks {pranks}"
        )
        sizes = [b for _, b, _ in geometries[rank]]
        assert int(nbytes) == sum(n * b for n, b in zip(want, sizes, strict=True)), (
            f"rank {rank}: {nbytes} bytes"
        )


def observe_pd_tp(label: str, blocks: list[list[int]]) -> None:
    """docs/results.md's P/D-across-TP table: the blocks per group each decode rank read per
    turn (asserted by ``provenance``) and that every turn equalled its recompute."""
    observe(
        "pd-tp",
        label,
        {
            "blocks per group, turns 1-3 (SW, FA / Mamba, FA)": " ".join(
                "[" + ",".join(map(str, w)) + "]" for w in blocks
            ),
            "= recompute": f"{len(blocks)}/{len(blocks)}",
        },
    )


def _block_bytes(worker, rank: int, group: int, block: int) -> list[bytes] | None:  # noqa: ANN001
    """On TP rank ``rank``: the bytes of block ``block`` of every layer of ``group``."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != rank:
        return None
    (addrs,), sizes = (
        get_kv_transfer_group()._worker._transport.layout.groups[group].regions([block])
    )
    return [ctypes.string_at(a, n) for a, n in zip(addrs, sizes[0], strict=True)]


def _state_splits(worker, group: int) -> list[list[int]]:  # noqa: ANN001
    """This rank's GDN state splits as its handshake descriptor carries them."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return [list(t) for t in get_kv_transfer_group()._worker._local.groups[group].state_splits]


def _rel(a: bytes, b: bytes, dtype) -> float:  # noqa: ANN001
    """mean |a - b| / mean |b| over the values ``a`` and ``b`` hold."""
    import torch

    x, y = (torch.frombuffer(bytearray(v), dtype=dtype).double() for v in (a, b))
    return float((x - y).abs().mean() / y.abs().mean())


def gdn_state_check(prefill2, local1, seed: int) -> list[tuple]:
    """The GDN state a TP2 prefill computes for a prompt, assembled by ``pd_tp.mamba_slices``
    from both ranks' state blocks into TP1's layout (from the splits each worker sends in
    its handshake), against the state a TP1 engine computes for the same prompt. Also
    assembled with the ranks swapped and with the conv's q and k parts swapped (planted).
    Returns per layer (conv bits equal, ssm bits equal, conv/ssm rel. diff re-sliced,
    ranks swapped, q/k swapped)."""
    import torch

    from hybridkv.connector.pd_tp import StateSplit, mamba_slices

    prompt = Session(seed=seed).prompt
    p2, p1 = _prefill(prefill2, prompt), _prefill(local1, prompt)
    b2 = [[b for b in p2["remote_block_ids"][0] if b][-1]] * 2
    b1 = [b for b in p1["remote_block_ids"][0] if b][-1]
    rank_bytes = [prefill2.collective_rpc(_block_bytes, args=(r, 0, b2[r]))[r] for r in (0, 1)]
    want = local1.collective_rpc(_block_bytes, args=(0, 0, b1))[0]
    local = tuple(
        StateSplit.from_wire(t) for t in local1.collective_rpc(_state_splits, args=(0,))[0]
    )
    remote = [
        tuple(StateSplit.from_wire(t) for t in sp)
        for sp in prefill2.collective_rpc(_state_splits, args=(0,))
    ]
    assert remote[0] == remote[1] and len(local) == 2, (local, remote)
    conv, ssm = local
    conv_dt, ssm_dt = (
        torch.bfloat16,
        torch.float32,
    )  # CPU: bf16 conv, SSM reset to fp32 (platforms/cpu.py)
    assert ssm.unit == 64 * 64 * 4 and conv.unit == 2, (
        local
    )  # SD conv layout: unit = one bf16 channel

    def assemble(layer: int, order, qk: bool = False) -> bytes:
        out = bytearray(len(want[layer]))
        for p, src in zip((0, 1), order, strict=True):
            spans = mamba_slices(local, remote[p], 1, 2, 0, p)
            if qk:  # per conv row: the q span takes the peer's k bytes and vice versa
                for i in range(conv.rows):
                    q, k = spans[3 * i], spans[3 * i + 1]
                    spans[3 * i], spans[3 * i + 1] = (q[0], k[1], q[2]), (k[0], q[1], k[2])
            for lo, ro, n in spans:
                out[lo : lo + n] = src[layer][ro : ro + n]
        return bytes(out)

    rows = []
    for layer in range(len(want)):
        c0, c1, s0, s1 = conv.offset, conv.offset + conv.nbytes, ssm.offset, ssm.offset + ssm.nbytes
        w = want[layer]
        got = assemble(layer, rank_bytes)
        swapped = assemble(layer, rank_bytes[::-1])
        qk = assemble(layer, rank_bytes, qk=True)
        rows.append(
            (
                layer,
                got[c0:c1] == w[c0:c1],
                got[s0:s1] == w[s0:s1],
                round(_rel(got[c0:c1], w[c0:c1], conv_dt), 4),
                round(_rel(got[s0:s1], w[s0:s1], ssm_dt), 4),
                round(_rel(swapped[c0:c1], w[c0:c1], conv_dt), 4),
                round(_rel(swapped[s0:s1], w[s0:s1], ssm_dt), 4),
                round(_rel(qk[c0:c1], w[c0:c1], conv_dt), 4),
            )
        )
    return rows


# ------------------------------------------------- qwen3-next across TP sizes: the READ, byte for byte


def _probe(worker, plant: str | None) -> int:  # noqa: ANN001
    """Decode worker: keep a copy of the blocks each successful READ wrote, taken on the read
    thread before the request is reported received (so before any forward step touches them).
    ``plant``: a fault put into the spans the real READs use ("swap": each prefill rank's share
    lands where the other's belongs; "ssm_shift": the SSM state one v head off). Returns the rank."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    from hybridkv.connector.pd_tp import rank_reads, read_spans

    w = get_kv_transfer_group()._worker
    if not hasattr(w, "_probe_orig"):
        w._probe_orig = (w._read, w._slices)
    read, slices = w._probe_orig
    w._probe_snaps = []

    def probed_read(job):  # noqa: ANN001, ANN202
        ok, straggler = read(job)
        if ok:
            groups = w._transport.layout.groups
            snap = []
            for g, ids in enumerate(job.local_block_ids):
                blocks = []
                for b in ids:
                    (addrs,), sizes = groups[g].regions([b])
                    blocks.append(
                        [ctypes.string_at(a, n) for a, n in zip(addrs, sizes[0], strict=True)]
                    )
                snap.append(blocks)
            w._probe_snaps.append(
                (
                    [list(x) for x in job.remote_block_ids],
                    [list(x) for x in job.local_block_ids],
                    snap,
                )
            )
        return ok, straggler

    def planted_slices(part, peer_layout, job):  # noqa: ANN001, ANN202
        if plant == "swap":
            other = [q for q in w._plan(job) if q.prefill_rank != part.prefill_rank]
            if other:  # several prefill ranks: each one's share lands where the other's belongs
                return slices(other[0], peer_layout, job)
            # one prefill rank: this decode rank takes the other decode rank's share of it
            o = (w._s.tp_rank + 1) % w._s.tp_size
            opart = rank_reads(o, w._s.tp_size, len(job.remote_ports), w._s.total_kv_heads)[0]
            kernel_rows = [() if g is None else g.kernel_rows for g in w._transport.layout.groups]
            return read_spans(
                opart,
                w._local.groups,
                peer_layout.groups,
                kernel_rows,
                job.remote_block_ids,
                w._s.tp_size,
                len(job.remote_ports),
                o,
            )
        out = slices(part, peer_layout, job)
        if plant == "ssm_shift" and out is not None:
            # one v head off, inside both sides' SSM state (a span the transport would refuse is
            # not a silent fault): the destination one head lower where there is room, else the
            # source one head higher or lower (a span with no room for either stays)
            for g, grp in enumerate(out):
                if grp is not None and "Mamba" in w._local.groups[g].spec:
                    ssm, rssm = w._local.groups[g].splits()[1], peer_layout.groups[g].splits()[1]
                    rend = rssm.offset + rssm.nbytes
                    shifted = []
                    for spans in grp:
                        row = []
                        for lo, ro, n in spans:
                            if lo >= ssm.offset:
                                if lo - ssm.unit >= ssm.offset:
                                    lo -= ssm.unit
                                elif ro + ssm.unit + n <= rend:
                                    ro += ssm.unit
                                elif ro - ssm.unit >= rssm.offset:
                                    ro -= ssm.unit
                            row.append((lo, ro, n))
                        shifted.append(row)
                    out[g] = shifted
        return out

    w._read = probed_read
    w._slices = planted_slices if plant else slices
    return int(get_tensor_model_parallel_rank())


def _take_snaps(worker) -> list:  # noqa: ANN001
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group()._worker
    snaps, w._probe_snaps = w._probe_snaps, []
    return snaps


def _facts(worker) -> list[tuple]:  # noqa: ANN001
    """Per group: (Mamba?, kernel rows per region, state splits) as this rank's handshake has them."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hybridkv.connector.pd_tp import region_rows

    w = get_kv_transfer_group()._worker
    out = []
    for lg, desc in zip(w._transport.layout.groups, w._local.groups, strict=True):
        if lg is None or desc is None:
            out.append((False, [], []))
            continue
        out.append(
            (
                "Mamba" in desc.spec,
                region_rows(desc.block_bytes, lg.kernel_rows),
                [list(t) for t in desc.state_splits],
            )
        )
    return out


def _all_blocks(worker, block_ids: list[list[int]]) -> list[dict[int, list[bytes]]]:  # noqa: ANN001
    """This rank's bytes of the given blocks, per group: {block: [region bytes]}."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    groups = get_kv_transfer_group()._worker._transport.layout.groups
    out = []
    for g, ids in enumerate(block_ids):
        got = {}
        for b in ids:
            if b:
                (addrs,), sizes = groups[g].regions([b])
                got[b] = [ctypes.string_at(a, n) for a, n in zip(addrs, sizes[0], strict=True)]
        out.append(got)
    return out


def _diff(a: bytes, b: bytes) -> int:
    import numpy as np

    assert len(a) == len(b)
    return int((np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8)).sum())


def expected_read(
    snap, prefill_blocks, dfacts, pfacts, rank: int, decode_tp: int, prefill_tp: int
) -> list[list]:
    """Per group [blocks, bytes compared, bytes differing]: the blocks decode rank ``rank``'s READ
    wrote against the prefill ranks' blocks assembled for its heads. Attention: each kernel row of
    the model's (all ranks') block is the prefill ranks' rows side by side (heads outermost), this
    rank's row its slice of it. GDN state: ``pd_tp.mamba_slices`` from each prefill rank it reads,
    every byte of the conv and SSM states compared (the page padding is not state)."""
    from hybridkv.connector.pd_tp import StateSplit, mamba_slices

    remote_ids, local_ids, blocks = snap
    readers = (
        range(rank * prefill_tp // decode_tp, rank * prefill_tp // decode_tp + 1)
        if decode_tp > prefill_tp
        else range(rank * (prefill_tp // decode_tp), (rank + 1) * (prefill_tp // decode_tp))
    )
    out = []
    for g, (rids, lids, got_blocks) in enumerate(zip(remote_ids, local_ids, blocks, strict=True)):
        mamba, rows, splits = dfacts[g]
        n_blocks, compared, differing = 0, 0, 0
        for rb, _lb, got in zip(rids, lids, got_blocks, strict=True):
            n_blocks += 1
            for i, region in enumerate(got):
                if mamba:
                    local = tuple(StateSplit.from_wire(t) for t in splits)
                    want = bytearray(region)
                    covered = 0
                    for p in readers:
                        remote = tuple(StateSplit.from_wire(t) for t in pfacts[p][g][2])
                        for lo, ro, n in mamba_slices(
                            local, remote, decode_tp, prefill_tp, rank, p
                        ):
                            want[lo : lo + n] = prefill_blocks[p][g][rb][i][ro : ro + n]
                            covered += n
                    assert covered == sum(s.nbytes for s in local), (covered, local)
                    compared += covered
                    differing += _diff(bytes(want), region)
                else:
                    k = rows[i]
                    prow = len(prefill_blocks[0][g][rb][i]) // k
                    drow = len(region) // k
                    want = b"".join(
                        b"".join(
                            prefill_blocks[p][g][rb][i][j * prow : (j + 1) * prow]
                            for p in range(prefill_tp)
                        )[rank * drow : (rank + 1) * drow]
                        for j in range(k)
                    )
                    compared += len(region)
                    differing += _diff(want, region)
        out.append([n_blocks, compared, differing])
    return out


def cross_tp_read(
    prefill,
    decode,
    capfd,
    prefill_tp: int,
    decode_tp: int,
    prompt: list[int],
    plant: str | None = None,
    max_tokens: int = 8,
):  # noqa: ANN201
    """One P/D request across TP sizes with the decode READs probed (``plant``: a fault in the
    spans). Returns (per decode rank per group [blocks, bytes compared, bytes differing], the
    decode output, the log)."""
    ranks = decode.collective_rpc(_probe, args=(plant,))
    assert ranks == list(range(decode_tp)), ranks
    params = _prefill(prefill, prompt)
    assert params and len(params["remote_ports"]) == prefill_tp, params
    # The prefill ranks' blocks, read while the lease holds them (nothing writes them until released).
    prefill_blocks = prefill.collective_rpc(_all_blocks, args=(params["remote_block_ids"],))
    capfd.readouterr()
    got = _decode(decode, prompt, params, max_tokens=max_tokens)
    log = "".join(capfd.readouterr())
    snaps = decode.collective_rpc(_take_snaps)
    failed = [line for line in log.splitlines() if _FAILED.search(line) or "refused" in line]
    assert [len(s) for s in snaps] == [1] * decode_tp, (
        f"one probed READ per decode rank: {snaps}: {failed}"
    )
    dfacts, pfacts = decode.collective_rpc(_facts), prefill.collective_rpc(_facts)
    per_rank = [
        expected_read(snaps[r][0], prefill_blocks, dfacts[r], pfacts, r, decode_tp, prefill_tp)
        for r in range(decode_tp)
    ]
    return per_rank, got, log, params


def mamba_cross_tp(
    prefill, decode, capfd, prefill_tp: int, decode_tp: int, seed: int, label: str, turns: int = 2
) -> list[tuple]:
    """``turns`` agentic turns across TP sizes with allow_mamba_cross_tp on: each decode rank's READ
    wrote exactly the prefill ranks' attention KV and GDN state re-sliced for its heads (every byte
    compared, 0 differ), the provenance line says so; the output is compared with a recompute on
    decode for information only (bf16 TP noise). Then each planted fault must make bytes differ."""
    geometries = decode.collective_rpc(_geometry)
    align = math.lcm(*(bs for bs, _, _ in geometries[0]))
    dfacts = decode.collective_rpc(_facts)
    session = Session(seed=seed, first_tokens=500, growth_tokens=300)
    rows = []
    for turn in range(1, turns + 1):
        local_before = metric(decode, "vllm:prefix_cache_hits")
        per_rank, got, log, params = cross_tp_read(
            prefill, decode, capfd, prefill_tp, decode_tp, session.prompt
        )
        local_hit = int(metric(decode, "vllm:prefix_cache_hits") - local_before)
        handover = (len(session.prompt) - 1) // align * align
        want = _expected_blocks(geometries[0], params["remote_block_ids"], local_hit, handover)
        # the bytes each rank's provenance line counts: whole attention blocks, the GDN states (no padding)
        sizes = [
            [
                sum(state_bytes(splits)) * len(rows_) if mamba else b
                for (mamba, rows_, splits), (_, b, _) in zip(dfacts[r], geometries[r], strict=True)
            ]
            for r in range(decode_tp)
        ]
        provenance(log, decode_tp, prefill_tp, want, [[(0, s, False) for s in sz] for sz in sizes])
        for r, groups in enumerate(per_rank):
            assert [g[0] for g in groups] == want, (r, groups, want)
            assert all(g[2] == 0 for g in groups), (
                f"{label} turn {turn} rank {r}: bytes differ {groups}"
            )
        ref = generate(decode, session.prompt, cache_salt=f"pd-tp-{label}-{uuid.uuid4()}")
        same = common_prefix(got.token_ids, ref.token_ids)
        cmp = compare(got, ref)
        rows.append(
            (
                turn,
                len(session.prompt),
                handover,
                local_hit,
                want,
                per_rank,
                f"{same}/{len(ref.token_ids)}",
                cmp.matches,
                cmp.why,
            )
        )
        session.extend(got.token_ids)
    planted = []
    for i, plant in enumerate(("swap", "ssm_shift")):
        prompt = Session(seed=seed + 100 + i, first_tokens=500).prompt
        per_rank, _got, log, _ = cross_tp_read(
            prefill, decode, capfd, prefill_tp, decode_tp, prompt, plant=plant
        )
        assert _TP_LINE.search(log), f"planted {plant}: the READ must have happened"
        planted.append((plant, per_rank))
    decode.collective_rpc(_probe, args=(None,))
    with capfd.disabled():
        print(
            f"\nP/D {label} (prefill TP{prefill_tp} -> decode TP{decode_tp}, allow_mamba_cross_tp): turn, prompt, "
            "hand-over, decode's own hit, blocks read per group, per rank per group [blocks, bytes compared, "
            f"bytes differing], output tokens = TP{decode_tp} recompute, compare() matches (information only), why"
        )
        for r in rows:
            print("  ", *r)
        for plant, per_rank in planted:
            print(
                f"   planted {plant}: per rank per group [blocks, bytes compared, bytes differing] {per_rank}"
            )
    for plant, per_rank in planted:
        mamba_groups = [g for g, f in enumerate(dfacts[0]) if f[0]]
        assert all(per_rank[r][g][2] > 0 for r in range(decode_tp) for g in mamba_groups), (
            f"planted {plant} went unnoticed in the GDN state: {per_rank}"
        )
        if plant == "swap":
            assert all(grp[2] > 0 for r in range(decode_tp) for grp in per_rank[r] if grp[0]), (
                f"planted swap went unnoticed in a group: {per_rank}"
            )
    return rows


def state_bytes(wire: list[list[int]]) -> list[int]:
    """Each state's bytes in one layer's page, from the handshake's splits."""
    from hybridkv.connector.pd_tp import StateSplit

    return [StateSplit.from_wire(t).nbytes for t in wire]


def test_qwen3next_gdn_state_resliced_tp2_to_tp1_and_tp1_to_tp2(capfd):
    # (qwen3-next TP2 -> TP2 runs through the servers and the proxy instead, in CI:
    # tests/e2e/test_pd_tp_proxy.py; this pair was its in-process twin.)
    prefill2 = start("qwen3next", "kv_producer", 2)
    # kv_both: it also prefills (the state check, then the TP1 -> TP2 pair's prefill side)
    decode1 = start("qwen3next", "kv_both", 1, allow_mamba_cross_tp=True)
    try:
        # The GDN state is re-sliced exactly: the first GDN layer's state (input: the
        # embeddings, no row-parallel reduction before it) is bit for bit TP1's; later layers
        # differ by bf16 TP noise, far below what a wrong rank or part gives.
        rows = gdn_state_check(prefill2, decode1, seed=49)
        with capfd.disabled():
            print(
                "\nqwen3-next GDN state TP2 -> TP1 layout vs TP1's own: layer, conv bits equal, ssm bits equal, "
                "rel. diff conv/ssm re-sliced, ranks swapped conv/ssm, q/k swapped conv"
            )
            for r in rows:
                print("  ", *r)
        assert rows[0][1] and rows[0][2], rows[0]
        for layer, _ce, _se, conv_d, ssm_d, sw_c, sw_s, qk_c in rows:
            assert conv_d < 0.05 and ssm_d < 0.05, (layer, conv_d, ssm_d)
            assert sw_c > 0.5 and sw_s > 0.5 and qk_c > 0.5, (layer, sw_c, sw_s, qk_c)
        got = mamba_cross_tp(prefill2, decode1, capfd, 2, 1, seed=46, label="qwen3next-tp2-tp1")
        observe_mamba_cross_tp("qwen3next-tp2-tp1", got)
    finally:
        shutdown(prefill2)
    decode2 = start("qwen3next", "kv_consumer", 2, allow_mamba_cross_tp=True)
    try:
        got = mamba_cross_tp(decode1, decode2, capfd, 1, 2, seed=47, label="qwen3next-tp1-tp2")
        observe_mamba_cross_tp("qwen3next-tp1-tp2", got)
    finally:
        shutdown(decode2, decode1)


def observe_mamba_cross_tp(label: str, rows: list[tuple]) -> None:
    """docs/results.md's P/D-across-TP table: blocks per group per turn (provenance asserted) and
    that the READ wrote the re-sliced state and KV byte for byte (the output is not asserted)."""
    observe(
        "pd-tp",
        label,
        {
            "blocks per group, turns 1-3 (SW, FA / Mamba, FA)": " ".join(
                "[" + ",".join(map(str, r[4])) + "]" for r in rows
            ),
            "= recompute": f"state + KV byte-exact {len(rows)}/{len(rows)}; output not asserted",
        },
    )
