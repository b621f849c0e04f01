"""Soak with chaos: the agentic demo workload against a store server while the store fails.

    flock /tmp/hybridkv-engine.lock .venv/bin/python bench/soak.py [--sessions 16] [--phase-s 60]
        [--out bench/results] [--pd]

CI runs a short variant of the same code (tests/e2e/test_soak.py: ``run_soak`` with few
sessions and short phases, then asserts the targets). One real vLLM OpenAI server on the CPU
engine with HybridStoreConnector on an external ``mooncake_master`` this script owns, plus one
more store node (a process contributing a segment), so it can fault both:

    warm            (phase-s)  healthy
    stop            (stop-s)   master SIGSTOPped (hung), then SIGCONT
    after-stop      (phase-s)
    corrupt         (-)        ~corrupt-fraction of the stored objects overwritten in place with
                               ANOTHER block's real stored object (same group and size: what a
                               misplaced write or a stale node hands back); the readers must
                               refuse them (trailer check: ``load_corrupt_object``) and recompute
    after-corrupt   (phase-s)
    node-kill       (-)        the extra store node SIGKILLed: the objects in its segment are gone
                               while the master still lists them (loads fail, requests recompute)
    after-node-kill (phase-s)
    kill            (-)        master SIGKILLed, a new one started on the SAME port after 3 s
    after-kill      (phase-s)

``--sessions`` agentic sessions (the demo's seeded Trajectory: each turn re-sends the previous
prompt + answer + a new chunk) run concurrently, one request at a time each (``--think-s`` between
an answer and the session's next turn), with a small local
KV cache so later turns must come from the store; each session runs ``cycle`` trajectories in
turn (re-running one re-reads its old objects). Per phase: requests, failures (HTTP error or
empty answer; the policy is recompute, so the target is 0), p50/p99 TTFT, prompt-token hit rate,
store failed loads and corrupt objects refused (metric deltas), sampled turns that differ from
a salted recompute (after the run, up to ``--samples`` turns per phase, 3x that after a data
fault, that had cached tokens are re-sent with a fresh ``cache_salt``, compared with the demo's
rule; target 0); turns longer than the slowest healthy turn + 2 x timeout_s (target 0); seconds
from the new master until the store serves loads again (``vllm:hybridkv_store_loaded_blocks``
grows), against :func:`recovery_bound_s`; the server's RSS and thread count sampled every 2 s
(growth target < 5 %); processes and temp dirs left after shutdown (target none).
Writes ``soak.json``, ``soak.md`` (the table) and ``soak.png`` (TTFT, hit rate, RSS over time).

``--pd`` (P/D + store; writes ``soak_pd.*``): the same sessions through cli/pd_stack.py's
PDStack (``hybridkv proxy`` -> a prefill and a decode server, one core each), both with
MultiConnector(HybridPDConnector + HybridStoreConnector) on the one master (the configs of
tests/e2e/test_pd_store_multiconnector.py; the decode's children P/D first by default, see
:func:`pd_configs`), the same store faults (the store node and the master are shared by both
instances) and one more, after them:

    prefill-kill        (-)    a burst of ``pd_burst`` fresh long prompts sent through the
                               proxy's two legs by hand; once every decode leg is posted, the
                               prefill's process group is frozen (SIGSTOP: no READ of it can
                               complete) and SIGKILLed once the decode has issued READs of it
                               (:func:`prefill_kill_mid_read` says how that is proven), then the
                               prefill is started again on its port
    after-prefill-kill  (phase-s)

Requests the proxy answers 502 "prefill instance ... unreachable" while the prefill is down
are counted apart (``prefill down``: a proxy without its decode-only fallback, before 827c07f or
with --no-fallback; no load-failure policy covers a dead prefill); every other failure counts.
The proxy's decode-only fallbacks (``hybridkv_proxy_decode_only_fallbacks_total``) per phase. Also per phase: the tokens the
decode got from its peer (P/D READs that landed); seconds from the restarted prefill's health
until they grow again (against :func:`pd_recovery_bound_s`); RSS / threads of both servers.
``--fault NAME`` (repeatable) runs a subset of the faults (the CI variants).

``--plant`` (for showing that the CI checks can fail, never for results): ``no-restart`` (the
master is not restarted after the SIGKILL), ``leak-master`` (the restarted master is not stopped
at shutdown), ``sealed-corruption`` (the misplaced objects are re-sealed under the victim's key,
so the trailer check passes: a verification hole), ``policy-fail`` (kv_load_failure_policy
"fail" instead of "recompute"), ``no-prefill-restart`` (--pd: the killed prefill stays dead),
``leak-prefill`` (--pd: the prefill server is not stopped at shutdown), ``kill-before-read``
(--pd: the prefill is SIGKILLed as soon as it is frozen, without waiting for the decode to
issue a READ).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from hybridkv.cli.harness.stall_cpu import CpuSampler, describe, stalls

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("GLOG_minloglevel", "2")

PHASES = (
    "warm",
    "stop",
    "after-stop",
    "corrupt",
    "after-corrupt",
    "node-kill",
    "after-node-kill",
    "kill",
    "after-kill",
)
STORE_FAULTS = (
    "stop",
    "corrupt",
    "node-kill",
    "kill",
)  # in this order; each followed by "after-<fault>"
PD_FAULTS = (*STORE_FAULTS, "prefill-kill")
PLANTS = (
    "no-restart",
    "leak-master",
    "sealed-corruption",
    "policy-fail",
    "no-prefill-restart",
    "leak-prefill",
    "kill-before-read",
)
# Phases whose loads may meet wrong bytes (misplaced objects, a dead node's objects): sampled
# DATA_FAULT_SAMPLES x more, since only the turns that loaded a faulted object can show it.
DATA_FAULT_PHASES = ("corrupt", "after-corrupt", "node-kill", "after-node-kill")
DATA_FAULT_SAMPLES = 3
# Older recorded runs SIGKILLed the prefill this long after the burst's decode legs were posted
# (their table says so when re-rendered); prefill_kill_mid_read waits for evidence instead.
OLD_KILL_AFTER_POST_S = 0.05
POLL_S = 0.05  # prefill_kill_mid_read polls the decode's p2p admissions this often while the prefill is frozen
BURST_HANDOVER_WAIT_S = 60.0  # a burst prefill leg answered without a hand-over (lease budget full) is asked again this long
SAMPLE_S = 2.0  # the sampler's period (RSS, threads, loaded blocks)
KILL_GAP_S = 3.0  # master SIGKILLed -> new master started
# Measured facts of Mooncake 0.3.13.post1 the recovery bound rests on (store/mooncake_backend.py):
DEAD_MASTER_CALL_S = 4.5  # a call issued while the master is dead blocks ~4.3-4.5 s, then -900
RECONNECT_S = 1.0  # a client reconnects to a master restarted on the same port within ~1 s
LEASE_TTL_MS = 5000

# Another store node: contributes a segment, so objects land in it too (killed in node-kill).
_NODE = """
import os, sys, time
from hybridkv.store.mooncake_backend import MooncakeBackend
parent = os.getppid()
b = MooncakeBackend(sys.argv[1], global_segment_size=int(sys.argv[2]))
print("ready", flush=True)
while os.getppid() == parent:  # never outlive the soak (it may be SIGKILLed)
    time.sleep(1.0)
"""


@dataclass
class SoakConfig:
    """One soak run; the defaults are the full run's (the CI variant shortens them)."""

    sessions: int = 16
    phase_s: float = 60.0
    stop_s: float = 10.0
    turns: int = 6
    max_tokens: int = 16
    num_gpu_blocks: int = 64
    timeout_s: float = 2.0  # the connector's timeout_s (lookup_timeout_s = min(1, timeout_s))
    kind: str = "gemma3"
    first_tokens: int = 600
    growth_tokens: int = 120
    # Trajectories per session slot, run in turn: a session later re-runs one it ran before
    # (same seed, same greedy answers), so objects saved minutes ago are read again, as when
    # an agent resumes a task; without it nothing but the live sessions' prefixes is ever read.
    cycle: int = 3
    corrupt_fraction: float = 0.05
    node_segment: str = "256MiB"  # the extra store node's segment (the engine contributes 512MiB)
    samples: int = 8  # sampled turns per phase compared with a salted recompute
    seed: int = 0
    plant: list[str] = field(default_factory=list)
    # The faults to run, in the order of STORE_FAULTS / PD_FAULTS (empty: all of the mode's).
    faults: list[str] = field(default_factory=list)
    # --pd: the sessions through cli/pd_stack.py's PDStack (prefill + decode + hybridkv proxy),
    # each instance MultiConnector(HybridPDConnector + HybridStoreConnector) on the one master.
    pd: bool = False
    pd_decode_order: str = "pd,store"  # the decode MultiConnector's children (see pd_configs)
    pd_lease_s: float = 30.0
    pd_max_lease_fraction: float = 0.9
    pd_read_timeout_s: float = 5.0
    pd_handshake_timeout_s: float = 2.0
    pd_burst: int = 3  # fresh long prompts whose READs the prefill kill cuts
    pd_burst_tokens: int = 1000
    # A session's pause after each answered turn before its next request (an agent reading the
    # answer or running a tool). 0: back to back (the full runs so far). Bounds that wait for a
    # session's next turn include it.
    think_s: float = 0.0
    # Added to every HybridStoreConnector's kv_connector_extra_config (validated there, as an
    # operator's config is), e.g. {"malloc_trim_interval_s": 10}: A/B runs of a store option.
    store_extra: dict = field(default_factory=dict)


def agentic_session(
    url: str,
    model: str,
    slot: int,
    cfg: SoakConfig,
    stop: threading.Event,
    on_turn: "Callable[[int, int, float, str, Any, str | None, Any], None]",
    begin: "Callable[[], Any]" = lambda: None,
) -> None:
    """One agentic session against ``url`` until ``stop`` is set (bench/soak.py's sessions and
    bench/rss_growth.py's): ``cfg.turns`` turns of a seeded Trajectory (each prompt = the
    previous prompt + answer + new text), ``cfg.cycle`` trajectories per slot run in turn (a
    later one re-runs one run before: same seed, same greedy answers), ``cfg.think_s`` between
    an answer and the next turn. After each turn ``on_turn(slot, turn, start, prompt,
    completion or None, error or None, begin())`` where ``begin()`` was read as the turn started
    (the soak's phase: a turn belongs to the phase it started in); a failed turn starts the
    next trajectory 1 s later."""
    from hybridkv.cli.agentic_demo import Client, Trajectory

    client = Client(url, timeout_s=120)
    gen, turn, prompt, answer = 0, 0, "", ""
    while not stop.is_set():
        traj = Trajectory(
            1000 * slot + gen % cfg.cycle + 100_000 * cfg.seed, cfg.first_tokens, cfg.growth_tokens
        )
        prompt = traj.prompt(turn, prompt, answer)
        start, ctx = time.monotonic(), begin()
        c, error = None, None
        try:
            c = client.complete(model, prompt, cfg.max_tokens)
            if not c.token_ids:
                c, error = None, "empty completion"
            else:
                answer = c.text
        except Exception as e:  # noqa: BLE001 - counted as a failure
            error = f"{type(e).__name__}: {str(e)[:200]}"
        on_turn(slot, turn, start, prompt, c, error, ctx)
        if c is None or turn + 1 >= cfg.turns:
            gen, turn, prompt, answer = gen + 1, 0, "", ""
            if c is None:
                time.sleep(1.0)
        else:
            turn += 1
        if c is not None and cfg.think_s:
            stop.wait(cfg.think_s)


def faults_of(cfg: SoakConfig) -> list[str]:
    """The run's faults in schedule order (the store-only run: all four store faults)."""
    known = PD_FAULTS if cfg.pd else STORE_FAULTS
    bad = set(cfg.faults) - set(known)
    if bad:
        raise ValueError(f"unknown fault(s) {sorted(bad)} for this mode; known: {known}")
    return [f for f in known if f in cfg.faults] if cfg.faults else list(known)


def phases_of(cfg: SoakConfig) -> list[str]:
    """``warm``, then per fault the fault's own phase and ``after-<fault>`` (PHASES for the
    store-only run with every fault)."""
    return ["warm", *[p for f in faults_of(cfg) for p in (f, f"after-{f}")]]


def pd_recovery_bound_s(cfg: SoakConfig, turn_s: float) -> float:
    """Longest P/D READs may take to land again once the restarted prefill is healthy.

    The chain, each term a bound: a session's next turn starts (its failure back-off, 1 s, or
    its think time, ``think_s``); a first turn whose decode leg READs from a peer entry of the
    dead prefill (same handshake port reused) fails within ``pd_read_timeout_s`` and forgets
    the peer; the next turn's READ handshakes afresh (``pd_handshake_timeout_s``) and lands;
    two turns (2 x ``turn_s``) and the sampler's period (``SAMPLE_S``)::

        bound = max(1, think_s) + read_timeout_s + handshake_timeout_s + 2 turn_s + 2.0

    The phase after the prefill's restart lasts at least this long (+ one sampler period), so
    a recovery inside the bound is always seen."""
    return (
        max(1.0, cfg.think_s)
        + cfg.pd_read_timeout_s
        + cfg.pd_handshake_timeout_s
        + 2 * turn_s
        + SAMPLE_S
    )


def circuit_window_s() -> float:
    """The client's longest circuit window (MASTER_UNREACHABLE): MooncakeBackend's default
    ``retry_after_s`` doubled per failed probe up to ``MAX_RETRY_FACTOR`` times it (store/circuit.py),
    which the connector's shared client uses."""
    from hybridkv.store.mooncake_backend import MAX_RETRY_FACTOR, MooncakeBackend

    base = float(inspect.signature(MooncakeBackend.__init__).parameters["retry_after_s"].default)
    return MAX_RETRY_FACTOR * base


def recovery_bound_s(cfg: SoakConfig, turn_s: float) -> float:
    """Longest the store may take to serve loads again after the new master has started.

    ``turn_s``: the longest turn of the healthy (warm) phase. The chain, each term a bound:
    a call issued on the dead master returns (``DEAD_MASTER_CALL_S``; abandoned after
    ``timeout_s``, it still refuses data calls until it returns) + the client's circuit at its
    longest window (``retry_after_s`` x ``MAX_RETRY_FACTOR``) + reconnect (``RECONNECT_S``) + the epoch monitor notices the empty
    master and the scheduler drops its recently-saved keys (``EPOCH_CHECK_S`` + its check's
    bound ``min(timeout_s, 1)``) + one turn that saves a session's prefix and the next turn
    that loads it (2 x ``turn_s``) + the sampler's period (``SAMPLE_S``)::

        bound = 4.5 + 4 x retry_after_s + 1.0 + EPOCH_CHECK_S + min(timeout_s, 1) + 2 turn_s + 2.0
    """
    from hybridkv.store.session import EPOCH_CHECK_S

    return (
        DEAD_MASTER_CALL_S
        + circuit_window_s()
        + RECONNECT_S
        + EPOCH_CHECK_S
        + min(cfg.timeout_s, 1.0)
        + 2 * turn_s
        + SAMPLE_S
    )


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _metrics_text(client) -> str | None:  # noqa: ANN001 - agentic_demo.Client
    try:
        r = client.http.get(client.url + "/metrics", timeout=10)
        r.raise_for_status()
        return r.text
    except Exception:  # noqa: BLE001 - the server may be busy; a missing sample is fine
        return None


def metric_sum(text: str | None, name: str, **labels: str) -> float:
    """Sum of ``name`` (exact, label sets matching ``labels``) in Prometheus text; NaN if none."""
    if text is None:
        return float("nan")
    total, seen = 0.0, False
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name or not all(w in head for w in want):
            continue
        try:
            total += float(value)
            seen = True
        except ValueError:
            continue
    return total if seen else 0.0


def _counters(text: str | None, pd: bool = False) -> dict[str, float]:
    """The store counters the table reports per phase (deltas between phase starts); under
    ``pd`` also the tokens the decode got from its peer (P/D READs that landed)."""
    extra = (
        {"p2p_tokens": metric_sum(text, "vllm:prompt_tokens_cached_by_source_total", source="p2p")}
        if pd
        else {}
    )
    return {
        **extra,
        "loaded_blocks": metric_sum(text, "vllm:hybridkv_store_loaded_blocks_total"),
        "failed_loads": metric_sum(text, "vllm:hybridkv_store_failed_loads_total"),
        "corrupt_refused": metric_sum(
            text, "vllm:hybridkv_store_failures_total", cause="load_corrupt_object"
        ),
        "store_failures": metric_sum(text, "vllm:hybridkv_store_failures_total"),
    }


def corrupt_objects(
    address: str,
    key_logs: list[pathlib.Path],
    fraction: float,
    rng: random.Random,
    sealed: bool = False,
) -> dict[str, int]:
    """Overwrite ``fraction`` of the stored objects with another stored object of their group.

    The plausible corruption of tests/e2e/test_store_sharing_and_faults.py ("another key's
    object"): the source's real bytes, trailer included, under the victim's key, through the
    real Mooncake client (upsert). Present objects are those the key logs list that the master
    still holds. ``sealed`` (a plant): re-seal the source's payload under the victim's key, so
    the trailer check passes and only the output comparison can tell.
    """
    from hybridkv.store.mooncake_backend import MooncakeBackend
    from hybridkv.store.object_trailer import TRAILER_BYTES, format_code_of, seal

    by_group: dict[tuple[str, str], dict[str, None]] = {}
    lines = [
        ln for key_log in key_logs if key_log.exists() for ln in key_log.read_text().splitlines()
    ]
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            by_group.setdefault((parts[1], parts[2]), {})[parts[0]] = None
    present_n = planted = 0
    # The chaos tool's own client waits longer than the engines' (timeout_s 2-5 s): it is the
    # harness, and a P/D soak run died here when an exists took over 5 s under both engines' load.
    with MooncakeBackend(address, global_segment_size=0, timeout_s=30.0) as client:
        for keys in by_group.values():
            keys_l = list(keys)
            present = []
            for i in range(0, len(keys_l), 256):
                chunk = keys_l[i : i + 256]
                present += [k for k, ok in zip(chunk, client.exists(chunk)) if ok]
            present_n += len(present)
            if len(present) < 2:
                continue
            for victim in rng.sample(present, max(1, round(fraction * len(present)))):
                source = rng.choice([k for k in present if k != victim])
                data = client.get_bytes(source)
                if not data:
                    continue
                if sealed:
                    data = seal(victim, data[:-TRAILER_BYTES], format_code=format_code_of(data))
                planted += client.replace_bytes(victim, data) == 0
    return {"present": present_n, "planted": planted}


def _start_node(address: str, segment: str) -> subprocess.Popen:
    from hybridkv.connector.store_config import parse_size

    node = subprocess.Popen(
        [sys.executable, "-c", _NODE, address, str(parse_size("node_segment", segment))],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert node.stdout is not None
    line = node.stdout.readline().strip()
    if line != b"ready":
        node.kill()
        raise RuntimeError(f"store node did not start (said {line!r})")
    return node


def _alive(pid: int, created: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _new_children(me, before: set[int]) -> set[int]:  # noqa: ANN001 - psutil.Process
    """This process's live descendants that were not there at ``before``."""
    out = set()
    for p in me.children(recursive=True):
        try:
            if p.pid not in before and _alive(p.pid, p.create_time()):
                out.add(p.pid)
        except Exception:  # noqa: BLE001 - psutil.Error: gone meanwhile
            continue
    return out


def _store_config(
    cfg: SoakConfig, address: str, key_log: pathlib.Path, policy: str, segment: str
) -> dict:
    """HybridStoreConnector (the store-only server's connector; under --pd each MultiConnector's
    store child: the child repeats the policy, its own KVTransferConfig defaults to "fail")."""
    return {
        "kv_connector": "HybridStoreConnector",
        "kv_connector_module_path": "hybridkv.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "master_address": address,
            "global_segment_size": segment,
            "timeout_s": cfg.timeout_s,
            "lookup_timeout_s": min(1.0, cfg.timeout_s),
            "key_log_path": str(key_log),
        }
        | cfg.store_extra,
    }


def pd_configs(
    cfg: SoakConfig, address: str, key_logs: tuple[pathlib.Path, pathlib.Path], policy: str
) -> tuple[dict, dict]:
    """(prefill, decode) MultiConnector configs: HybridPDConnector + HybridStoreConnector on one
    master, as tests/e2e/test_pd_store_multiconnector.py. The decode's children in
    ``cfg.pd_decode_order``: MultiConnector loads from the FIRST child offering tokens, so with
    the store first (that test's order) the store serves nearly every turn of an agentic
    session (it holds the previous turn's prefix) and P/D reads only what it lacks entirely;
    the soak's default puts P/D first, so every hand-over is a READ (what the prefill kill
    must hit) and the store serves the prefill's prefix loads."""
    lease = {"lease_s": cfg.pd_lease_s, "max_lease_fraction": cfg.pd_max_lease_fraction}
    pd_p = {
        "kv_connector": "HybridPDConnector",
        "kv_role": "kv_producer",
        "kv_connector_module_path": "hybridkv.connector",
        "kv_connector_extra_config": lease,
    }
    pd_d = {
        "kv_connector": "HybridPDConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_module_path": "hybridkv.connector",
        "kv_connector_extra_config": {
            "read_timeout_s": cfg.pd_read_timeout_s,
            "handshake_timeout_s": cfg.pd_handshake_timeout_s,
        },
    }
    store_p = _store_config(cfg, address, key_logs[0], policy, "256MiB")
    store_d = _store_config(cfg, address, key_logs[1], policy, "256MiB")
    order = {"pd": pd_d, "store": store_d}
    names = cfg.pd_decode_order.split(",")
    if sorted(names) != ["pd", "store"]:
        raise ValueError(
            f"pd_decode_order={cfg.pd_decode_order!r}: expected 'pd,store' or 'store,pd'"
        )

    def multi(children: list[dict]) -> dict:
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"connectors": children},
        }

    return multi([pd_p, store_p]), multi([order[n] for n in names])


def _log_size(path: pathlib.Path | None) -> int:
    return path.stat().st_size if path is not None and path.exists() else 0


def _log_lines(path: pathlib.Path | None, since: int = 0) -> list[str]:
    """Lines of ``path`` from byte offset ``since`` (a server log; empty if none)."""
    if path is None or not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(since)
        return f.read().decode("utf-8", "replace").splitlines()


def pd_metrics(text: str | None) -> dict[str, float]:
    """The decode's ``vllm:hybridkv_pd_*`` read counters and failures by cause (``fail.<cause>``),
    to set beside what its log says (``pd_read_outcomes``): /metrics must tell the same story.
    Empty when /metrics could not be read."""
    if text is None:
        return {}
    out = {
        n: metric_sum(text, f"vllm:hybridkv_pd_{n}_total")
        for n in ("reads", "read_blocks", "read_bytes", "failed_reads", "timed_out_reads")
    }
    for line in text.splitlines():
        if line.startswith("vllm:hybridkv_pd_failures_total{") and 'cause="' in line:
            cause = line.split('cause="', 1)[1].split('"', 1)[0]
            out[f"fail.{cause}"] = out.get(f"fail.{cause}", 0.0) + float(line.rsplit(" ", 1)[1])
    return {k: (0.0 if v != v else v) for k, v in out.items()}  # NaN (series never incremented): 0


def pd_counts_agree(log: dict[str, int], metrics: dict[str, float]) -> bool:
    """The decode's /metrics tell what its log tells: reads = provenance lines, failed reads =
    per-job failure lines, and the causes sum to them."""
    causes = sum(v for k, v in metrics.items() if k.startswith("fail."))
    return bool(metrics) and (metrics.get("reads"), metrics.get("failed_reads"), causes) == (
        log.get("completed"),
        log.get("failed_jobs"),
        log.get("failed_jobs"),
    )


def settled_pd_counts(
    decode_log: pathlib.Path | None, url: str, within_s: float = 30.0
) -> tuple[dict[str, int], dict[str, float]]:
    """The decode log's read outcomes and its /metrics, read again (1 s apart, ``within_s`` at
    most) until they agree: a read still finishing when the sessions stopped (a client gave up,
    its request goes on) and the stats that reach /metrics one engine step after the log line
    settle within that; a /metrics GET that fails is retried. Returns the last pair either way."""
    import requests

    client = SimpleNamespace(http=requests, url=url)
    deadline = time.monotonic() + within_s
    while True:
        log, metrics = pd_read_outcomes(_log_lines(decode_log)), pd_metrics(_metrics_text(client))
        if pd_counts_agree(log, metrics) or time.monotonic() >= deadline:
            return log, metrics
        time.sleep(1.0)


PD_READ_LINE = "hybridkv P/D: read "  # pd_worker's provenance line: one per completed READ
PD_JOB_FAILED = "failed or was refused; no KV used"  # pd_worker: one line per failed read job
PD_FAIL_MARKS = (
    "discarded, recomputing",
    "failed:",
    "failed or was refused",
    "hybridkv P/D: HandshakeError",
    "unreachable",
    "timed out",
    "ERROR",
)


def pd_read_outcomes(lines: list[str]) -> dict[str, int]:
    """Decode-log lines about P/D READs: completed (the provenance line) and failed or
    discarded (pd_worker's warnings/errors; TransferError warns once per type)."""
    pd = [ln for ln in lines if "hybridkv P/D" in ln]
    done = sum(PD_READ_LINE in ln and " blocks (" in ln for ln in pd)
    failed = sum(
        any(m in ln for m in PD_FAIL_MARKS) and not (PD_READ_LINE in ln and " blocks (" in ln)
        for ln in pd
    )
    # pd_worker's one line per failed read job, every time (its causes may warn once):
    jobs_failed = sum(PD_JOB_FAILED in ln for ln in pd)
    return {"completed": done, "failed_or_discarded": failed, "failed_jobs": jobs_failed}


def run_soak(cfg: SoakConfig, out: pathlib.Path, log=None, keep_log: bool = False) -> dict:  # noqa: ANN001, C901
    """Run the soak, write the results under ``out``; returns the json document.

    ``keep_log``: copy the server log(s) to ``out/<stem>.*.log`` (the temp dir holding them is
    removed): ``soak.vllm.log``; under ``cfg.pd`` ``soak_pd.{prefill,prefill.1,decode,proxy}.log``."""
    import psutil

    from hybridkv.cli.agentic_demo import DEFAULT_LOGPROB_TOL, Client, compare
    from hybridkv.cli.harness.tiny_models import write_tiny_model
    from hybridkv.cli.server import VllmServer
    from hybridkv.store.embedded_master import EmbeddedMaster

    unknown = set(cfg.plant) - set(PLANTS)
    if unknown:
        raise ValueError(f"unknown plant(s) {sorted(unknown)}; known: {PLANTS}")
    faults = faults_of(cfg)
    phases = phases_of(cfg)

    def say(msg: str) -> None:
        print(msg, file=log or sys.stderr, flush=True)

    out.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    work = pathlib.Path(tempfile.mkdtemp(prefix="hybridkv-soak-"))
    key_logs = (
        [work / "keys.log"] if not cfg.pd else [work / "prefill_keys.log", work / "decode_keys.log"]
    )
    model = str(
        write_tiny_model(
            cfg.kind,
            pathlib.Path.home() / ".cache" / "hybridkv" / "tiny-models" / f"{cfg.kind}-seed0",
            seed=0,
        )
    )
    master = EmbeddedMaster(default_kv_lease_ttl_ms=LEASE_TTL_MS)
    port = master.rpc_port
    master_dirs = [master.log_path.parent]  # each must be gone after shutdown
    masters = [master]
    node = _start_node(master.address, cfg.node_segment)
    policy = "fail" if "policy-fail" in cfg.plant else "recompute"
    common = ["--seed", "0", "--max-num-batched-tokens", "512", "--max-num-seqs", "8"]
    stack = srv = None
    if cfg.pd:
        from hybridkv.cli.pd_stack import PDStack

        p_cfg, d_cfg = pd_configs(cfg, master.address, (key_logs[0], key_logs[1]), policy)
        stack = PDStack(
            model,
            max_model_len=2048,
            log_dir=work,
            prefill_config=p_cfg,
            decode_config=d_cfg,
            # The same KV cache size on both: the decode refuses block ids past its own.
            extra_args=[*common, "--num-gpu-blocks-override", str(cfg.num_gpu_blocks)],
        )
        servers = {"prefill": stack.prefill, "decode": stack.decode}
        main_srv = stack.decode  # RSS/threads "rss_mib"; the salted recompute reference
    else:
        kv = _store_config(cfg, master.address, key_logs[0], policy, "512MiB")
        srv = VllmServer(
            model,
            max_model_len=2048,
            kv_transfer_config=kv,
            log_path=work / "vllm.log",
            extra_args=["--num-gpu-blocks-override", str(cfg.num_gpu_blocks), *common],
        )
        servers = {"server": srv}
        main_srv = srv
    records: list[dict] = []
    completions: dict[int, tuple[str, object]] = {}  # record index -> (prompt, served Completion)
    samples: list[dict] = []
    events: dict[str, float] = {}
    counters: dict[str, dict[str, float]] = {}
    corruption: dict[str, int] = {}
    burst: dict = {}
    exited: dict[str, int] = {}  # server -> return code, for one that exited before shutdown
    server_pids: dict[int, float] = {}  # every server process seen -> create time
    offsets: dict[str, float] = {}  # a restarted server's counters before its restart
    phase = {"name": "warm"}
    lock = threading.Lock()
    stop_all = threading.Event()
    rng = random.Random(f"soak-{cfg.seed}")
    t_start = time.monotonic()

    def all_counters() -> dict[str, float]:
        """The counters summed over the servers (plus what a restarted one had counted)."""
        total: dict[str, float] = {}
        for name, s in servers.items():
            c = _counters(_metrics_text(probes[name]), pd=cfg.pd)
            for k, v in c.items():
                total[k] = (
                    total.get(k, 0.0) + v + (offsets.get(k, 0.0) if name == "prefill" else 0.0)
                )
        if stack is not None:  # requests the proxy sent to decode alone (no prefill served them)
            total["decode_only"] = metric_sum(
                _metrics_text(proxy_probe), "hybridkv_proxy_decode_only_fallbacks_total"
            )
        return total

    try:
        if stack is not None:
            stack.start()
            front = stack.url
        else:
            srv.start()
            front = srv.url
        t0 = time.monotonic()
        srv_model = Client(main_srv.url).model_card()[0]
        probes = {name: Client(s.url, timeout_s=10) for name, s in servers.items()}
        probe = probes["decode" if cfg.pd else "server"]
        proxy_probe = Client(front, timeout_s=10)

        def on_turn(
            slot: int,
            turn: int,
            start: float,
            prompt: str,
            c,
            error: str | None,  # noqa: ANN001
            started_in: str,
        ) -> None:
            rec = {"t": start - t0, "phase": started_in, "slot": slot, "turn": turn}
            if c is not None:
                rec.update(
                    ok=True,
                    ttft_ms=c.ttft_s * 1e3,
                    prompt=c.prompt_tokens,
                    cached=c.cached_tokens or 0,
                )
            else:
                rec.update(ok=False, **({"error": error} if error else {}))
            rec["latency_s"] = time.monotonic() - start
            with lock:
                records.append(rec)
                if c is not None:
                    completions[len(records) - 1] = (prompt, c)

        def session_loop(slot: int) -> None:
            agentic_session(
                front, srv_model, slot, cfg, stop_all, on_turn, begin=lambda: phase["name"]
            )

        def tree(s) -> list:  # noqa: ANN001 - VllmServer -> psutil.Process list
            proc_ = s.proc
            if proc_ is None:
                return []
            try:
                root = psutil.Process(proc_.pid)
                return [root, *root.children(recursive=True)]
            except psutil.Error:
                return []

        def sampler() -> None:
            client = Client(main_srv.url, timeout_s=10)
            while not stop_all.wait(SAMPLE_S):
                row = {"t": time.monotonic() - t0, "phase": phase["name"]}
                try:
                    for name, s in servers.items():
                        procs = tree(s)
                        for p_ in procs:
                            server_pids.setdefault(p_.pid, p_.create_time())
                        pre = "prefill_" if name == "prefill" else ""
                        by_proc = {
                            f"{p_.name()}[{p_.pid}]": p_.memory_info().rss / 2**20
                            for p_ in procs
                            if p_.is_running()
                        }
                        row[pre + "rss_mib"] = sum(by_proc.values())
                        row[pre + "rss_by_proc"] = (
                            by_proc  # which process grows (api server, engine core)
                        )
                        row[pre + "threads"] = sum(
                            p_.num_threads() for p_ in procs if p_.is_running()
                        )
                except psutil.Error:
                    continue
                if cfg.pd:
                    loaded = sum(
                        metric_sum(
                            _metrics_text(probes[n]), "vllm:hybridkv_store_loaded_blocks_total"
                        )
                        + (offsets.get("loaded_blocks", 0.0) if n == "prefill" else 0.0)
                        for n in servers
                    )
                    row["loaded_blocks"] = loaded
                    row["p2p_tokens"] = metric_sum(
                        _metrics_text(client),
                        "vllm:prompt_tokens_cached_by_source_total",
                        source="p2p",
                    )
                else:
                    text = _metrics_text(client)
                    row["loaded_blocks"] = metric_sum(
                        text, "vllm:hybridkv_store_loaded_blocks_total"
                    )
                samples.append(row)

        def enter(name: str) -> None:
            counters[name] = all_counters()
            phase["name"] = name
            events[name] = time.monotonic() - t0
            say(f"[{events[name]:7.1f} s] {name}")

        def fault_stop() -> None:
            os.kill(master.pid, signal.SIGSTOP)
            time.sleep(cfg.stop_s)
            os.kill(master.pid, signal.SIGCONT)

        def fault_corrupt() -> None:
            nonlocal corruption
            corruption = corrupt_objects(
                master.address,
                key_logs,
                cfg.corrupt_fraction,
                rng,
                sealed="sealed-corruption" in cfg.plant,
            )
            say(f"  corrupted {corruption['planted']} of {corruption['present']} stored objects")

        def fault_node_kill() -> None:
            node.kill()
            node.wait()

        def fault_kill() -> None:
            nonlocal master
            master.kill()
            time.sleep(KILL_GAP_S)
            if "no-restart" not in cfg.plant:
                master = EmbeddedMaster(default_kv_lease_ttl_ms=LEASE_TTL_MS, rpc_port=port)
                masters.append(master)
                master_dirs.append(master.log_path.parent)
            events["master_back"] = time.monotonic() - t0

        def fault_prefill_kill() -> None:
            nonlocal burst
            assert stack is not None
            burst = prefill_kill_mid_read(
                cfg, stack, srv_model, t0, records, completions, lock, say
            )
            # The dead prefill's counters stay in the totals (its new process counts from 0).
            for k, v in counters["prefill-kill"].items():
                offsets[k] = offsets.get(k, 0.0) + burst["prefill_counters"].get(k, 0.0)
            if "no-prefill-restart" in cfg.plant:
                say("  PLANTED: the prefill is not restarted")
                return
            old = stack.restart_prefill()
            events["prefill_back"] = time.monotonic() - t0
            burst["old_prefill_log"] = str(old)
            say(
                f"  prefill healthy again {events['prefill_back'] - burst['killed_at']:.1f} s after the kill"
            )

        actions = {
            "stop": fault_stop,
            "corrupt": fault_corrupt,
            "node-kill": fault_node_kill,
            "kill": fault_kill,
            "prefill-kill": fault_prefill_kill,
        }
        workers = [
            threading.Thread(target=session_loop, args=(i,), daemon=True)
            for i in range(cfg.sessions)
        ]
        workers.append(threading.Thread(target=sampler, daemon=True))

        def cpu_pids() -> dict[str, list[int]]:  # read each second: restarted processes appear
            pids = {name: [p_.pid for p_ in tree(s)] for name, s in servers.items()}
            proxy = getattr(stack, "_proxy", None) if stack is not None else None
            return {
                **pids,
                "master": [master.pid],
                "node": [node.pid],
                **({"proxy": [proxy.pid]} if proxy is not None else {}),
            }

        cpu = CpuSampler(t0, cpu_pids, stop_all)
        cpu.start()
        counters["warm"] = all_counters()
        events["warm"] = 0.0
        for w in workers:
            w.start()
        time.sleep(cfg.phase_s)
        for name in faults:
            enter(name)
            actions[name]()
            enter(f"after-{name}")
            hold = cfg.phase_s
            if name == "prefill-kill":  # long enough to see P/D READs back within their bound
                with lock:
                    warm_turn = max(
                        (r["latency_s"] for r in records if r["phase"] == "warm" and r.get("ok")),
                        default=0.0,
                    )
                hold = max(hold, pd_recovery_bound_s(cfg, warm_turn) + SAMPLE_S)
            time.sleep(hold)
        counters["end"] = all_counters()
        stop_all.set()
        for w in workers:
            w.join(timeout=150)
        if cfg.pd:
            decode_log = stack.decode.log_path
            burst["decode_reads_after_kill"] = pd_read_outcomes(
                _log_lines(decode_log, burst.get("decode_log_at_kill", 0))
            )
            burst["decode_reads_total"], burst["decode_pd_metrics"] = settled_pd_counts(
                decode_log, stack.decode.url
            )

        # Sampled turns vs a salted recompute (the sessions have stopped: the server is idle).
        # Under --pd every turn's KV came from elsewhere (the peer's READ, or the store), so
        # any good turn may be sampled; the burst's turns (their READs cut by the kill) always are.
        picked: list[int] = []
        for name in phases:
            idx = [
                i
                for i, r in enumerate(records)
                if r["phase"] == name
                and r.get("ok")
                and r["slot"] >= 0
                and (cfg.pd or r["cached"] > 0)
            ]
            n = cfg.samples * (DATA_FAULT_SAMPLES if name in DATA_FAULT_PHASES else 1)
            picked += sorted(rng.sample(idx, min(n, len(idx))))
        picked += [i for i, r in enumerate(records) if r["slot"] < 0 and r.get("ok")]
        checks = []
        for i in picked:
            prompt, served = completions[i]
            ref = None
            try:
                salt = f"soak-recompute-{uuid.uuid4().hex}"
                ref = probe.complete(srv_model, prompt, cfg.max_tokens, cache_salt=salt)
                cmp = compare(served, ref, DEFAULT_LOGPROB_TOL)
                same = cmp.matches and not ref.cached_tokens
                why = cmp.why + (
                    f"; recompute was not a miss ({ref.cached_tokens} cached)"
                    if ref.cached_tokens
                    else ""
                )
            except Exception as e:  # noqa: BLE001 - a recompute that fails is a difference
                same, why = False, f"recompute failed: {type(e).__name__}: {str(e)[:200]}"
            records[i]["matches_recompute"] = same
            checks.append(
                {
                    "record": i,
                    "phase": records[i]["phase"],
                    "cached": records[i]["cached"],
                    "matches": same,
                    "why": why,
                    "burst": records[i]["slot"] < 0,
                }
            )
            if not same and cfg.pd:  # evidence for a difference: both answers' token ids
                checks[-1].update(
                    served_ids=list(getattr(served, "token_ids", [])),
                    ref_ids=None if ref is None else list(ref.token_ids),
                )
    finally:
        stop_all.set()
        if stack is not None:
            # A server that exited on its own before shutdown (e.g. its engine died): a finding.
            for name, s in servers.items():
                if s.proc is not None and s.proc.poll() is not None:
                    exited[name] = s.proc.returncode
                    say(
                        f"  the {name} server had exited on its own (rc {s.proc.returncode}); log {s.log_path}"
                    )
            if "leak-prefill" in cfg.plant and stack.prefill.proc is not None:
                say(
                    f"  PLANTED: the prefill (pid {stack.prefill.proc.pid}) is not stopped at shutdown"
                )
                stack.prefill.proc = None
            stack.stop()
        if srv is not None:
            srv.stop()
        if node.poll() is None:
            node.kill()
            node.wait()
        for m in masters:
            if "leak-master" in cfg.plant and m is masters[-1] and len(masters) > 1:
                continue
            m.stop()
        stem = "soak_pd" if cfg.pd else "soak"
        if keep_log:
            logs = sorted(work.glob("*.log")) if cfg.pd else [work / "vllm.log"]
            for f in logs:
                if f.exists() and not f.name.endswith("keys.log"):
                    shutil.copy(f, out / (f"{stem}.{f.stem}.log" if cfg.pd else "soak.vllm.log"))
        shutil.rmtree(work, ignore_errors=True)
    time.sleep(2.0)
    left_procs = sorted(
        {pid for pid, created in server_pids.items() if _alive(pid, created)}
        | _new_children(me, children_before)
        | {
            p_.pid
            for p_ in psutil.process_iter(["cmdline"])
            if any(f"--rpc_port={port}" in a for a in (p_.info["cmdline"] or []))
        }
    )
    left_dirs = [str(d) for d in master_dirs if d.exists()]
    if work.exists():
        left_dirs.append(str(work))

    doc = summarize(
        cfg, records, samples, events, counters, checks, corruption, left_procs, left_dirs, burst
    )
    doc["wall_s"] = time.monotonic() - t_start
    doc["cpu_samples"] = cpu.rows
    doc["stalls"] = stalls(records, cpu.rows)
    doc["servers_exited"] = exited
    write_results(doc, records, out)
    return doc


def prefill_kill_mid_read(
    cfg: SoakConfig,
    stack,
    model: str,
    t0: float,
    records: list[dict],  # noqa: ANN001
    completions: dict,
    lock: threading.Lock,
    say,
) -> dict:  # noqa: ANN001
    """SIGKILL the prefill while the decode has READs of it in flight.

    How a READ is made to be in flight, and shown to be: ``pd_burst`` fresh prompts of
    ``pd_burst_tokens`` tokens go the proxy's two legs by hand (cli/proxy.py's own
    ``prefill_request`` / ``decode_request``): each prefill leg returns its lease (the prefill
    keeps the blocks). Then the prefill's counters are read, the decode legs are posted and
    the prefill's process group is frozen (SIGSTOP) at once: from then on no READ of it can
    complete (its lease claim cannot be answered; the claim is bounded by
    ``pd_handshake_timeout_s``, the READ by ``pd_read_timeout_s``). The decode's
    ``prompt_tokens_cached_by_source{source="p2p"}`` counts a P/D hit at admission, the step
    its READ job goes to the worker: the prefill is SIGKILLed as soon as that counter has
    grown by the burst's hand-over tokens since the freeze, or ``pd_handshake_timeout_s / 2``
    after it first grew (so the first READ issued cannot have timed out on its own), or after
    ``pd_read_timeout_s`` at the latest. ``reads_issued_at_kill``: the tokens admitted while
    frozen (> 0: a READ was in flight when the prefill died). Per burst turn the decode log
    then says which were cut: no provenance line (printed only for a READ whose claim was
    granted) and a READ failure line for its request. They must be answered all the same
    (policy recompute) and equal a salted recompute (sampled always). The burst's turns are
    records with ``slot`` -1. The kill waits for evidence of a READ in flight, not a fixed
    delay after the posts: behind a scrape of the busy prefill's /metrics, the READs can finish first."""
    import requests

    from hybridkv.cli.agentic_demo import Client, Completion, Trajectory, _absorb_choice
    from hybridkv.cli.proxy import decode_request, prefill_request

    n = cfg.pd_burst
    prefilled = threading.Barrier(n + 1)  # every prefill leg answered
    go = threading.Barrier(n + 1)  # counters read: post the decode legs
    results: list[dict] = [{} for _ in range(n)]
    decode_log = stack.decode.log_path
    decode_probe = Client(stack.decode.url, timeout_s=5)

    def one(k: int) -> None:
        traj = Trajectory(
            900_000 + 1000 * k + 100_000 * cfg.seed, cfg.pd_burst_tokens, cfg.growth_tokens
        )
        prompt = traj.prompt(0, "", "")
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": cfg.max_tokens,
            "temperature": 0.0,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        res = results[k]
        start = time.monotonic()
        rec = {"t": start - t0, "phase": "prefill-kill", "slot": -1, "turn": 0}
        try:
            with requests.Session() as http:
                # Under 16 sessions the prefill's lease budget (max_lease_fraction) is often full:
                # it then answers without a hand-over. That is its policy, not a fault: ask again
                # until it hands one over (otherwise one such leg loses the mid-READ kill).
                deadline = time.monotonic() + BURST_HANDOVER_WAIT_S
                for attempt in range(1, 1000):
                    r = http.post(
                        stack.prefill.url + "/v1/completions",
                        json=prefill_request(body),
                        timeout=120,
                    )
                    r.raise_for_status()
                    params = r.json().get("kv_transfer_params") or {}
                    if params.get("remote_block_ids") or time.monotonic() >= deadline:
                        break
                    time.sleep(1.0)
                res["prefill_attempts"] = attempt
                res["handover_blocks"] = sum(len(g) for g in params.get("remote_block_ids") or [])
                res["handover_tokens"] = int(params.get("remote_num_tokens") or 0)
                res["prefill_request_id"] = params.get("remote_request_id")
                dreq = decode_request(body, r.json())
                prefilled.wait(timeout=120)
                go.wait(timeout=120)
                res["decode_posted"] = time.monotonic() - t0
                d = http.post(stack.decode.url + "/v1/completions", json=dreq, timeout=120)
            if d.status_code != 200:
                raise RuntimeError(f"decode -> {d.status_code}: {d.text[:300]}")
            doc = d.json()
            res["decode_request_id"] = doc.get("id")
            c = Completion()
            for choice in doc.get("choices") or []:
                _absorb_choice(c, choice)
            usage = doc.get("usage") or {}
            c.prompt_tokens = usage.get("prompt_tokens", 0)
            c.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            c.ttft_s = time.monotonic() - start  # not streamed: the whole decode leg
            ok = bool(c.token_ids)
            rec.update(
                ok=ok, ttft_ms=c.ttft_s * 1e3, prompt=c.prompt_tokens, cached=c.cached_tokens or 0
            )
        except Exception as e:  # noqa: BLE001 - counted as a failure
            ok, c = False, None
            rec.update(ok=False, error=f"burst: {type(e).__name__}: {str(e)[:200]}")
            for b in (prefilled, go):
                try:
                    b.abort()
                except Exception:  # noqa: BLE001
                    pass
        rec["latency_s"] = time.monotonic() - start
        with lock:
            records.append(rec)
            if ok:
                completions[len(records) - 1] = (prompt, c)

    def p2p() -> float:
        return metric_sum(
            _metrics_text(decode_probe), "vllm:prompt_tokens_cached_by_source_total", source="p2p"
        )

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(n)]
    for th in threads:
        th.start()
    try:
        prefilled.wait(timeout=120)
    except threading.BrokenBarrierError:
        say("  burst: a prefill leg failed; freezing and killing the prefill anyway")
    # Read while the prefill still answers: its counters (kept in the totals after it dies).
    prefill_counters = _counters(_metrics_text(Client(stack.prefill.url, timeout_s=5)), pd=True)
    log_at_kill = _log_size(decode_log)
    reads_before = pd_read_outcomes(_log_lines(decode_log))["completed"]
    base = p2p()
    expected = sum(r.get("handover_tokens", 0) for r in results)
    group = stack.prefill.proc.pid if stack.prefill.proc is not None else None
    try:
        go.wait(timeout=120)
    except threading.BrokenBarrierError:
        pass
    if group is not None:
        os.killpg(group, signal.SIGSTOP)  # from here on no READ of it completes
    frozen = time.monotonic()
    first_growth = None
    issued = 0.0
    while "kill-before-read" not in cfg.plant:
        now = time.monotonic()
        got = p2p() - base
        if got == got and got > 0:  # not NaN
            issued = got
            first_growth = first_growth or now
        if (
            (expected and issued >= expected)
            or now - frozen >= cfg.pd_read_timeout_s
            or (first_growth is not None and now - first_growth >= cfg.pd_handshake_timeout_s / 2)
        ):
            break
        time.sleep(POLL_S)
    stack.kill_prefill()
    killed = time.monotonic()
    killed_at = killed - t0
    say(
        f"  prefill frozen when {n} burst decode legs were posted, SIGKILLed {killed - frozen:.2f} s later "
        f"(decode admitted {issued:.0f} P/D tokens meanwhile; the burst handed over {expected})"
    )
    for th in threads:
        th.join(timeout=150)
    lines = _log_lines(decode_log)
    for res in results:
        rid = res.get("decode_request_id")
        mine = [ln for ln in lines if rid and rid in ln and "hybridkv P/D" in ln]
        res["read_completed"] = any(PD_READ_LINE in ln and " blocks (" in ln for ln in mine)
        res["read_failed"] = any(any(m in ln for m in PD_FAIL_MARKS) for ln in mine)
        res["log_lines"] = [ln[-300:] for ln in mine][:4]
    in_flight = [
        r
        for r in results
        if r.get("handover_blocks") and not r["read_completed"] and r["read_failed"]
    ]
    say(
        f"  burst: {len(in_flight)} of {n} hand-overs cut by the kill (no provenance line, a READ failure line; "
        f"{sum(bool(r.get('handover_blocks')) for r in results)} handed over)"
    )
    return {
        "killed_at": killed_at,
        "requests": results,
        "in_flight_at_kill": len(in_flight),
        "handed_over": sum(bool(r.get("handover_blocks")) for r in results),
        "decode_log_at_kill": log_at_kill,
        "decode_reads_completed_before_kill": reads_before,
        "prefill_counters": prefill_counters,
        "frozen_s": killed - frozen,
        "reads_issued_at_kill": issued,
        "handover_tokens": expected,
        "first_read_issued_after_s": None if first_growth is None else first_growth - frozen,
    }


def loads_back_after(samples: list[dict], t: float | None) -> float | None:
    """Seconds from ``t`` until a sample shows the store loaded blocks again (None: never)."""
    if t is None:
        return None
    valid = [s for s in samples if s["loaded_blocks"] == s["loaded_blocks"]]  # not NaN
    before = [s["loaded_blocks"] for s in valid if s["t"] <= t]
    base = before[-1] if before else 0.0
    return next((s["t"] - t for s in valid if s["t"] > t and s["loaded_blocks"] > base), None)


def prefill_down(cfg: SoakConfig, r: dict, events: dict[str, float], end: float) -> bool:
    """A failed request that met the dead prefill: the proxy's prefill leg found it gone
    (``hybridkv proxy`` answers 502 "prefill instance ... unreachable": it has no decode-only
    fallback) while it overlapped the window from the kill until the prefill was healthy.
    Counted apart from the failures: no kv_load_failure_policy governs a dead prefill."""
    kill = events.get("prefill-kill")
    if not cfg.pd or r.get("ok") or kill is None:
        return False
    back = events.get("prefill_back", end)
    err = r.get("error", "")
    return (
        "prefill instance" in err
        and "unreachable" in err
        and r["t"] <= back
        and r["t"] + r["latency_s"] >= kill
    )


def rss_by_phase_end(samples: list[dict], key: str = "rss_by_proc") -> dict[str, dict[str, float]]:
    """Per phase, each server process's RSS (MiB) in the phase's last sample: where a step
    in the total comes from (the API server, the engine core with the store client)."""
    out: dict[str, dict[str, float]] = {}
    for s in samples:
        if key in s:
            out[s["phase"]] = {name: round(mib, 1) for name, mib in s[key].items()}
    return out


def _growth(samples: list[dict], key: str) -> float | None:
    warm = [s[key] for s in samples if s["phase"] == "warm" and key in s]
    last = [s[key] for s in samples if key in s]
    return (last[-1] / statistics.mean(warm[-3:]) - 1) if warm and last else None


def summarize(
    cfg: SoakConfig,
    records: list[dict],
    samples: list[dict],
    events: dict[str, float],
    counters: dict[str, dict[str, float]],
    checks: list[dict],
    corruption: dict[str, int],
    left_procs: list[int],
    left_dirs: list[str],
    burst: dict | None = None,
) -> dict:
    """The per-phase table and the run's targets as one json-able document."""
    phases = phases_of(cfg)
    back = events.get("master_back")
    recovered = loads_back_after(samples, back)
    order = [*phases, "end"]
    warm = [r for r in records if r["phase"] == "warm" and r.get("ok")]
    warm_hit = sum(r["cached"] for r in warm) / max(1, sum(r["prompt"] for r in warm))
    # Per fault, from the moment it ended: store loads again; the first turn (started after)
    # whose hit rate is at least half the warm phase's.
    ends = {
        "master SIGSTOP": events.get("after-stop"),
        "objects corrupted": events.get("after-corrupt"),
        "store node SIGKILL": events.get("after-node-kill"),
        "master SIGKILL": back,
    }
    if cfg.pd:
        ends["prefill SIGKILL"] = events.get("prefill_back")
    recovery = {
        name: {
            "loads_back_s": loads_back_after(samples, t),
            "hit_back_s": next(
                (
                    r["t"] - t
                    for r in sorted(records, key=lambda r: r["t"])
                    if r["t"] >= t
                    and r.get("ok")
                    and r["prompt"]
                    and r["cached"] / r["prompt"] >= warm_hit / 2
                ),
                None,
            ),
        }
        for name, t in ends.items()
        if t is not None
    }
    turn_s = max((r["latency_s"] for r in warm), default=0.0)
    # A faulted turn may pay one lookup and one load timeout more than the slowest healthy turn
    # (--pd: and one P/D READ timeout and one lease claim / handshake timeout).
    turn_bound = (
        turn_s
        + 2 * cfg.timeout_s
        + (cfg.pd_read_timeout_s + cfg.pd_handshake_timeout_s if cfg.pd else 0)
    )
    end_t = max((r["t"] + r["latency_s"] for r in records), default=0.0)
    rows = []
    for k, name in enumerate(phases):
        rs = [r for r in records if r["phase"] == name]
        good = [r for r in rs if r.get("ok")]
        down = sum(prefill_down(cfg, r, events, end_t) for r in rs)
        ttft = [r["ttft_ms"] for r in good]
        prompt = sum(r["prompt"] for r in good)
        c0, c1 = counters.get(name), counters.get(order[k + 1])
        delta = {key: (c1[key] - c0[key]) if c0 and c1 else None for key in (c0 or {})}
        sampled = [c for c in checks if c["phase"] == name]
        row = {
            "phase": name,
            "requests": len(rs),
            "failures": len(rs) - len(good) - down,
            "ttft_p50_ms": _pct(ttft, 0.5),
            "ttft_p99_ms": _pct(ttft, 0.99),
            "hit_rate": sum(r["cached"] for r in good) / prompt if prompt else None,
            "max_latency_s": max((r["latency_s"] for r in rs), default=None),
            "over_bound": sum(r["latency_s"] > turn_bound for r in rs),
            "failed_loads": delta.get("failed_loads"),
            "corrupt_refused": delta.get("corrupt_refused"),
            "loaded_blocks": delta.get("loaded_blocks"),
            "sampled": len(sampled),
            "differ": sum(not c["matches"] for c in sampled),
        }
        if cfg.pd:
            row.update(
                prefill_down=down,
                p2p_tokens=delta.get("p2p_tokens"),
                decode_only=delta.get("decode_only"),
            )
        rows.append(row)
    after = [
        r
        for r in records
        if r["phase"] == "after-kill"
        and r.get("ok")
        and recovered is not None
        and r["t"] >= back + recovered
    ]
    after_prompt = sum(r["prompt"] for r in after)
    doc = {
        "config": asdict(cfg),
        "phases": rows,
        "events": events,
        "store_loads_back_after_s": recovered,
        "recovery_bound_s": recovery_bound_s(cfg, turn_s),
        "warm_max_turn_s": turn_s,
        "turn_bound_s": turn_bound,
        "recovery": recovery,
        "warm_hit_rate": warm_hit,
        "hit_rate_after_recovery": sum(r["cached"] for r in after) / after_prompt
        if after_prompt
        else None,
        "corruption": corruption,
        "recompute_checks": checks,
        "rss_growth": _growth(samples, "rss_mib"),
        "thread_growth": _growth(samples, "threads"),
        "rss_by_phase_end": rss_by_phase_end(samples),
        "prefill_rss_by_phase_end": rss_by_phase_end(samples, "prefill_rss_by_proc"),
    }
    if cfg.pd:
        pb = events.get("prefill_back")
        doc.update(
            pd_reads_back_after_s=_grows_after(samples, pb, "p2p_tokens"),
            pd_recovery_bound_s=pd_recovery_bound_s(cfg, turn_s),
            prefill_restart_s=(pb - burst["killed_at"]) if pb is not None and burst else None,
            prefill_rss_growth=_growth(samples, "prefill_rss_mib"),
            prefill_thread_growth=_growth(samples, "prefill_threads"),
            prefill_rss_mib_max=max(
                (s["prefill_rss_mib"] for s in samples if s.get("prefill_rss_mib")), default=None
            ),
            rss_mib_max=max((s["rss_mib"] for s in samples if "rss_mib" in s), default=None),
            burst=burst or {},
        )
    doc.update(
        left_processes=left_procs,
        left_dirs=left_dirs,
        samples=samples,
        counters=counters,
        failure_examples=[
            r for r in records if not r.get("ok") and not prefill_down(cfg, r, events, end_t)
        ][:5],
        records=records,
    )
    return doc


def _grows_after(samples: list[dict], t: float | None, key: str) -> float | None:
    """Seconds from ``t`` until a sample shows ``key`` above its last value at ``t`` (None: never)."""
    if t is None:
        return None
    valid = [s for s in samples if key in s and s[key] == s[key]]  # not NaN
    before = [s[key] for s in valid if s["t"] <= t]
    base = before[-1] if before else 0.0
    return next((s["t"] - t for s in valid if s["t"] > t and s[key] > base), None)


def _f(x, spec: str = ".1f") -> str:  # noqa: ANN001
    return "n/a" if x is None else format(x, spec)


def table(doc: dict) -> str:
    """``soak.md`` (``soak_pd.md``): the per-phase table and the run's targets."""
    c = doc["config"]
    pd = c.get("pd", False)
    lines = [
        "| phase | requests | failures | TTFT p50 ms | TTFT p99 ms | hit rate | max latency s "
        "| over bound | store failed loads | corrupt refused | sampled / differ from recompute |"
        + (" prefill down (502) | proxy decode-only | peer tokens (P/D READs) |" if pd else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if pd else ""),
    ]
    for r in doc["phases"]:
        lines.append(
            f"| {r['phase']} | {r['requests']} | {r['failures']} | {_f(r['ttft_p50_ms'])} "
            f"| {_f(r['ttft_p99_ms'])} | {_f(r['hit_rate'], '.3f')} | {_f(r['max_latency_s'], '.2f')} "
            f"| {r['over_bound']} "
            f"| {_f(r['failed_loads'], '.0f')} | {_f(r['corrupt_refused'], '.0f')} "
            f"| {r['sampled']} / {r['differ']} |"
            + (
                f" {r['prefill_down']} | {_f(r.get('decode_only'), '.0f')} | {_f(r['p2p_tokens'], '.0f')} |"
                if pd
                else ""
            )
        )
    rss, thr = doc["rss_growth"], doc["thread_growth"]
    pct = lambda x: _f(None if x is None else 100 * x)  # noqa: E731
    lines += [
        "",
        f"{c['sessions']} sessions, phases {c['phase_s']:g} s (SIGSTOP {c['stop_s']:g} s), "
        f"{c['turns']} turns x {c['cycle']} trajectories each, tiny {c['kind']}, "
        f"timeout_s {c['timeout_s']:g}, {c['num_gpu_blocks']} local KV blocks"
        + (" on each instance" if pd else "")
        + (f"; faults {', '.join(c['faults'])}" if c.get("faults") else "")
        + (
            f"; store connector extra {json.dumps(c['store_extra'])}"
            if c.get("store_extra")
            else ""
        )
        + (f"; PLANTED: {', '.join(c['plant'])}" if c["plant"] else ""),
    ]
    if pd:
        lines.append(
            f"P/D + store: hybridkv proxy -> prefill MultiConnector(HybridPDConnector, HybridStoreConnector), "
            f"decode MultiConnector({c['pd_decode_order'].replace('pd', 'HybridPDConnector').replace('store', 'HybridStoreConnector')}), "
            f"one mooncake_master; P/D read_timeout_s {c['pd_read_timeout_s']:g}, "
            f"handshake_timeout_s {c['pd_handshake_timeout_s']:g}, lease_s {c['pd_lease_s']:g}; "
            "hit rate = the prefill's (local + store), which the decode reports"
        )
    lines += [
        "over bound: turns longer than the slowest warm turn + 2 x timeout_s"
        + (" + P/D read + handshake timeouts" if pd else "")
        + f" ({_f(doc['turn_bound_s'])} s; target 0)"
    ]
    phases = {r["phase"] for r in doc["phases"]}
    if "corrupt" in phases:
        lines.append(
            f"corrupted in place: {doc['corruption'].get('planted', 0)} of "
            f"{doc['corruption'].get('present', 0)} stored objects"
        )
    if "kill" in phases:
        lines.append(
            f"store loads again {_f(doc['store_loads_back_after_s'])} s after the new master "
            f"(bound {_f(doc['recovery_bound_s'])} s, target <= 30); hit rate after recovery "
            f"{_f(doc['hit_rate_after_recovery'], '.3f')}"
        )
    if pd and "prefill-kill" in phases:
        b = doc.get("burst") or {}
        reads = b.get("decode_reads_after_kill") or {}
        lines += [
            f"prefill SIGKILL mid-READ: {b.get('handed_over', 0)} burst hand-overs "
            f"({c['pd_burst_tokens']} tokens each) posted to decode, "
            + (
                f"prefill frozen at once and SIGKILLed {_f(b.get('frozen_s'), '.2f')} s later, decode "
                f"having admitted {_f(b.get('reads_issued_at_kill'), '.0f')} P/D tokens (READs in flight) "
                f"meanwhile: {b.get('in_flight_at_kill', 0)} of them cut by the kill (no provenance line, a "
                "READ failure line in the decode log)"
                if "frozen_s" in b
                else f"prefill killed {OLD_KILL_AFTER_POST_S:g} s later: {b.get('in_flight_at_kill', 0)} of them "
                "not read when it died (no provenance line in the decode log)"
            )
            + "; decode log after the kill: "
            f"{reads.get('failed_or_discarded', 0)} READ failure/discard lines, "
            f"{reads.get('completed', 0)} completed READs",
            "decode over the whole run: log {completed} provenance lines, {failed_jobs} failed read jobs; "
            "/metrics (vllm:hybridkv_pd_*) ".format(
                **({"completed": 0, "failed_jobs": 0} | (b.get("decode_reads_total") or {}))
            )
            + ", ".join(f"{k} {v:.0f}" for k, v in (b.get("decode_pd_metrics") or {}).items()),
            f"prefill healthy again {_f(doc.get('prefill_restart_s'))} s after the kill; P/D READs land again "
            f"{_f(doc.get('pd_reads_back_after_s'))} s after that (bound {_f(doc.get('pd_recovery_bound_s'))} s; "
            'decode\'s vllm:prompt_tokens_cached_by_source{source="p2p"} grows)',
        ]
    lines += [
        "recovery after each fault ended (store loads again / first turn cached >= half the warm hit rate): "
        + "; ".join(
            f"{k} {_f(v['loads_back_s'])} / {_f(v['hit_back_s'])} s"
            for k, v in doc.get("recovery", {}).items()
        )
    ]
    if pd:
        lines.append(
            f"decode RSS growth {pct(rss)} %, threads {pct(thr)} %; prefill (a new process after its "
            f"restart: last vs warm) RSS {pct(doc.get('prefill_rss_growth'))} %, threads "
            f"{pct(doc.get('prefill_thread_growth'))} % (target < 5 %); max RSS decode "
            f"{_f(doc.get('rss_mib_max'), '.0f')} MiB, prefill {_f(doc.get('prefill_rss_mib_max'), '.0f')} MiB"
        )
    else:
        lines.append(f"RSS growth {pct(rss)} %, threads {pct(thr)} % (target < 5 %)")
    for key, who in (
        ("rss_by_phase_end", "decode" if pd else "server"),
        ("prefill_rss_by_phase_end", "prefill"),
    ):
        for phase_name, procs in (doc.get(key) or {}).items():
            lines.append(
                f"{who} RSS MiB at the end of {phase_name}: "
                + ", ".join(f"{n} {v:.0f}" for n, v in procs.items())
            )
    lines.append(
        f"left after shutdown: processes {doc['left_processes'] or 'none'}, dirs {doc['left_dirs'] or 'none'}"
    )
    if doc.get("cpu_samples"):
        lines.append(
            f"stalls (>= 10 s with no answered turn; CPU from /proc, cli/harness/stall_cpu.py): "
            f"{len(doc.get('stalls') or [])}"
        )
        lines += describe(doc.get("stalls") or [])
    return "\n".join(lines) + "\n"


def _rounded(x):  # noqa: ANN001, ANN202 - json-able values
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def dumps(doc: dict) -> str:
    """The document as json (floats to 4 decimals), each item of a long list (records,
    samples, checks) on one line."""
    doc = _rounded(doc)
    parts = []
    for key, value in doc.items():
        if isinstance(value, list) and len(value) > 20:
            body = ",\n  ".join(json.dumps(v, default=str) for v in value)
            parts.append(f"{json.dumps(key)}: [\n  {body}\n ]")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value, default=str)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


def write_results(doc: dict, records: list[dict], out: pathlib.Path) -> None:
    """``soak.{json,md,png}`` (``soak_pd.*`` for a --pd run) under ``out``."""
    stem = "soak_pd" if doc["config"].get("pd") else "soak"
    (out / f"{stem}.json").write_text(dumps(doc))
    text = table(doc)
    (out / f"{stem}.md").write_text(text)
    print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        good = [r for r in records if r.get("ok")]
        ax[0].scatter([r["t"] for r in good], [r["ttft_ms"] for r in good], s=4)
        ax[0].set_ylabel("TTFT ms")
        ax[1].scatter([r["t"] for r in good], [r["cached"] / r["prompt"] for r in good], s=4)
        ax[1].set_ylabel("cached / prompt")
        pd = doc["config"].get("pd")
        ax[2].plot(
            [s["t"] for s in doc["samples"]],
            [s["rss_mib"] for s in doc["samples"]],
            label="decode" if pd else None,
        )
        if pd:
            ax[2].plot(
                [s["t"] for s in doc["samples"] if s.get("prefill_rss_mib")],
                [s["prefill_rss_mib"] for s in doc["samples"] if s.get("prefill_rss_mib")],
                label="prefill",
            )
            ax[2].legend(fontsize=7)
            ax1b = ax[1].twinx()
            ax1b.plot(
                [s["t"] for s in doc["samples"]],
                [s.get("p2p_tokens", 0) for s in doc["samples"]],
                color="green",
                lw=0.8,
            )
            ax1b.set_ylabel("decode p2p tokens", color="green")
        ax[2].set_ylabel("RSS MiB")
        ax[2].set_xlabel("s")
        for a in ax:
            for name, t in doc["events"].items():
                a.axvline(t, color="red", lw=0.6)
        for name, t in doc["events"].items():
            ax[0].text(
                t,
                1.0,
                " " + name,
                rotation=90,
                va="top",
                fontsize=7,
                transform=ax[0].get_xaxis_transform(),
            )
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=100)
    except Exception as e:  # noqa: BLE001 - the table is the result; the plot is a bonus
        print(f"plot skipped: {e}", file=sys.stderr)


def render(json_path: pathlib.Path, out: pathlib.Path) -> dict:
    """Re-render ``soak.md`` / ``soak.png`` (and the summary) from a run's ``soak.json``."""
    d = json.loads(json_path.read_text())
    doc = summarize(
        SoakConfig(**d["config"]),
        d["records"],
        d["samples"],
        d["events"],
        d["counters"],
        d["recompute_checks"],
        d["corruption"],
        d["left_processes"],
        d["left_dirs"],
        d.get("burst"),
    )
    doc["wall_s"] = d.get("wall_s")
    doc["cpu_samples"] = d.get("cpu_samples", [])
    doc["stalls"] = stalls(d["records"], doc["cpu_samples"])
    write_results(doc, doc["records"], out)
    return doc


SOAK_STORE_KEYS = (
    "master_address",
    "global_segment_size",
    "timeout_s",
    "lookup_timeout_s",
    "key_log_path",
)


def store_extra(items: list[str]) -> dict:
    """``KEY=JSON`` items (a bare word that is not JSON is taken as a string) as one dict."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(
                f"--store-extra {item!r}: expected KEY=VALUE, e.g. malloc_trim_interval_s=10"
            )
        if key in SOAK_STORE_KEYS:  # the soak's own bounds and summary rest on these
            raise SystemExit(
                f"--store-extra {key}: set by the soak itself (use --timeout-s for timeout_s)"
            )
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def main(
    argv: list[str] | None = None, results: pathlib.Path = pathlib.Path("bench/results")
) -> int:
    """The soak's command line (bench/soak.py); ``results`` is ``--out``'s default."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = SoakConfig()
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--phase-s", type=float, default=d.phase_s)
    p.add_argument("--stop-s", type=float, default=d.stop_s)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks)
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="the connector's timeout_s")
    p.add_argument("--kind", default=d.kind)
    p.add_argument(
        "--cycle", type=int, default=d.cycle, help="trajectories per session, run in turn"
    )
    p.add_argument("--corrupt-fraction", type=float, default=d.corrupt_fraction)
    p.add_argument(
        "--samples",
        type=int,
        default=d.samples,
        help="sampled turns per phase vs a salted recompute",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="P/D + store: the sessions through PDStack's proxy (prefill + decode, MultiConnector "
        "HybridPDConnector + HybridStoreConnector), faults + 'prefill SIGKILL mid-READ'; "
        "writes soak_pd.*",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        choices=PD_FAULTS,
        dest="faults",
        help="run only these faults (repeatable; default all of the mode's)",
    )
    p.add_argument("--pd-decode-order", default=d.pd_decode_order, choices=["pd,store", "store,pd"])
    p.add_argument("--pd-burst", type=int, default=d.pd_burst)
    p.add_argument(
        "--think-s",
        type=float,
        default=d.think_s,
        help="a session's pause between an answer and its next turn (default 0: back to back)",
    )
    p.add_argument(
        "--plant",
        action="append",
        default=[],
        choices=PLANTS,
        help="a planted fault (shows a check can fail; never for results)",
    )
    p.add_argument(
        "--store-extra",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="added to the store connector's kv_connector_extra_config (repeatable), "
        "e.g. malloc_trim_interval_s=10",
    )
    p.add_argument(
        "--out",
        default=str(results),
        help="writes soak.{json,md,png} (--pd: soak_pd.*) here",
    )
    p.add_argument(
        "--keep-log",
        action="store_true",
        help="copy the server's log to OUT/soak.vllm.log (--pd: OUT/soak_pd.<server>.log)",
    )
    p.add_argument(
        "--render",
        metavar="SOAK_JSON",
        help="no run: re-render OUT/soak.{md,png} (soak_pd.* for a --pd run) from its json",
    )
    args = p.parse_args(argv)
    if args.render:
        render(pathlib.Path(args.render), pathlib.Path(args.out))
        return 0
    cfg = SoakConfig(
        sessions=args.sessions,
        phase_s=args.phase_s,
        stop_s=args.stop_s,
        turns=args.turns,
        max_tokens=args.max_tokens,
        num_gpu_blocks=args.num_gpu_blocks,
        timeout_s=args.timeout_s,
        kind=args.kind,
        cycle=args.cycle,
        corrupt_fraction=args.corrupt_fraction,
        samples=args.samples,
        plant=list(args.plant),
        faults=list(args.faults),
        pd=args.pd,
        pd_decode_order=args.pd_decode_order,
        pd_burst=args.pd_burst,
        think_s=args.think_s,
        store_extra=store_extra(args.store_extra),
    )
    run_soak(cfg, pathlib.Path(args.out), keep_log=args.keep_log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
