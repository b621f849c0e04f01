"""P/D across TP sizes through ``hybridkv proxy``: qwen3-next (GDN linear attention + full
attention) and gemma3 (sliding window + full attention). In CI (they replaced the in-process
TP2 -> TP2 pairs of tests/e2e/test_pd_tp.py, which keeps the byte-exact cross-TP checks).

What a P/D user at tensor parallelism runs: ``PDStack`` starts a TP2 prefill and a TP2
decode OpenAI server (each rank on its own core, ``pd_stack.rank_cpus``) and the proxy
subprocess; every turn is one client POST to the proxy's port. Every P/D TP pair runs here,
through the servers: qwen3-next TP2 -> TP2 -> (swap) TP1, and gemma3 TP2 -> TP2 -> (swap) TP1
and TP1 -> TP2. (test_pd_tp.py keeps only the in-process byte-exact qwen3-next cross-TP checks.)

gemma3 (sliding window + full attention, float32; ``gemma3_through_the_proxy``): one stack
per prefill size, the decode tier replaced between pairs (``PDStack.replace_decode``). A 4-rank
gemma3 stack starves on 2 cores (its first requests take about a minute),
so one unchecked request through the proxy first takes each engine's first forward passes and
decode's handshakes (bounded by HANDSHAKE_TIMEOUT_S, 120 s); then the same 3 turns and checks as
qwen3-next, the sliding window's blocks derived from vLLM's rule (``prefill_kept_blocks``), and
the planted one-block shift on the last prefill rank (rank 1 of a TP2 prefill: decode's rank 1,
or its one rank, reads its heads; a TP1 prefill's rank 0: both decode ranks read their halves).

3 turns (600 / 908 / 1216 tokens, each prompt = previous prompt + answer + 300 tokens):
* greedy tokens + top-5 logprobs == a recompute on the decode server under a fresh
  ``cache_salt`` (llm_engine.compare: near-ties excused only when seen from both runs);
* provenance: each decode rank logged exactly one read line for the turn, naming its own
  prefill rank, blocks per group == what it lacked (the GDN state block at the hand-over +
  every full-attention block in [its own prefix hit, hand-over)), bytes == those whole
  blocks of its own layout; no failed or refused READ, no lease expiry;
Control: the proxy sends its two legs back to back, so there is no moment between them to
plant a fault; the test sends them itself (as the proxy does: prefill with
``do_remote_decode``, then decode with the answer's ``kv_transfer_params``) and in between,
on prefill rank 1 only, overwrites one full-attention block the hand-over lists with another
block's real KV (a one-block shift, test_pd_tp's plant). Both decode ranks must read it, and
the output must then differ from the recompute.

Then the decode tier is replaced, on the proxy's ``--decode`` port, by a TP1 instance with
``allow_mamba_cross_tp`` (``PDStack.replace_decode``; the TP2 prefill keeps running): 2 turns,
each one POST to the proxy; decode's one rank logs one read line naming prefill ranks [0, 1],
blocks per group == what it lacked, bytes == its whole attention blocks + the GDN conv and SSM
states without page padding (state_bytes); pulled == hand-over - own hit; no failed READ. Its
output is printed, not asserted (bf16-only CPU GDN kernel: test_pd_tp.py says why); the bytes
themselves are compared in process there.

Reliability on 2 shared cores (measured with timing logs around every side-channel call):
the stalls are CPU starvation of whole worker processes for 15-60 s while both engines step
(one per run, at a random turn): a ClaimLease reached prefill rank 0's handler 56 s after the
decode sent it (3.9 s of its 60 s bound left), a decode rank's peer set-up took 15 s. Hence
``handshake_timeout_s`` 120 s and ``lease_s`` 300 s below, and one OpenMP thread per rank
(``pd_stack.disjoint_core_envs``). One failure mode is NOT reachable from config: gRPC gives
up on a new connection whose peer has not sent its HTTP/2 SETTINGS within 20 s (its
min_reconnect_backoff default), whatever the RPC deadline ("connection attempt timed out
before receiving SETTINGS frame", the lead's two CI failures): that needs the channel option
in connector/pd_handshake.py (reported, not applied here).

The geometry and the plant run inside the servers' workers through vLLM's own
``--worker-extension-cls`` + ``POST /collective_rpc`` (dev mode; method names only, no code
over HTTP): :class:`PDProbe` below.
"""

from __future__ import annotations

import ctypes
import math
import time
import uuid
from pathlib import Path

import pytest

from hybridkv.cli.harness.llm_engine import LogTail
from tests.docs_tables import observe

pytestmark = pytest.mark.e2e

TP = 2
KIND = "qwen3next"
SERVER_ARGS = ["--block-size", "256"]  # as the in-process qwen3-next P/D cases
# Shorter turns than the in-process cases (1000 + 500 per turn): 600 / 908 / 1216 tokens still
# hand over 2 / 3 / 4 blocks (the GDN state + 1-3 full-attention blocks the decode lacks), in
# less of the suite's time: the recompute of each prompt at TP2 on two shared cores dominates.
TURN_TOKENS = {"first_tokens": 600, "growth_tokens": 300}
# The side channel's bound (default 5 s) and the lease (default 60 s), raised: with 4 ranks, 2
# engine cores, 2 API servers and the proxy on 2 shared cores, a prefill rank's gRPC answers
# (first handshake, lease claims) can come tens of seconds late, and a late answer discards the
# read (decode recomputes: the output is still right, the provenance check fails). A failed
# READ with no TransferError, lease refusal or bad span logged (those log a line the provenance
# check matches) points at the side channel's bound. These bounds only limit how long a starved
# step may take: a run where nothing stalls never waits on them.
# The READ's bound too (default 30 s): a READ needs the prefill rank's progress thread, and these
# runs starve whole worker processes for 15-60 s; at 30 s decode logs
# "[pd_read:TransferTimeout] READ ... not done after 30 s" and recomputes (output right,
# provenance failed).
HANDSHAKE_TIMEOUT_S = 120.0
READ_TIMEOUT_S = 120.0
LEASE_S = 300.0  # outlives a READ (READ_TIMEOUT_S) + claims bounded by HANDSHAKE_TIMEOUT_S
DECODE_EXTRA = {"handshake_timeout_s": HANDSHAKE_TIMEOUT_S, "read_timeout_s": READ_TIMEOUT_S}
PROBE = f"{__name__}.PDProbe"
# A request's bound: the proxy's own (--timeout-s, 600 s). A client that gives up first turns a
# starved turn into a failure the proxy itself would not have made (a POST that fails in
# urllib3 hides the cause from the log).
REQUEST_TIMEOUT_S = 600
BAD_SIGNS = (
    "pd_lease_expired",
    "pd_read_outlived_lease",
    "[pd_read:",
    "[pd_refused]",
    "[pd_release:",
    "P/D handshake with",
)


class PDProbe:
    """Mixed into each server's workers (``--worker-extension-cls``); called by name over
    ``/collective_rpc``, whose arguments arrive as strings."""

    def hkv_pd_geometry(self) -> list[list]:
        """Per KV cache group: block size, this rank's bytes per block (all layers), Mamba?"""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        w = get_kv_transfer_group()._worker
        return [
            [
                int(g.kv_cache_spec.block_size),
                0 if lg is None else int(lg.object_bytes),
                "Mamba" in type(g.kv_cache_spec).__name__,
            ]
            for g, lg in zip(
                w._kv_cache_config.kv_cache_groups, w._transport.layout.groups, strict=True
            )
        ]

    def hkv_pd_windows(self) -> list[int]:
        """Per KV cache group: vLLM's sliding window in tokens (its spec's), 0 for none."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return [
            int(getattr(g.kv_cache_spec, "sliding_window", None) or 0)
            for g in get_kv_transfer_group()._worker._kv_cache_config.kv_cache_groups
        ]

    def hkv_module_file(self) -> list[str]:
        """Where this worker imported hybridkv's connector from (the code under test?)."""
        import hybridkv.connector

        return [str(hybridkv.connector.__file__)]

    def hkv_pd_facts(self) -> list[list]:
        """Per group: [Mamba?, kernel rows per region, state splits] as this rank's handshake
        descriptor has them (what its provenance line's bytes are made of)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from hybridkv.connector.pd_tp import region_rows

        w = get_kv_transfer_group()._worker
        out = []
        for lg, desc in zip(w._transport.layout.groups, w._local.groups, strict=True):
            if lg is None or desc is None:
                out.append([False, [], []])
            else:
                out.append(
                    [
                        "Mamba" in desc.spec,
                        list(region_rows(desc.block_bytes, lg.kernel_rows)),
                        [list(t) for t in desc.state_splits],
                    ]
                )
        return out

    def hkv_pd_shift_block(self, rank: str, group: str, victim: str, source: str) -> list[int]:
        """On TP rank ``rank`` only: block ``source``'s real KV over block ``victim`` in every
        layer of ``group``. Returns [bytes written] (a list: /collective_rpc keeps lists)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != int(rank):
            return [0]
        layout = get_kv_transfer_group()._worker._transport.layout.groups[int(group)]
        (dst,), sizes = layout.regions([int(victim)])
        (src,), _ = layout.regions([int(source)])
        written = 0
        for d, s, n in zip(dst, src, sizes[0], strict=True):
            ctypes.memmove(d, s, n)
            written += n
        return [written]


def _http_session():  # noqa: ANN202 - a requests.Session
    """One TCP connection per request (``Connection: close``). A pooled connection that the
    server closes for idleness (75 s here: the stack's instances and the proxy) just as the next
    POST goes out is reset (the planted control and a decode swap leave the proxy's idle that long), and requests does not retry a POST: a failure of the client's pool, not
    of the stack under test. A loopback connect costs nothing next to a turn."""
    import requests

    http = requests.Session()
    http.headers["Connection"] = "close"
    return http


def _rpc(http, url: str, method: str, *args: object) -> list:  # noqa: ANN001
    r = http.post(
        url + "/collective_rpc",
        json={"method": method, "args": [str(a) for a in args]},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["results"]


def _counter(http, url: str, name: str) -> float:  # noqa: ANN001
    """Sum of a Prometheus counter over its label sets on ``url``/metrics."""
    return _counter_sum(http.get(url + "/metrics", timeout=30).text, name)


def _counter_sum(metrics_text: str, name: str) -> float:
    """Sum of ``name`` over its label sets in Prometheus text (0 when absent)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


PD_READ_COUNTERS = ("reads", "read_blocks", "read_bytes", "failed_reads")


def _pd_reads(http, url: str) -> dict[str, int]:  # noqa: ANN001
    """The decode's ``vllm:hybridkv_pd_*`` read counters, from one /metrics read (summed over
    its ranks by vLLM; a series not yet incremented is absent from /metrics: 0)."""
    text = http.get(url + "/metrics", timeout=30).text
    return {n: int(_counter_sum(text, f"vllm:hybridkv_pd_{n}_total")) for n in PD_READ_COUNTERS}


def assert_pd_metrics(
    http,
    url: str,
    before: dict[str, int],
    decode_tp: int,
    want: list[int],  # noqa: ANN001
    sizes: list[list[tuple]],
    wait_s: float = 30.0,
) -> dict[str, int]:
    """/metrics agrees with the provenance lines of one turn, exactly: one read per decode rank,
    the blocks each logged (``want`` per group, every rank) and each rank's bytes (its block
    sizes), no failed read. The workers' stats reach /metrics with a later engine step, so the
    read count is waited for (bounded); the rest is asserted at once after it."""
    expected = {
        "reads": decode_tp,
        "read_blocks": decode_tp * sum(want),
        "read_bytes": sum(
            sum(n * b for n, (_, b, _) in zip(want, rank, strict=True)) for rank in sizes
        ),
        "failed_reads": 0,
    }
    deadline = time.monotonic() + wait_s
    while True:
        now = _pd_reads(http, url)
        delta = {n: now[n] - before[n] for n in PD_READ_COUNTERS}
        if delta["reads"] >= decode_tp or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    assert delta == expected, (
        f"vllm:hybridkv_pd_* on {url}/metrics: {delta}, the provenance lines say {expected}"
    )
    return now


def _body(model: str, prompt: list[int], max_tokens: int = 8, **extra) -> dict:
    from hybridkv.cli.harness.llm_engine import TOP_LOGPROBS

    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": TOP_LOGPROBS,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
        **extra,
    }


def _completion(r):  # noqa: ANN001, ANN202 - a requests.Response -> (llm_engine.Completion, cached tokens)
    from hybridkv.cli.harness.llm_engine import Completion

    assert r.status_code == 200, r.text
    doc = r.json()
    lp = doc["choices"][0]["logprobs"]
    tid = lambda t: int(t.split(":")[1])  # noqa: E731 - "token_id:N"
    tops = [{tid(t): float(v) for t, v in (top or {}).items()} for top in lp["top_logprobs"]]
    tokens = [tid(t) for t in lp["tokens"]]
    for top, t, v in zip(tops, tokens, lp["token_logprobs"], strict=True):
        top.setdefault(t, float(v))
    cached = int(
        ((doc.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    )
    return Completion(tokens, [float(v) for v in lp["token_logprobs"]], cached, tops), cached


def _turn_sizes(facts: list[list], geometry: list[list]) -> list[int]:
    """Per group the bytes one block adds to a decode rank's provenance line: a whole
    attention block, or the GDN states without the page padding (``state_bytes`` per layer)."""
    from tests.e2e.test_pd_tp import state_bytes

    return [
        sum(state_bytes(splits)) * len(rows) if mamba else nbytes
        for (mamba, rows, splits), (_, nbytes, _) in zip(facts, geometry, strict=True)
    ]


def prefill_kept_blocks(
    geometry: list[list], windows: list[int], prompt_len: int, handover: int
) -> list[list[int]]:
    """Per group, positional: 1 where the prefill still holds the block when it finishes, from
    vLLM's rule, not the connector's code. A prefill (``do_remote_decode``) of a model with a
    sliding window and no recurrent state computes hand-over + 1 tokens (the whole prompt when
    that is all of it: pd_scheduler.prefill_tokens; its exception, a + 1 that moves the window
    across a block boundary, cannot happen when the window is a multiple of the block size and
    the hand-over is block-aligned, as here); at finish vLLM frees each block wholly before token
    computed - W + 1 of a window-W group (SlidingWindowManager.get_num_skipped_tokens ->
    remove_skipped_blocks); full attention keeps every block. The control below checks this
    against the prefill's real ``remote_block_ids``."""
    computed = prompt_len if handover + 1 >= prompt_len else handover + 1
    out = []
    for (bs, _, _mamba), w in zip(geometry, windows, strict=True):
        assert not w or w % bs == 0, (w, bs)  # the exception above cannot occur
        n = -(-computed // bs)
        freed = min(n, max(0, computed - w + 1) // bs) if w else 0
        out.append([0] * freed + [1] * (n - freed))
    return out


def proxy_turns(
    http,
    stack,
    model: str,
    decode_log: "LogTail",
    turns: int,
    seed: int,
    prefill_tp: int,  # noqa: ANN001
    decode_tp: int,
    label: str,
    turn_tokens: dict = TURN_TOKENS,
) -> list[tuple]:
    """``turns`` agentic turns, each one POST to the proxy. Per turn: every decode rank logged
    exactly one read line (provenance: the prefill ranks of its heads, blocks per group = what it
    lacked, bytes = those blocks of its layout); decode's external hit == hand-over - its own hit
    > 0, and from turn 2 its own hit >= the previous prompt's last checkpoint (cached >=
    checkpoint); then a recompute on decode under a fresh cache_salt."""
    from hybridkv.cli.harness.llm_engine import Session, compare
    from tests.e2e.test_pd_connector import _expected_blocks
    from tests.e2e.test_pd_tp import provenance

    geometries = _rpc(http, stack.decode.url, "hkv_pd_geometry")
    facts = _rpc(http, stack.decode.url, "hkv_pd_facts")
    windows = _rpc(http, stack.decode.url, "hkv_pd_windows")[0]
    assert len(geometries) == decode_tp, geometries
    align = math.lcm(*(bs for bs, _, _ in geometries[0]))
    sizes = [
        [(0, n, False) for n in _turn_sizes(f, g)] for f, g in zip(facts, geometries, strict=True)
    ]
    session = Session(seed=seed, **turn_tokens)
    rows, prev = [], 0
    for turn in range(1, turns + 1):
        prompt = session.prompt
        hits_before = _counter(http, stack.decode.url, "vllm:prefix_cache_hits_total")
        ext_before = _counter(http, stack.decode.url, "vllm:external_prefix_cache_hits_total")
        pd_before = _pd_reads(http, stack.decode.url)
        decode_log.new(0)
        t = time.monotonic()
        got, prefill_hit = _completion(
            http.post(
                stack.url + "/v1/completions", json=_body(model, prompt), timeout=REQUEST_TIMEOUT_S
            )
        )
        leg_s = time.monotonic() - t
        log = decode_log.new()
        local_hit = int(
            _counter(http, stack.decode.url, "vllm:prefix_cache_hits_total") - hits_before
        )
        pulled = int(
            _counter(http, stack.decode.url, "vllm:external_prefix_cache_hits_total") - ext_before
        )
        handover = (len(prompt) - 1) // align * align
        # What decode lacks: each block the prefill still holds from decode's own hit to the
        # hand-over (full attention: every one; a sliding window: those inside the window of
        # the prefill's last computed token), and the GDN state block.
        kept = prefill_kept_blocks(geometries[0], windows, len(prompt), handover)
        want = _expected_blocks(geometries[0], kept, local_hit, handover)
        provenance(log, decode_tp, prefill_tp, want, sizes)
        assert_pd_metrics(http, stack.decode.url, pd_before, decode_tp, want, sizes)
        assert pulled == handover - local_hit > 0, (turn, pulled, handover, local_hit)
        assert local_hit == 0 if turn == 1 else local_hit >= (prev - 1) // align * align, (
            turn,
            local_hit,
            prev,
        )
        t = time.monotonic()
        ref, _ = _completion(
            http.post(
                stack.decode.url + "/v1/completions",
                timeout=REQUEST_TIMEOUT_S,
                json=_body(model, prompt, cache_salt=f"pd-tp-proxy-{label}-{uuid.uuid4()}"),
            )
        )
        cmp = compare(got, ref)
        rows.append(
            (
                turn,
                len(prompt),
                handover,
                prefill_hit,
                local_hit,
                pulled,
                want,
                cmp.matches,
                f"{cmp.max_logprob_diff:.3g}",
                cmp.why,
                f"{leg_s:.1f}/{time.monotonic() - t:.1f} s",
            )
        )
        assert sum(want) > 0, rows[-1]
        session.extend(got.token_ids)
        prev = len(prompt)
    print(
        f"\nP/D {label} (prefill TP{prefill_tp} -> decode TP{decode_tp}) through hybridkv proxy: turn, prompt, "
        "hand-over, prefill's hit, decode's own hit, tokens pulled, blocks read per group (each rank), "
        "matches_recompute, max logprob diff, why, proxy/recompute time"
    )
    for r in rows:
        print("  ", *r)
    return rows


def _no_bad_signs(*paths) -> None:  # noqa: ANN002
    for path in paths:
        text = Path(path).read_text(errors="replace")
        bad = [s for s in BAD_SIGNS if s in text]
        assert not bad, f"{Path(path).name}: {bad}"


def _planted_shift(
    http,
    stack,
    model: str,
    decode_log: "LogTail",
    prompt: list[int],
    dense: int,  # noqa: ANN001
    plant_rank: int,
    prefill_tp: int,
    decode_tp: int,
    check_params=None,
) -> None:  # noqa: ANN001
    """The control every TP pair runs: ``prompt``'s prefill leg, then prefill rank ``plant_rank``'s
    first full-attention block overwritten with its second block's real KV (that rank only, the
    whole block); every decode rank must read the hand-over and the output must differ from a
    salted recompute. ``check_params`` sees the prefill's kv_transfer_params first."""
    from hybridkv.cli.harness.llm_engine import compare
    from tests.e2e.test_pd_tp import _FAILED, _TP_LINE

    r = http.post(
        stack.prefill.url + "/v1/completions",
        timeout=REQUEST_TIMEOUT_S,  # the proxy's first leg
        json=_body(model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    if check_params is not None:
        check_params(params)
    ids = [b for b in params["remote_block_ids"][dense] if b]
    block_bytes = _rpc(http, stack.prefill.url, "hkv_pd_geometry")[plant_rank][dense][1]
    written = [
        w[0]
        for w in _rpc(
            http, stack.prefill.url, "hkv_pd_shift_block", plant_rank, dense, ids[0], ids[1]
        )
    ]
    assert written == [block_bytes if rank == plant_rank else 0 for rank in range(prefill_tp)], (
        written
    )
    decode_log.new(0)
    got, _ = _completion(
        http.post(
            stack.decode.url + "/v1/completions",
            timeout=REQUEST_TIMEOUT_S,
            json=_body(model, prompt, kv_transfer_params=params),
        )
    )
    log = decode_log.new()
    ref, _ = _completion(
        http.post(
            stack.decode.url + "/v1/completions",
            timeout=REQUEST_TIMEOUT_S,
            json=_body(model, prompt, cache_salt=f"pd-tp-proxy-planted-{uuid.uuid4()}"),
        )
    )
    cmp = compare(got, ref)
    print(
        f"planted: prefill rank {plant_rank}'s block {ids[0]} = its block {ids[1]} ({block_bytes} bytes); "
        f"matches recompute: {cmp.matches} ({cmp.why})"
    )
    assert len(_TP_LINE.findall(log)) == decode_tp and not _FAILED.search(log), (
        "every decode rank must have read the planted prompt's blocks"
    )
    assert not cmp.matches, (
        f"prefill rank {plant_rank}'s shifted block went unnoticed: its KV is not what decode used"
    )


def test_qwen3next_tp2_to_tp2_then_tp2_to_tp1_through_the_proxy(tmp_path):
    from hybridkv.cli.harness.llm_engine import Session, tiny_model
    from hybridkv.cli.pd_stack import PDStack, pd_transfer_config, rank_cpus
    from hybridkv.store.cpu_affinity import usable_cpus
    from tests.e2e.test_pd_tp import observe_pd_tp

    if len(usable_cpus()) < TP:
        pytest.fail(
            f"TP{TP} needs {TP} usable CPUs (one per rank), this runner has {sorted(usable_cpus())}"
        )
    t0 = time.monotonic()
    http = _http_session()
    worker_args = [*SERVER_ARGS, "--worker-extension-cls", PROBE]
    prefill_config = pd_transfer_config("kv_producer") | {
        "kv_connector_extra_config": {"lease_s": LEASE_S}
    }
    decode_config = pd_transfer_config("kv_consumer") | {"kv_connector_extra_config": DECODE_EXTRA}
    with PDStack(
        tiny_model(KIND),
        max_model_len=2048,
        log_dir=tmp_path,
        prefill_tp=TP,
        decode_tp=TP,
        prefill_args=worker_args,
        decode_args=worker_args,
        prefill_config=prefill_config,
        decode_config=decode_config,
    ) as stack:
        boot_s = time.monotonic() - t0
        binds = [
            s.extra_env.get("VLLM_CPU_OMP_THREADS_BIND") for s in (stack.prefill, stack.decode)
        ]
        assert binds == [rank_cpus(TP, TP)[0], rank_cpus(TP, TP)[1]], binds
        model = http.get(stack.decode.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        geometries = _rpc(http, stack.decode.url, "hkv_pd_geometry")
        assert len(geometries) == TP and geometries[0] == geometries[1], (
            geometries
        )  # same shares per rank
        assert sorted(m for _, _, m in geometries[0]) == [False, True], (
            geometries
        )  # GDN + full attention
        dense = next(g for g, (_, _, mamba) in enumerate(geometries[0]) if not mamba)
        decode_log = LogTail(Path(stack.decode.log_path))
        rows = proxy_turns(http, stack, model, decode_log, 3, 45, TP, TP, "qwen3next-tp2-tp2")
        assert [r[7] for r in rows] == [True] * 3, rows

        # Control: one full-attention block of prefill rank 1 holds another block's real KV.
        _planted_shift(
            http,
            stack,
            model,
            decode_log,
            Session(seed=46, **TURN_TOKENS).prompt,
            dense,
            plant_rank=1,
            prefill_tp=TP,
            decode_tp=TP,
        )
        _no_bad_signs(stack.prefill.log_path, stack.decode.log_path)
        tp2_s = time.monotonic() - t0

        # Across TP sizes: the decode tier replaced by a TP1 instance with allow_mamba_cross_tp
        # (forwarded by PDStack), on the proxy's --decode port; the TP2 prefill keeps running.
        t1 = time.monotonic()
        stack.replace_decode(
            1, decode_config=decode_config, decode_args=worker_args, allow_mamba_cross_tp=True
        )
        swap_s = time.monotonic() - t1
        decode_log = LogTail(Path(stack.decode.log_path))
        cross = proxy_turns(http, stack, model, decode_log, 2, 47, TP, 1, "qwen3next-tp2-tp1")
        _no_bad_signs(stack.prefill.log_path, stack.decode.log_path)
        assert "allow_mamba_cross_tp is ON" in Path(stack.decode.log_path).read_text(
            errors="replace"
        )
    observe_pd_tp("qwen3next-tp2-tp2-proxy", [r[6] for r in rows])
    observe(
        "pd-tp",
        "qwen3next-tp2-tp1-proxy",
        {
            "blocks per group, turns 1-3 (SW, FA / Mamba, FA)": " ".join(
                "[" + ",".join(map(str, r[6])) + "]" for r in cross
            ),
            "= recompute": f"provenance + bytes {len(cross)}/{len(cross)}; output not asserted",
        },
    )
    print(
        f"boot {boot_s:.0f} s, TP2 -> TP2 part {tp2_s:.0f} s, decode replaced by TP1 in {swap_s:.0f} s, "
        f"total {time.monotonic() - t0:.0f} s"
    )


# gemma3 (sliding window 128 + full attention, block 128) across TP sizes through the proxy.
# float32, as in test_pd_tp.py: KV a TP2 engine computes is not a TP1 engine's bits in bfloat16
# (another reduction order), and a correct hand-over split from its recompute on a near-tie.
GEMMA3_ARGS = ["--dtype", "float32"]
# A short prompt through the proxy before the checked turns: the first request of a stack pays
# each engine's first forward passes and decode's handshakes with the prefill ranks, which took
# 44-80 s when 4 ranks shared the 2 cores (gemma3 TP2 -> TP2: a handshake ran past its 60 s bound).
WARMUP_TOKENS = 300


def _warm_up(http, stack, model: str, decode_log: "LogTail", seed: int) -> str:  # noqa: ANN001
    """One unchecked request through the proxy; returns what it took and whether decode read."""
    from hybridkv.cli.harness.llm_engine import Session
    from tests.e2e.test_pd_tp import _TP_LINE

    decode_log.new(0)
    t = time.monotonic()
    r = http.post(
        stack.url + "/v1/completions",
        timeout=REQUEST_TIMEOUT_S,
        json=_body(model, Session(seed=seed, first_tokens=WARMUP_TOKENS).prompt, max_tokens=2),
    )
    assert r.status_code == 200, r.text
    return f"warm-up {time.monotonic() - t:.1f} s, read lines {len(_TP_LINE.findall(decode_log.new()))}"


def _gemma3_pair(http, stack, prefill_tp: int, decode_tp: int, seed: int) -> list[tuple]:  # noqa: ANN001
    """On a running stack: warm-up, 3 turns (``proxy_turns``: provenance per decode rank, cached
    >= checkpoint, = salted recompute), then the planted one-block shift on the last prefill rank
    must be read by every decode rank and make the output differ."""
    import hybridkv.connector
    from hybridkv.cli.harness.llm_engine import Session
    from tests.e2e.test_pd_tp import observe_pd_tp

    label = f"gemma3-tp{prefill_tp}-tp{decode_tp}-proxy"
    t0 = time.monotonic()
    for url in (stack.prefill.url, stack.decode.url):  # the servers run the code under test
        assert set(sum(_rpc(http, url, "hkv_module_file"), [])) == {hybridkv.connector.__file__}
    model = http.get(stack.decode.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    geometry = _rpc(http, stack.decode.url, "hkv_pd_geometry")[0]
    windows = _rpc(http, stack.decode.url, "hkv_pd_windows")[0]
    assert [m for _, _, m in geometry] == [False, False] and windows[0] > 0 == windows[1], (
        geometry,
        windows,
    )
    sw, dense = 0, 1  # gemma3: group 0 sliding window, group 1 full attention
    decode_log = LogTail(Path(stack.decode.log_path))
    warm = _warm_up(http, stack, model, decode_log, seed + 20)
    t1 = time.monotonic()
    rows = proxy_turns(http, stack, model, decode_log, 3, seed, prefill_tp, decode_tp, label)
    turns_s = time.monotonic() - t1
    assert [r[7] for r in rows] == [True] * 3, rows
    # The window's rule at work: its group read fewer blocks than full attention.
    assert any(r[6][sw] < r[6][dense] for r in rows), rows

    # Control: one full-attention block of the last prefill rank holds another block's real KV.
    prompt = Session(seed=seed + 50, **TURN_TOKENS).prompt
    align = math.lcm(*(bs for bs, _, _ in geometry))
    handover = (len(prompt) - 1) // align * align

    def check_kept(params: dict) -> None:
        held = [[1 if b else 0 for b in g] for g in params["remote_block_ids"]]
        kept = prefill_kept_blocks(geometry, windows, len(prompt), handover)
        assert held == kept, f"the prefill's blocks at finish {held}, vLLM's rule says {kept}"

    _planted_shift(
        http,
        stack,
        model,
        decode_log,
        prompt,
        dense,
        plant_rank=prefill_tp - 1,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        check_params=check_kept,
    )
    _no_bad_signs(stack.prefill.log_path, stack.decode.log_path)
    observe_pd_tp(label, [r[6] for r in rows])
    print(f"{label}: {warm}, 3 turns {turns_s:.0f} s, pair {time.monotonic() - t0:.0f} s")
    return rows


def gemma3_through_the_proxy(
    tmp_path: Path, prefill_tp: int, decode_tps: list[int], seed: int
) -> None:
    """gemma3 P/D at prefill TP``prefill_tp`` through ``hybridkv proxy``: a stack with decode
    TP``decode_tps[0]``, then the decode tier replaced by each next size (the prefill keeps
    running, ``PDStack.replace_decode``); ``_gemma3_pair`` for each."""
    from hybridkv.cli.harness.llm_engine import tiny_model
    from hybridkv.cli.pd_stack import PDStack, pd_transfer_config

    t0 = time.monotonic()
    http = _http_session()
    worker_args = ["--worker-extension-cls", PROBE]
    prefill_config = pd_transfer_config("kv_producer") | {
        "kv_connector_extra_config": {"lease_s": LEASE_S}
    }
    decode_config = pd_transfer_config("kv_consumer") | {"kv_connector_extra_config": DECODE_EXTRA}
    with PDStack(
        tiny_model("gemma3"),
        max_model_len=2048,
        log_dir=tmp_path,
        extra_args=GEMMA3_ARGS,
        prefill_tp=prefill_tp,
        decode_tp=decode_tps[0],
        prefill_args=worker_args,
        decode_args=worker_args,
        prefill_config=prefill_config,
        decode_config=decode_config,
    ) as stack:
        times = [f"boot {time.monotonic() - t0:.0f} s"]
        for i, decode_tp in enumerate(decode_tps):
            if i:
                t1 = time.monotonic()
                stack.replace_decode(
                    decode_tp, decode_config=decode_config, decode_args=worker_args
                )
                times.append(f"decode replaced by TP{decode_tp} in {time.monotonic() - t1:.0f} s")
            _gemma3_pair(http, stack, prefill_tp, decode_tp, seed + i)
    print(
        f"gemma3 prefill TP{prefill_tp} -> decode {decode_tps}: {', '.join(times)}, "
        f"total {time.monotonic() - t0:.0f} s"
    )


def test_gemma3_tp2_to_tp2_then_tp2_to_tp1_through_the_proxy(tmp_path):
    """TP2 -> TP2 (4 ranks), then the decode tier replaced by TP1 (the prefill keeps running).
    One stack covers both pairs: the prefill boots once and its TP2 -> TP2 warm-up stays within
    the 120 s side-channel bound; replacing the decode tier costs less than a second stack."""
    gemma3_through_the_proxy(tmp_path, 2, [2, 1], seed=67)


def test_gemma3_tp1_to_tp2_through_the_proxy(tmp_path):
    gemma3_through_the_proxy(tmp_path, 1, [2], seed=64)


def test_rank_cpus_gives_each_rank_its_cores_or_unbinds():
    """The binding rule PDStack applies (no engine: pure function and command lines)."""
    from hybridkv.cli.pd_stack import rank_cpus

    assert rank_cpus(1, 1, {0, 1}) == ("0", "1")  # TP1 -> TP1: split_cpus' halves, unchanged
    assert rank_cpus(1, 1, {0, 2, 3, 4, 9, 10}) == ("0,2-3", "4,9-10")
    assert rank_cpus(2, 2, set(range(8))) == (
        "0-1|2-3",
        "4-5|6-7",
    )  # one run per rank, prefill first
    assert rank_cpus(2, 1, set(range(7))) == ("0-1|2-3", "4-5")
    assert rank_cpus(1, 2, {0, 1, 2}) == ("0", "1|2")
    assert rank_cpus(2, 2, {0, 1}) == ("nobind", "nobind")  # fewer cores than ranks: not pinned
    assert rank_cpus(2, 1, {0, 1}) == ("nobind", "nobind")
    assert rank_cpus(2, 2, {0}) is None and rank_cpus(1, 1, {0}) is None


def test_unbound_ranks_get_their_share_of_openmp_threads(monkeypatch):
    """Fewer cores than ranks: each rank's OMP_NUM_THREADS is its share (>= 1), so 4 ranks on
    2 cores run 4 OpenMP threads, not 8 spin-waiting ones; bound ranks and a user's own
    setting are left alone."""
    from hybridkv.cli.pd_stack import disjoint_core_envs

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    both = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    assert disjoint_core_envs(2, 2, {0, 1}) == (both, both)
    assert disjoint_core_envs(2, 1, {0, 1}) == (both, both)
    assert disjoint_core_envs(2, 2, set(range(8))) == (
        {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"},
        {"VLLM_CPU_OMP_THREADS_BIND": "4-5|6-7"},
    )
    assert disjoint_core_envs(1, 1, {0, 1}) == (
        {"VLLM_CPU_OMP_THREADS_BIND": "0"},
        {"VLLM_CPU_OMP_THREADS_BIND": "1"},
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert disjoint_core_envs(2, 2, {0, 1}) == ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"},) * 2
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert disjoint_core_envs(2, 2, {0, 1}) == ({}, {})


def test_pd_stack_passes_each_side_its_tp_size_and_args(tmp_path, monkeypatch):
    from hybridkv.cli.pd_stack import PDStack

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    default = PDStack("m", log_dir=tmp_path / "a", extra_args=["--x"])
    for server in (default.prefill, default.decode):  # the defaults: no TP flag, extra args last
        assert "--tensor-parallel-size" not in server.command() and server.command()[-1] == "--x"
    stack = PDStack(
        "m",
        log_dir=tmp_path / "b",
        extra_args=["--x"],
        prefill_tp=2,
        decode_tp=1,
        prefill_args=["--p"],
        decode_args=["--d"],
    )
    assert stack.prefill.command()[-4:] == ["--x", "--tensor-parallel-size", "2", "--p"]
    assert (
        stack.decode.command()[-2:] == ["--x", "--d"]
        and "--tensor-parallel-size" not in stack.decode.command()
    )


def test_pd_stack_instances_keep_idle_connections_75_s_unless_the_user_chose(tmp_path, monkeypatch):
    """Both instances (and a replaced decode) get VLLM_HTTP_TIMEOUT_KEEP_ALIVE=75, not uvicorn's
    5 s (a starved instance otherwise closes a pooled connection with a request waiting in it:
    the proxy's 502 "decode instance unreachable: ReadError" of a soak run); a user's value stays."""
    from hybridkv.cli import server as server_mod
    from hybridkv.cli.pd_stack import PDStack

    monkeypatch.setattr(server_mod.VllmServer, "start", lambda self: None)  # no engine boots here
    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    stack = PDStack("m", log_dir=tmp_path / "a")
    assert [
        s.extra_env.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE") for s in (stack.prefill, stack.decode)
    ] == ["75", "75"]
    stack.replace_decode(1)
    assert stack.decode.extra_env.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE") == "75"
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "30")
    mine = PDStack("m", log_dir=tmp_path / "b")
    assert (
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" not in mine.prefill.extra_env | mine.decode.extra_env
    )  # inherited: 30


def _extra(server) -> dict:  # noqa: ANN001 - a VllmServer -> its command line's kv_connector_extra_config
    import json

    cmd = server.command()
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1]).get(
        "kv_connector_extra_config", {}
    )


def test_pd_stack_forwards_allow_mamba_cross_tp_to_decode_only(tmp_path, monkeypatch):
    """The decode-side switch reaches the decode server's command line (merged into a
    caller's decode config, which is not changed); the prefill never gets it; off by default."""
    from hybridkv.cli.pd_stack import PDStack, pd_transfer_config

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    off = PDStack("m", log_dir=tmp_path / "a", prefill_tp=2, decode_tp=1)
    assert "allow_mamba_cross_tp" not in _extra(
        off.decode
    ) and "allow_mamba_cross_tp" not in _extra(off.prefill)
    on = PDStack("m", log_dir=tmp_path / "b", prefill_tp=2, decode_tp=1, allow_mamba_cross_tp=True)
    assert _extra(on.decode)[
        "allow_mamba_cross_tp"
    ] is True and "allow_mamba_cross_tp" not in _extra(on.prefill)
    mine = pd_transfer_config("kv_consumer") | {
        "kv_connector_extra_config": {"handshake_timeout_s": 9.0}
    }
    merged = PDStack("m", log_dir=tmp_path / "c", decode_config=mine, allow_mamba_cross_tp=True)
    assert _extra(merged.decode) == {"handshake_timeout_s": 9.0, "allow_mamba_cross_tp": True}
    assert mine["kv_connector_extra_config"] == {
        "handshake_timeout_s": 9.0
    }  # the caller's dict as given
    assert {k: v for k, v in _extra(merged.decode).items() if k != "allow_mamba_cross_tp"} == mine[
        "kv_connector_extra_config"
    ]


def test_pd_stack_replace_decode_keeps_port_and_secret_and_sets_the_new_size(tmp_path, monkeypatch):
    """What the cross-TP case below relies on, without an engine: the replacement decode
    listens where the proxy sends (same port), holds the stack's secret, runs at the new TP
    size with the switch on, and the old log is kept. ``VllmServer.start`` is recorded here
    instead of booting (the e2e case boots it for real)."""
    from hybridkv.cli import server as server_mod
    from hybridkv.cli.pd_stack import PDStack
    from hybridkv.connector.pd_auth import SECRET_FILE_ENV

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    started = []
    monkeypatch.setattr(server_mod.VllmServer, "start", lambda self: started.append(self))
    stack = PDStack("m", log_dir=tmp_path, prefill_tp=2, decode_tp=2, decode_args=["--d"])
    old = stack.decode
    old.log_path.write_text("old decode log")
    kept = stack.replace_decode(1, decode_args=["--e"], allow_mamba_cross_tp=True)
    assert started == [stack.decode] and stack.decode is not old
    assert stack.decode.port == old.port and stack.decode.url == old.url  # the proxy's --decode URL
    assert (
        stack.decode.extra_env[SECRET_FILE_ENV]
        == old.extra_env[SECRET_FILE_ENV]
        == str(stack.secret_file)
    )
    assert (
        "--tensor-parallel-size" not in stack.decode.command()
        and stack.decode.command()[-1] == "--e"
    )
    assert _extra(stack.decode)[
        "allow_mamba_cross_tp"
    ] is True and "allow_mamba_cross_tp" not in _extra(old)
    assert kept == tmp_path / "decode.1.log" and kept.read_text() == "old decode log"
