"""Soak with chaos: the agentic demo workload against a store server while the store fails.

    flock /tmp/hybridkv-engine.lock .venv/bin/python bench/soak.py [--sessions 16] [--phase-s 60]
        [--out bench/results/soak]

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
prompt + answer + a new chunk) run concurrently, one request at a time each, with a small local
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

``--plant`` (for showing that the CI checks can fail, never for results): ``no-restart`` (the
master is not restarted after the SIGKILL), ``leak-master`` (the restarted master is not stopped
at shutdown), ``sealed-corruption`` (the misplaced objects are re-sealed under the victim's key,
so the trailer check passes: a verification hole), ``policy-fail`` (kv_load_failure_policy
"fail" instead of "recompute").
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("GLOG_minloglevel", "2")

PHASES = ("warm", "stop", "after-stop", "corrupt", "after-corrupt", "node-kill", "after-node-kill",
          "kill", "after-kill")
PLANTS = ("no-restart", "leak-master", "sealed-corruption", "policy-fail")
# Phases whose loads may meet wrong bytes (misplaced objects, a dead node's objects): sampled
# DATA_FAULT_SAMPLES x more, since only the turns that loaded a faulted object can show it.
DATA_FAULT_PHASES = ("corrupt", "after-corrupt", "node-kill", "after-node-kill")
DATA_FAULT_SAMPLES = 3
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


def retry_after_s() -> float:
    """The client's circuit (MASTER_UNREACHABLE) period: MooncakeBackend's default, which the
    connector's shared client uses."""
    from hybridkv.store.mooncake_backend import MooncakeBackend

    return float(inspect.signature(MooncakeBackend.__init__).parameters["retry_after_s"].default)


def recovery_bound_s(cfg: SoakConfig, turn_s: float) -> float:
    """Longest the store may take to serve loads again after the new master has started.

    ``turn_s``: the longest turn of the healthy (warm) phase. The chain, each term a bound:
    a call issued on the dead master returns (``DEAD_MASTER_CALL_S``; abandoned after
    ``timeout_s``, it still refuses data calls until it returns) + the client's circuit
    (``retry_after_s``) + reconnect (``RECONNECT_S``) + the epoch monitor notices the empty
    master and the scheduler drops its recently-saved keys (``EPOCH_CHECK_S`` + its check's
    bound ``min(timeout_s, 1)``) + one turn that saves a session's prefix and the next turn
    that loads it (2 x ``turn_s``) + the sampler's period (``SAMPLE_S``)::

        bound = 4.5 + retry_after_s + 1.0 + EPOCH_CHECK_S + min(timeout_s, 1) + 2 turn_s + 2.0
    """
    from hybridkv.store.session import EPOCH_CHECK_S

    return (DEAD_MASTER_CALL_S + retry_after_s() + RECONNECT_S + EPOCH_CHECK_S + min(cfg.timeout_s, 1.0)
            + 2 * turn_s + SAMPLE_S)


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


def _counters(text: str | None) -> dict[str, float]:
    """The store counters the table reports per phase (deltas between phase starts)."""
    return {
        "loaded_blocks": metric_sum(text, "vllm:hybridkv_store_loaded_blocks_total"),
        "failed_loads": metric_sum(text, "vllm:hybridkv_store_failed_loads_total"),
        "corrupt_refused": metric_sum(text, "vllm:hybridkv_store_failures_total", cause="load_corrupt_object"),
        "store_failures": metric_sum(text, "vllm:hybridkv_store_failures_total"),
    }


def corrupt_objects(address: str, key_log: pathlib.Path, fraction: float, rng: random.Random,
                    sealed: bool = False) -> dict[str, int]:
    """Overwrite ``fraction`` of the stored objects with another stored object of their group.

    The plausible corruption of tests/e2e/test_store_sharing_and_faults.py ("another key's
    object"): the source's real bytes, trailer included, under the victim's key, through the
    real Mooncake client (upsert). Present objects are those the key log lists that the master
    still holds. ``sealed`` (a plant): re-seal the source's payload under the victim's key, so
    the trailer check passes and only the output comparison can tell.
    """
    from hybridkv.store.mooncake_backend import MooncakeBackend
    from hybridkv.store.object_trailer import TRAILER_BYTES, seal

    by_group: dict[tuple[str, str], dict[str, None]] = {}
    for line in key_log.read_text().splitlines() if key_log.exists() else []:
        parts = line.split()
        if len(parts) == 3:
            by_group.setdefault((parts[1], parts[2]), {})[parts[0]] = None
    present_n = planted = 0
    with MooncakeBackend(address, global_segment_size=0, timeout_s=5.0) as client:
        for keys in by_group.values():
            keys_l = list(keys)
            present = []
            for i in range(0, len(keys_l), 256):
                chunk = keys_l[i:i + 256]
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
                    data = seal(victim, data[:-TRAILER_BYTES])
                planted += client.replace_bytes(victim, data) == 0
    return {"present": present_n, "planted": planted}


def _start_node(address: str, segment: str) -> subprocess.Popen:
    from hybridkv.connector.store_config import parse_size

    node = subprocess.Popen([sys.executable, "-c", _NODE, address, str(parse_size("node_segment", segment))],
                            stdout=subprocess.PIPE, start_new_session=True)
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


def run_soak(cfg: SoakConfig, out: pathlib.Path, log=None, keep_log: bool = False) -> dict:  # noqa: ANN001, C901
    """Run the soak, write the results under ``out``; returns the json document.

    ``keep_log``: copy the server's log to ``out/soak.vllm.log`` (the temp dir holding it is removed)."""
    import psutil

    from hybridkv.cli.agentic_demo import DEFAULT_LOGPROB_TOL, Client, Trajectory, compare
    from hybridkv.cli.server import VllmServer
    from hybridkv.cli.tiny_models import write_tiny_model
    from hybridkv.store.embedded_master import EmbeddedMaster

    unknown = set(cfg.plant) - set(PLANTS)
    if unknown:
        raise ValueError(f"unknown plant(s) {sorted(unknown)}; known: {PLANTS}")

    def say(msg: str) -> None:
        print(msg, file=log or sys.stderr, flush=True)

    out.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    work = pathlib.Path(tempfile.mkdtemp(prefix="hybridkv-soak-"))
    key_log = work / "keys.log"
    model = str(write_tiny_model(cfg.kind, pathlib.Path.home() / ".cache" / "hybridkv" / "tiny-models"
                                 / f"{cfg.kind}-seed0", seed=0))
    master = EmbeddedMaster(default_kv_lease_ttl_ms=LEASE_TTL_MS)
    port = master.rpc_port
    master_dirs = [master.log_path.parent]  # each must be gone after shutdown
    masters = [master]
    node = _start_node(master.address, cfg.node_segment)
    policy = "fail" if "policy-fail" in cfg.plant else "recompute"
    kv = {"kv_connector": "HybridStoreConnector", "kv_connector_module_path": "hybridkv.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": policy,
          "kv_connector_extra_config": {"master_address": master.address, "global_segment_size": "512MiB",
                                        "timeout_s": cfg.timeout_s, "lookup_timeout_s": min(1.0, cfg.timeout_s),
                                        "key_log_path": str(key_log)}}
    srv = VllmServer(model, max_model_len=2048, kv_transfer_config=kv, log_path=work / "vllm.log",
                     extra_args=["--num-gpu-blocks-override", str(cfg.num_gpu_blocks), "--seed", "0",
                                 "--max-num-batched-tokens", "512", "--max-num-seqs", "8"])
    records: list[dict] = []
    completions: dict[int, tuple[str, object]] = {}  # record index -> (prompt, served Completion)
    samples: list[dict] = []
    events: dict[str, float] = {}
    counters: dict[str, dict[str, float]] = {}
    corruption: dict[str, int] = {}
    server_pids: dict[int, float] = {}  # every server process seen -> create time
    phase = {"name": "warm"}
    lock = threading.Lock()
    stop_all = threading.Event()
    rng = random.Random(f"soak-{cfg.seed}")
    t_start = time.monotonic()
    try:
        srv.start()
        t0 = time.monotonic()
        proc = psutil.Process(srv.proc.pid)
        srv_model = Client(srv.url).model_card()[0]
        probe = Client(srv.url, timeout_s=10)

        def session_loop(slot: int) -> None:
            client = Client(srv.url, timeout_s=120)
            gen, turn, prompt, answer = 0, 0, "", ""
            while not stop_all.is_set():
                traj = Trajectory(1000 * slot + gen % cfg.cycle + 100_000 * cfg.seed, cfg.first_tokens,
                                  cfg.growth_tokens)
                prompt = traj.prompt(turn, prompt, answer)
                start = time.monotonic()
                rec = {"t": start - t0, "phase": phase["name"], "slot": slot, "turn": turn}
                c = None
                try:
                    c = client.complete(srv_model, prompt, cfg.max_tokens)
                    ok = bool(c.token_ids)
                    rec.update(ok=ok, ttft_ms=c.ttft_s * 1e3, prompt=c.prompt_tokens, cached=c.cached_tokens or 0)
                    answer = c.text
                except Exception as e:  # noqa: BLE001 - counted as a failure
                    ok = False
                    rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
                rec["latency_s"] = time.monotonic() - start
                with lock:
                    records.append(rec)
                    if ok:
                        completions[len(records) - 1] = (prompt, c)
                if not ok or turn + 1 >= cfg.turns:
                    gen, turn, prompt, answer = gen + 1, 0, "", ""
                    if not ok:
                        time.sleep(1.0)
                else:
                    turn += 1

        def sampler() -> None:
            client = Client(srv.url, timeout_s=10)
            while not stop_all.wait(SAMPLE_S):
                try:
                    procs = [proc, *proc.children(recursive=True)]
                    for p_ in procs:
                        server_pids.setdefault(p_.pid, p_.create_time())
                    rss = sum(p_.memory_info().rss for p_ in procs if p_.is_running())
                    threads = sum(p_.num_threads() for p_ in procs if p_.is_running())
                except psutil.Error:
                    continue
                text = _metrics_text(client)
                samples.append({"t": time.monotonic() - t0, "phase": phase["name"], "rss_mib": rss / 2**20,
                                "threads": threads,
                                "loaded_blocks": metric_sum(text, "vllm:hybridkv_store_loaded_blocks_total")})

        def enter(name: str) -> None:
            counters[name] = _counters(_metrics_text(probe))
            phase["name"] = name
            events[name] = time.monotonic() - t0
            say(f"[{events[name]:7.1f} s] {name}")

        workers = [threading.Thread(target=session_loop, args=(i,), daemon=True) for i in range(cfg.sessions)]
        workers.append(threading.Thread(target=sampler, daemon=True))
        counters["warm"] = _counters(_metrics_text(probe))
        events["warm"] = 0.0
        for w in workers:
            w.start()
        time.sleep(cfg.phase_s)

        enter("stop")
        os.kill(master.pid, signal.SIGSTOP)
        time.sleep(cfg.stop_s)
        os.kill(master.pid, signal.SIGCONT)
        enter("after-stop")
        time.sleep(cfg.phase_s)

        enter("corrupt")
        corruption = corrupt_objects(master.address, key_log, cfg.corrupt_fraction, rng,
                                     sealed="sealed-corruption" in cfg.plant)
        say(f"  corrupted {corruption['planted']} of {corruption['present']} stored objects")
        enter("after-corrupt")
        time.sleep(cfg.phase_s)

        enter("node-kill")
        node.kill()
        node.wait()
        enter("after-node-kill")
        time.sleep(cfg.phase_s)

        enter("kill")
        master.kill()
        time.sleep(KILL_GAP_S)
        if "no-restart" not in cfg.plant:
            master = EmbeddedMaster(default_kv_lease_ttl_ms=LEASE_TTL_MS, rpc_port=port)
            masters.append(master)
            master_dirs.append(master.log_path.parent)
        events["master_back"] = time.monotonic() - t0
        enter("after-kill")
        time.sleep(cfg.phase_s)
        counters["end"] = _counters(_metrics_text(probe))
        stop_all.set()
        for w in workers:
            w.join(timeout=150)

        # Sampled turns vs a salted recompute (the sessions have stopped: the server is idle).
        picked: list[int] = []
        for name in PHASES:
            idx = [i for i, r in enumerate(records) if r["phase"] == name and r.get("ok") and r["cached"] > 0]
            n = cfg.samples * (DATA_FAULT_SAMPLES if name in DATA_FAULT_PHASES else 1)
            picked += sorted(rng.sample(idx, min(n, len(idx))))
        checks = []
        for i in picked:
            prompt, served = completions[i]
            try:
                salt = f"soak-recompute-{uuid.uuid4().hex}"
                ref = probe.complete(srv_model, prompt, cfg.max_tokens, cache_salt=salt)
                cmp = compare(served, ref, DEFAULT_LOGPROB_TOL)
                same = cmp.matches and not ref.cached_tokens
                why = cmp.why + (f"; recompute was not a miss ({ref.cached_tokens} cached)" if ref.cached_tokens
                                 else "")
            except Exception as e:  # noqa: BLE001 - a recompute that fails is a difference
                same, why = False, f"recompute failed: {type(e).__name__}: {str(e)[:200]}"
            records[i]["matches_recompute"] = same
            checks.append({"record": i, "phase": records[i]["phase"], "cached": records[i]["cached"],
                           "matches": same, "why": why})
    finally:
        stop_all.set()
        srv.stop()
        if node.poll() is None:
            node.kill()
            node.wait()
        for m in masters:
            if "leak-master" in cfg.plant and m is masters[-1] and len(masters) > 1:
                continue
            m.stop()
        if keep_log and (work / "vllm.log").exists():
            shutil.copy(work / "vllm.log", out / "soak.vllm.log")
        shutil.rmtree(work, ignore_errors=True)
    time.sleep(2.0)
    left_procs = sorted({pid for pid, created in server_pids.items() if _alive(pid, created)}
                        | _new_children(me, children_before)
                        | {p_.pid for p_ in psutil.process_iter(["cmdline"])
                           if any(f"--rpc_port={port}" in a for a in (p_.info["cmdline"] or []))})
    left_dirs = [str(d) for d in master_dirs if d.exists()]
    if work.exists():
        left_dirs.append(str(work))

    doc = summarize(cfg, records, samples, events, counters, checks, corruption, left_procs, left_dirs)
    doc["wall_s"] = time.monotonic() - t_start
    write_results(doc, records, out)
    return doc


def loads_back_after(samples: list[dict], t: float | None) -> float | None:
    """Seconds from ``t`` until a sample shows the store loaded blocks again (None: never)."""
    if t is None:
        return None
    valid = [s for s in samples if s["loaded_blocks"] == s["loaded_blocks"]]  # not NaN
    before = [s["loaded_blocks"] for s in valid if s["t"] <= t]
    base = before[-1] if before else 0.0
    return next((s["t"] - t for s in valid if s["t"] > t and s["loaded_blocks"] > base), None)


def summarize(cfg: SoakConfig, records: list[dict], samples: list[dict], events: dict[str, float],
              counters: dict[str, dict[str, float]], checks: list[dict], corruption: dict[str, int],
              left_procs: list[int], left_dirs: list[str]) -> dict:
    """The per-phase table and the run's targets as one json-able document."""
    back = events.get("master_back")
    recovered = loads_back_after(samples, back)
    order = [*PHASES, "end"]
    warm = [r for r in records if r["phase"] == "warm" and r.get("ok")]
    warm_hit = sum(r["cached"] for r in warm) / max(1, sum(r["prompt"] for r in warm))
    # Per fault, from the moment it ended: store loads again; the first turn (started after)
    # whose hit rate is at least half the warm phase's.
    ends = {"master SIGSTOP": events.get("after-stop"), "objects corrupted": events.get("after-corrupt"),
            "store node SIGKILL": events.get("after-node-kill"), "master SIGKILL": back}
    recovery = {name: {"loads_back_s": loads_back_after(samples, t),
                       "hit_back_s": next((r["t"] - t for r in sorted(records, key=lambda r: r["t"])
                                           if r["t"] >= t and r.get("ok") and r["prompt"]
                                           and r["cached"] / r["prompt"] >= warm_hit / 2), None)}
                for name, t in ends.items() if t is not None}
    turn_s = max((r["latency_s"] for r in warm), default=0.0)
    # A faulted turn may pay one lookup and one load timeout more than the slowest healthy turn.
    turn_bound = turn_s + 2 * cfg.timeout_s
    rows = []
    for k, name in enumerate(PHASES):
        rs = [r for r in records if r["phase"] == name]
        good = [r for r in rs if r.get("ok")]
        ttft = [r["ttft_ms"] for r in good]
        prompt = sum(r["prompt"] for r in good)
        c0, c1 = counters.get(name), counters.get(order[k + 1])
        delta = {key: (c1[key] - c0[key]) if c0 and c1 else None for key in (c0 or {})}
        sampled = [c for c in checks if c["phase"] == name]
        rows.append({"phase": name, "requests": len(rs), "failures": len(rs) - len(good),
                     "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99),
                     "hit_rate": sum(r["cached"] for r in good) / prompt if prompt else None,
                     "max_latency_s": max((r["latency_s"] for r in rs), default=None),
                     "over_bound": sum(r["latency_s"] > turn_bound for r in rs),
                     "failed_loads": delta.get("failed_loads"), "corrupt_refused": delta.get("corrupt_refused"),
                     "loaded_blocks": delta.get("loaded_blocks"),
                     "sampled": len(sampled), "differ": sum(not c["matches"] for c in sampled)})
    after = [r for r in records if r["phase"] == "after-kill" and r.get("ok") and recovered is not None
             and r["t"] >= back + recovered]
    after_prompt = sum(r["prompt"] for r in after)
    warm_s = [s for s in samples if s["phase"] == "warm"]
    rss_growth = (samples[-1]["rss_mib"] / statistics.mean(x["rss_mib"] for x in warm_s[-3:]) - 1) if warm_s else None
    thr_growth = (samples[-1]["threads"] / statistics.mean(x["threads"] for x in warm_s[-3:]) - 1) if warm_s else None
    return {"config": asdict(cfg), "phases": rows, "events": events, "store_loads_back_after_s": recovered,
            "recovery_bound_s": recovery_bound_s(cfg, turn_s), "warm_max_turn_s": turn_s,
            "turn_bound_s": turn_bound, "recovery": recovery, "warm_hit_rate": warm_hit,
            "hit_rate_after_recovery": sum(r["cached"] for r in after) / after_prompt if after_prompt else None,
            "corruption": corruption, "recompute_checks": checks,
            "rss_growth": rss_growth, "thread_growth": thr_growth, "left_processes": left_procs,
            "left_dirs": left_dirs, "samples": samples, "counters": counters,
            "failure_examples": [r for r in records if not r.get("ok")][:5], "records": records}


def _f(x, spec: str = ".1f") -> str:  # noqa: ANN001
    return "n/a" if x is None else format(x, spec)


def table(doc: dict) -> str:
    """``soak.md``: the per-phase table and the run's targets."""
    lines = ["| phase | requests | failures | TTFT p50 ms | TTFT p99 ms | hit rate | max latency s "
             "| over bound | store failed loads | corrupt refused | sampled / differ from recompute |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["phases"]:
        lines.append(f"| {r['phase']} | {r['requests']} | {r['failures']} | {_f(r['ttft_p50_ms'])} "
                     f"| {_f(r['ttft_p99_ms'])} | {_f(r['hit_rate'], '.3f')} | {_f(r['max_latency_s'], '.2f')} "
                     f"| {r['over_bound']} "
                     f"| {_f(r['failed_loads'], '.0f')} | {_f(r['corrupt_refused'], '.0f')} "
                     f"| {r['sampled']} / {r['differ']} |")
    c = doc["config"]
    rss, thr = doc["rss_growth"], doc["thread_growth"]
    lines += ["", f"{c['sessions']} sessions, phases {c['phase_s']:g} s (SIGSTOP {c['stop_s']:g} s), "
              f"{c['turns']} turns x {c['cycle']} trajectories each, tiny {c['kind']}, "
              f"timeout_s {c['timeout_s']:g}, {c['num_gpu_blocks']} local KV blocks"
              + (f"; PLANTED: {', '.join(c['plant'])}" if c["plant"] else ""),
              f"over bound: turns longer than the slowest warm turn + 2 x timeout_s "
              f"({_f(doc['turn_bound_s'])} s; target 0)",
              f"corrupted in place: {doc['corruption'].get('planted', 0)} of {doc['corruption'].get('present', 0)} "
              "stored objects",
              f"store loads again {_f(doc['store_loads_back_after_s'])} s after the new master "
              f"(bound {_f(doc['recovery_bound_s'])} s, target <= 30); hit rate after recovery "
              f"{_f(doc['hit_rate_after_recovery'], '.3f')}",
              "recovery after each fault ended (store loads again / first turn cached >= half the warm hit rate): "
              + "; ".join(f"{k} {_f(v['loads_back_s'])} / {_f(v['hit_back_s'])} s"
                          for k, v in doc.get("recovery", {}).items()),
              f"RSS growth {_f(None if rss is None else 100 * rss)} %, threads "
              f"{_f(None if thr is None else 100 * thr)} % (target < 5 %)",
              f"left after shutdown: processes {doc['left_processes'] or 'none'}, dirs {doc['left_dirs'] or 'none'}"]
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
    (out / "soak.json").write_text(dumps(doc))
    text = table(doc)
    (out / "soak.md").write_text(text)
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
        ax[2].plot([s["t"] for s in doc["samples"]], [s["rss_mib"] for s in doc["samples"]])
        ax[2].set_ylabel("RSS MiB")
        ax[2].set_xlabel("s")
        for a in ax:
            for name, t in doc["events"].items():
                a.axvline(t, color="red", lw=0.6)
        for name, t in doc["events"].items():
            ax[0].text(t, 1.0, " " + name, rotation=90, va="top", fontsize=7, transform=ax[0].get_xaxis_transform())
        fig.tight_layout()
        fig.savefig(out / "soak.png", dpi=100)
    except Exception as e:  # noqa: BLE001 - the table is the result; the plot is a bonus
        print(f"plot skipped: {e}", file=sys.stderr)


def render(json_path: pathlib.Path, out: pathlib.Path) -> dict:
    """Re-render ``soak.md`` / ``soak.png`` (and the summary) from a run's ``soak.json``."""
    d = json.loads(json_path.read_text())
    doc = summarize(SoakConfig(**d["config"]), d["records"], d["samples"], d["events"], d["counters"],
                    d["recompute_checks"], d["corruption"], d["left_processes"], d["left_dirs"])
    doc["wall_s"] = d.get("wall_s")
    write_results(doc, doc["records"], out)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--phase-s", type=float, default=d.phase_s)
    p.add_argument("--stop-s", type=float, default=d.stop_s)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks)
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="the connector's timeout_s")
    p.add_argument("--kind", default=d.kind)
    p.add_argument("--cycle", type=int, default=d.cycle, help="trajectories per session, run in turn")
    p.add_argument("--corrupt-fraction", type=float, default=d.corrupt_fraction)
    p.add_argument("--samples", type=int, default=d.samples, help="sampled turns per phase vs a salted recompute")
    p.add_argument("--plant", action="append", default=[], choices=PLANTS,
                   help="a planted fault (shows a check can fail; never for results)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="writes soak.{json,md,png} here")
    p.add_argument("--keep-log", action="store_true", help="copy the server's log to OUT/soak.vllm.log")
    p.add_argument("--render", metavar="SOAK_JSON", help="no run: re-render OUT/soak.{md,png} from a soak.json")
    args = p.parse_args(argv)
    if args.render:
        render(pathlib.Path(args.render), pathlib.Path(args.out))
        return 0
    cfg = SoakConfig(sessions=args.sessions, phase_s=args.phase_s, stop_s=args.stop_s, turns=args.turns,
                     max_tokens=args.max_tokens, num_gpu_blocks=args.num_gpu_blocks, timeout_s=args.timeout_s,
                     kind=args.kind, cycle=args.cycle, corrupt_fraction=args.corrupt_fraction,
                     samples=args.samples,
                     plant=list(args.plant))
    run_soak(cfg, pathlib.Path(args.out), keep_log=args.keep_log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
