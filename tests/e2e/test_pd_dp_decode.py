"""P/D to a data-parallel decode through ``hybridkv proxy``: prefill TP2 -> decode DP2 (TP1 per
rank), prefix caching on in both.

``PDStack(decode_dp=2)`` starts the decode instance with ``--data-parallel-size 2``: one API
server in front of two engine cores, each its own worker, HybridPDConnector, NIXL agent and
block pool (vLLM names each rank's connector engine ``<engine_id>_dp<rank>``). Three turns of one
conversation, each prompt = previous prompt + answer + a new chunk, each one POST to the proxy
with ``X-data-parallel-rank`` (the proxy carries it to the decode leg): turns 1 and 3 on rank 0,
turn 2 on rank 1. Per turn, from the decode server's own ``/metrics`` per engine (the
``engine`` label is the DP rank):
* the chosen rank's prefix-cache hit is what IT served before: 0 on its first turn (turn 2 on
  rank 1 finds none of rank 0's blocks, which hold turn 1), the previous turn on that rank's
  whole blocks on turn 3;
* it READ exactly what it lacked (``vllm:hybridkv_pd_reads/read_blocks/read_bytes``, no failed
  read; its external hit = hand-over - own hit), and the other rank's counters did not move:
  a request handed to one DP rank reads nothing on, and into, another;
* the one read line in decode's log comes from that rank's worker and names prefill ranks
  [0, 1] (a TP1 decode rank reads both halves of the heads);
* greedy tokens + top-5 logprobs == a recompute on the same rank under a fresh ``cache_salt``.

gemma3 (sliding window + full attention, float32 as in test_pd_tp_proxy: a TP2 prefill's KV in
bfloat16 is not a TP1 engine's bits). Not qwen3-next with expert parallelism: vLLM 0.32's CPU
engine cannot run a MoE model at ``--data-parallel-size 2``, with or without
``--enable-expert-parallel``: the first forward of the MoE layer dispatches tokens across the DP
ranks (``naive_dp_ep`` -> ``CpuCommunicator.dispatch`` -> ``all_gatherv``) and the CPU
communicator does not implement ``all_gatherv`` (``NotImplementedError`` in
``base_device_communicator.py``), so the engine core dies on its first (dummy) batch.
The routing with a MoE-shaped geometry (Mamba + two dense groups) is covered through vLLM's real
Scheduler per rank: tests/unit/test_matrix_scheduler.py
``test_pd_to_a_data_parallel_decode_reads_on_the_chosen_rank_only``; the strict xfail
``test_moe_decode_at_dp2_needs_the_cpu_communicators_all_gatherv`` below turns red once the
CPU communicator has that collective, so the MoE cell can then run here.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from pathlib import Path

import pytest

from hybridkv.cli.harness.llm_engine import LogTail

pytestmark = pytest.mark.e2e

PREFILL_TP = 2
DECODE_DP = 2
KIND = "gemma3"
SERVER_ARGS = ["--dtype", "float32"]
# 300 / 458 / 616 tokens: hand-overs of 2 / 3 / 4 blocks of 128, the least that still leaves
# rank 0 a whole block of its own at turn 3.
TURN_TOKENS = {"first_tokens": 300, "growth_tokens": 150}
ROUTE = (0, 1, 0)  # the decode DP rank of each turn
MAX_TOKENS = 8
DP_RANK_HEADER = "X-data-parallel-rank"
PD_COUNTERS = ("reads", "read_blocks", "read_bytes", "failed_reads")
HIT_COUNTERS = ("prefix_cache_hits", "external_prefix_cache_hits")
_ENGINE = re.compile(r'engine="(\d+)"')
# A decode worker's startup line: its process id and its NIXL agent, named by its DP rank's
# engine id (``<engine_id>_dp<rank>``) and TP rank.
_AGENT = re.compile(r"\(\w+ pid=(\d+)\).* NIXL agent (hybridkv-(\S+)_dp(\d+)-tp0) \(decode only")
_PID = re.compile(r"\(\w+ pid=(\d+)\)")


def by_engine(metrics_text: str, name: str) -> dict[int, int]:
    """``name`` per ``engine`` label (the DP rank) in Prometheus text, summed over the other
    labels; a rank without the series is absent (0)."""
    out: dict[int, int] = {}
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            m = _ENGINE.search(line)
            if m:
                rank = int(m.group(1))
                out[rank] = out.get(rank, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def _snapshot(http, url: str) -> dict[str, dict[int, int]]:  # noqa: ANN001
    text = http.get(url + "/metrics", timeout=30).text
    names = {n: f"vllm:hybridkv_pd_{n}_total" for n in PD_COUNTERS}
    names |= {n: f"vllm:{n}_total" for n in HIT_COUNTERS}
    return {n: by_engine(text, full) for n, full in names.items()}


def _delta(now: dict, before: dict) -> dict[str, list[int]]:
    """Per counter, [rank 0's increase, rank 1's increase]."""
    return {n: [now[n].get(r, 0) - before[n].get(r, 0) for r in range(DECODE_DP)] for n in now}


def test_by_engine_reads_each_dp_ranks_series():
    text = "\n".join(
        [
            "# HELP vllm:hybridkv_pd_reads_total x",
            'vllm:hybridkv_pd_reads_total{engine="0",model_name="m"} 2.0',
            'vllm:hybridkv_pd_reads_total{engine="1",model_name="m"} 1.0',
            'vllm:hybridkv_pd_reads_total_other{engine="1"} 9.0',
            'vllm:hybridkv_pd_failed_reads_total{cause="plan",engine="1",model_name="m"} 1.0',
            'vllm:hybridkv_pd_failed_reads_total{cause="crash",engine="1",model_name="m"} 2.0',
        ]
    )
    assert by_engine(text, "vllm:hybridkv_pd_reads_total") == {0: 2, 1: 1}
    assert by_engine(text, "vllm:hybridkv_pd_failed_reads_total") == {1: 3}
    assert by_engine(text, "vllm:absent_total") == {}


def test_pd_stack_starts_a_data_parallel_decode_with_a_core_list_per_rank(tmp_path, monkeypatch):
    """No engine: the decode command line gets ``--data-parallel-size``, the prefill's does not,
    and the decode's ``VLLM_CPU_OMP_THREADS_BIND`` has one core list per DP x TP rank (vLLM's
    CPU worker takes the ``local_dp_rank``-th slice of it)."""
    from hybridkv.cli import pd_stack
    from hybridkv.cli.pd_stack import PDStack

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(pd_stack, "usable_cpus", lambda: set(range(8)))
    stack = PDStack("m", log_dir=tmp_path, prefill_tp=2, decode_tp=1, decode_dp=2)
    cmd = stack.decode.command()
    assert cmd[cmd.index("--data-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in cmd
    assert "--data-parallel-size" not in stack.prefill.command()
    binds = [s.extra_env.get("VLLM_CPU_OMP_THREADS_BIND") for s in (stack.prefill, stack.decode)]
    assert binds == ["0-1|2-3", "4-5|6-7"]


MOE_AT_DP = (
    "vLLM 0.32's CPU engine cannot run a MoE model (qwen3-next) at --data-parallel-size 2, with or "
    "without --enable-expert-parallel: the MoE layer's DP dispatch calls all_gatherv, which "
    "CpuCommunicator does not implement (NotImplementedError on the first dummy batch); covered "
    "with vLLM's real Scheduler per DP rank in tests/unit/test_matrix_scheduler.py"
)


@pytest.mark.xfail(strict=True, reason=MOE_AT_DP)
def test_moe_decode_at_dp2_needs_the_cpu_communicators_all_gatherv():
    """No engine: the collective the MoE cell needs (the engine's error is in MOE_AT_DP)."""
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    assert CpuCommunicator.all_gatherv is not DeviceCommunicatorBase.all_gatherv


def test_tp2_prefill_to_dp2_decode_through_the_proxy(tmp_path):
    from hybridkv.cli.harness.llm_engine import Session, compare, tiny_model
    from hybridkv.cli.pd_stack import PDStack, pd_transfer_config
    from tests.e2e.test_pd_connector import _expected_blocks
    from tests.e2e.test_pd_tp import _TP_LINE, provenance
    from tests.e2e.test_pd_tp_proxy import (
        DECODE_EXTRA,
        LEASE_S,
        PROBE,
        REQUEST_TIMEOUT_S,
        _body,
        _completion,
        _http_session,
        _no_bad_signs,
        _planted_shift,
        _rpc,
        _turn_sizes,
        prefill_kept_blocks,
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
        prefill_tp=PREFILL_TP,
        decode_dp=DECODE_DP,
        prefill_args=worker_args,
        decode_args=worker_args,
        prefill_config=prefill_config,
        decode_config=decode_config,
    ) as stack:
        boot_s = time.monotonic() - t0
        url = stack.decode.url
        model = http.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        # /collective_rpc on a DP instance answers for DP rank 0's workers (one TP1 rank).
        geometry = _rpc(http, url, "hkv_pd_geometry")[0]
        windows = _rpc(http, url, "hkv_pd_windows")[0]
        sizes = [[(0, n, False) for n in _turn_sizes(_rpc(http, url, "hkv_pd_facts")[0], geometry)]]
        align = math.lcm(*(bs for bs, _, _ in geometry))
        agents = _AGENT.findall(Path(stack.decode.log_path).read_text(errors="replace"))
        # Each DP rank its own worker process, engine id (vLLM's ``_dp<rank>`` suffix on one
        # base) and NIXL agent.
        assert sorted(int(a[3]) for a in agents) == list(range(DECODE_DP)), agents
        assert len({a[0] for a in agents}) == len({a[1] for a in agents}) == DECODE_DP, agents
        assert len({a[2] for a in agents}) == 1, agents
        dp_rank_of_pid = {int(a[0]): int(a[3]) for a in agents}
        decode_log = LogTail(Path(stack.decode.log_path))
        session = Session(seed=71, **TURN_TOKENS)
        served: dict[int, int] = {}  # DP rank -> tokens of its last request (prompt + answer)
        prefill_hit = 0  # the prefill's own hit: the previous turn's hand-over
        rows = []
        for turn, rank in enumerate(ROUTE, 1):
            prompt = session.prompt
            before = _snapshot(http, url)
            decode_log.new(0)
            t = time.monotonic()
            got, cached = _completion(
                http.post(
                    stack.url + "/v1/completions",
                    json=_body(model, prompt, MAX_TOKENS),
                    headers={DP_RANK_HEADER: str(rank)},
                    timeout=REQUEST_TIMEOUT_S,
                )
            )
            leg_s = time.monotonic() - t
            log = decode_log.new()
            # The workers' counters reach /metrics with a later engine step: wait (bounded)
            # for the turn's read, then take every counter at once.
            deadline = time.monotonic() + 30
            while True:
                delta = _delta(_snapshot(http, url), before)
                if sum(delta["reads"]) + sum(delta["failed_reads"]) >= 1:
                    break
                assert time.monotonic() < deadline, (turn, delta)
                time.sleep(0.5)
            handover = (len(prompt) - 1) // align * align
            # Its own hit: the whole blocks of what THIS rank served before (prompt + answer
            # but the last token, whose KV is never computed), nothing from the other rank.
            own = (served[rank] - 1) // align * align if rank in served else 0
            kept = prefill_kept_blocks(geometry, windows, len(prompt), handover)
            want = _expected_blocks(geometry, kept, own, handover)
            expected = {}
            for name, value in (
                ("reads", 1),
                ("read_blocks", sum(want)),
                ("read_bytes", sum(n * b for n, (_, b, _) in zip(want, sizes[0], strict=True))),
                ("failed_reads", 0),
                ("prefix_cache_hits", own),
                ("external_prefix_cache_hits", handover - own),
            ):
                expected[name] = [value if r == rank else 0 for r in range(DECODE_DP)]
            assert delta == expected, f"turn {turn} on DP rank {rank}: /metrics {delta}"
            provenance(log, 1, PREFILL_TP, want, sizes)
            readers = [ln for ln in log.splitlines() if _TP_LINE.search(ln)]
            assert [dp_rank_of_pid.get(int(_PID.match(ln).group(1))) for ln in readers] == [rank], (
                readers
            )  # the read line comes from the chosen rank's worker
            t = time.monotonic()
            ref, _ = _completion(
                http.post(
                    url + "/v1/completions",
                    json=_body(model, prompt, MAX_TOKENS, cache_salt=f"pd-dp-{uuid.uuid4()}"),
                    headers={DP_RANK_HEADER: str(rank)},
                    timeout=REQUEST_TIMEOUT_S,
                )
            )
            cmp = compare(got, ref)
            rows.append(
                (turn, rank, len(prompt), handover, cached, own, want, cmp.matches, cmp.why)
            )
            print(f"turn {turn}: proxy {leg_s:.1f} s, recompute {time.monotonic() - t:.1f} s")
            # vLLM reports the prefill's cached tokens as the answer's (remote_prefill_cached_tokens)
            assert cached == prefill_hit, (turn, cached, prefill_hit)
            served[rank] = len(prompt) + MAX_TOKENS
            prefill_hit = handover
            session.extend(got.token_ids)
        # Control: prefill rank 1's first full-attention block of a hand-over overwritten with
        # its second block's real KV; the decode rank that reads it must answer differently from
        # a recompute (the check above has power on this geometry).
        dense = next(g for g, w in enumerate(windows) if not w)
        _planted_shift(
            http,
            stack,
            model,
            decode_log,
            Session(seed=72, **TURN_TOKENS).prompt,
            dense,
            plant_rank=PREFILL_TP - 1,
            prefill_tp=PREFILL_TP,
            decode_tp=1,
        )
        _no_bad_signs(stack.prefill.log_path, stack.decode.log_path)
    print(
        f"\nP/D prefill TP{PREFILL_TP} -> decode DP{DECODE_DP} (TP1 per rank) through hybridkv "
        "proxy: turn, DP rank, prompt, hand-over, cached, own hit, blocks read per group "
        "(SW, FA), matches_recompute, why"
    )
    for r in rows:
        print("  ", *r)
    print(f"boot {boot_s:.0f} s, total {time.monotonic() - t0:.0f} s")
    assert [r[7] for r in rows] == [True] * len(ROUTE), rows
