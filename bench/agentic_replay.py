"""Multi-turn agentic replay at 1/2/4 concurrent users, connectors side by side.

    .venv/bin/python bench/agentic_replay.py [--duration 40] [--users 1,2,4]
        [--configs none,hybrid,mooncake,pd,pd-store] [--num-gpu-blocks 48] [--quick]

One command, real processes: vLLM OpenAI servers on the CPU engine (launched with
:class:`hybridkv.cli.server.VllmServer`), real ``mooncake_master`` processes
(:class:`hybridkv.store.embedded_master.EmbeddedMaster`), and for P/D the ``hybridkv proxy``.

Workload. A fixed set of ``--sessions`` agent sessions (default 6) is split evenly over the
users; each user is a client thread that serves its sessions round robin, one request at a
time (an agent juggling sub-tasks). The working set is thus the same at 1, 2 and 4 users and
larger than the small local KV cache. A session is the seeded
:class:`hybridkv.cli.agentic_demo.Trajectory` of the demo: turn k's prompt is turn k-1's prompt
+ the model's answer + a new tool-result / user chunk, for ``--turns`` turns, then the slot
starts a new session with the next seed. Seeds depend only on (level, session slot, generation),
so every config replays the same trajectories; levels use disjoint seeds, so nothing a level
saved can serve the next one. Requests are the demo's streamed greedy ``/v1/completions``
calls (:class:`hybridkv.cli.agentic_demo.Client`): TTFT is measured at the first streamed
token, cached tokens come from ``usage.prompt_tokens_details``.

Every engine gets the same small local KV cache (``--num-gpu-blocks-override``): with the
round robin over sessions a session's previous turn is normally evicted locally before the
session comes back, so reuse must come from the connector's store (the per-level split of
hits into local and external tokens, from each engine's ``/metrics``, shows how far that holds).

Per level (config, users): the users run for ``--duration`` seconds (no new request after it;
running ones finish); then a sample of hit turns (``--check-sample``) is re-sent with a fresh
``cache_salt`` (so it can hit nothing anywhere) to the engine that decoded it, and greedy tokens
+ top-5 logprobs are compared with :func:`hybridkv.cli.agentic_demo.compare` (the demo's
near-tie-aware check).

Configs: ``none`` (no connector), ``hybrid`` (HybridStoreConnector on its own master),
``mooncake`` (vLLM's in-tree MooncakeStoreConnector on its own master, MOONCAKE_CONFIG_PATH,
``save_decode_cache`` on like hybridkv's ``save_decode``), ``pd`` (HybridPDConnector producer +
consumer behind the hybridkv proxy), ``pd-store`` (the same with HybridStoreConnector added to
both engines through MultiConnector, one master). For P/D, ``usage.cached_tokens`` of a
request is the prefill engine's hit (vLLM copies ``remote_prefill_cached_tokens``), i.e. prompt
tokens prefill did not compute.

The single-engine configs are up together and their levels interleaved (order rotated per
level), so a change of a shared machine's load hits all of them; each P/D config runs alone. A
config whose server is found dead between levels is redeployed and the level rerun once.

Writes ``bench/results/agentic_replay.{md,json,png}`` (``--out-dir``) after every level (a
killed run keeps what it measured; SIGTERM stops the servers and masters it started) and
prints the table at the end.

Geometries: ``--models gemma4,gemma3-eagle,qwen3next-pmu64`` runs the single-engine
configs (default none, hybrid, mooncake) on each named model of :data:`MODELS` in turn, one
model's engines at a time: the tiny seeded-random-weight models of ``cli/harness/tiny_models.py`` whose
KV-cache layouts are what hybridkv exists for (two dense groups at different block sizes; a
target + EAGLE drafter at another block size; Mamba + full attention with sub-block
``--prefix-match-unit 64`` hits). ``NAME:BLOCKS`` sets that model's
``--num-gpu-blocks-override`` (a local cache small enough that local hits diverge between
configs). A config that refuses to start on a model (e.g. an unsupported geometry) is recorded
as that cell's result with its error line. Every sampled output that differs from its recompute
is recorded with its failing input (model, session seed, turn), and every turn where in-tree
got fewer cached tokens than hybridkv on the same prompt is listed (users 1 replays the same
request sequence on every config). Writes ``agentic_replay_geometries.{md,json,png}``
(``--out-stem``). Without ``--models`` the bench is what it was (``--kind``/``--model``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import pathlib
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")  # IB module crashes CPU hosts at exit (see pd_worker)

REPO = pathlib.Path(__file__).resolve().parents[1]

from hybridkv.cli.agentic_demo import (  # noqa: E402
    DEFAULT_LOGPROB_TOL,
    METRIC_LOCAL_HITS,
    METRIC_LOCAL_QUERIES,
    METRIC_STORE_HITS,
    METRIC_STORE_QUERIES,
    Client,
    Completion,
    Progress,
    Trajectory,
    compare,
    counter,
)
from hybridkv.cli.pd_stack import disjoint_core_envs  # noqa: E402
from hybridkv.cli.server import HOST, VllmServer, free_port  # noqa: E402
from hybridkv.connector.pd_auth import SECRET_ENV, SECRET_FILE_ENV, write_secret_file  # noqa: E402

ALL_CONFIGS = ("none", "hybrid", "mooncake", "pd", "pd-store")
LABELS = {
    "none": "no connector",
    "hybrid": "HybridStoreConnector",
    "mooncake": "MooncakeStoreConnector (in-tree)",
    "pd": "P/D: HybridPDConnector + proxy",
    "pd-store": "P/D + store (MultiConnector)",
}
SEGMENT = "512MiB"  # store memory per engine, the same for both store connectors


@dataclass(frozen=True)
class ModelSpec:
    """One model of the geometries run: a tiny kind, an optional drafter, extra engine args."""

    name: str
    kind: str
    geometry: str  # the KV-cache layout, in words (what the row is about)
    drafter: str | None = None  # a cli/harness/tiny_models DRAFTER_KINDS kind, served as EAGLE
    engine_args: tuple[str, ...] = ()
    num_gpu_blocks: int | None = None  # None: --num-gpu-blocks


NUM_SPECULATIVE_TOKENS = 2  # as tests/e2e/test_store_eagle.py
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "gemma3", "gemma3", "sliding (bs 128) + full attention (bs 128): one dense group"
        ),
        ModelSpec(
            "gemma4",
            "gemma4",
            "sliding (bs 256) + full attention bs 128 (head 128) + full attention "
            "bs 256 (head 64): two dense groups at different block sizes",
        ),
        ModelSpec(
            "gemma3-eagle",
            "gemma3",
            "gemma3 sliding + full (bs 256) + EAGLE drafter full attention (bs 128, head 128)",
            drafter="eagle-gemma3",
        ),
        ModelSpec(
            "qwen3next-pmu64",
            "qwen3next",
            "Gated-DeltaNet (Mamba align) + full attention, bs 256, "
            "--prefix-match-unit 64 (sub-block hits)",
            engine_args=("--block-size", "256", "--prefix-match-unit", "64"),
        ),
    )
}


def parse_models(value: str) -> list[ModelSpec]:
    """``NAME[:BLOCKS],...`` -> specs (BLOCKS: that model's --num-gpu-blocks-override)."""
    out = []
    for item in (x.strip() for x in value.split(",")):
        if not item:
            continue
        name, _, blocks = item.partition(":")
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
        spec = MODELS[name]
        if blocks:
            from dataclasses import replace

            spec = replace(spec, num_gpu_blocks=int(blocks))
        out.append(spec)
    return out


# ------------------------------------------------------------------------ deployments


@dataclass
class Deployment:
    """What a level talks to: the front door, where recomputes go, engines to read metrics from."""

    name: str
    url: str
    check_url: str
    engines: dict[str, str]  # role -> engine URL ("engine", or "prefill"/"decode")
    hit_engine: str  # the engine whose prefix cache the hit rate is about
    commands: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)


class Bench:
    def __init__(self, args: argparse.Namespace, spec: ModelSpec | None = None) -> None:
        self.args = args
        self.spec = spec  # None: the single --kind/--model of the original bench
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="hybridkv-agentic-replay-"))
        self.model = self._model()
        self.drafter = self._tiny(spec.drafter) if spec and spec.drafter else None
        self.num_gpu_blocks = (
            spec.num_gpu_blocks if spec and spec.num_gpu_blocks else args.num_gpu_blocks
        )

    # -- model
    @staticmethod
    def _tiny(kind: str) -> str:
        from hybridkv.cli.harness.tiny_models import write_tiny_model

        base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
        return str(
            write_tiny_model(kind, base / "hybridkv" / "tiny-models" / f"{kind}-seed0", seed=0)
        )

    def _model(self) -> str:
        if self.spec is not None:
            return self._tiny(self.spec.kind)
        if self.args.model:
            return self.args.model
        return self._tiny(self.args.kind)

    def model_summary(self) -> dict:
        path = pathlib.Path(self.model)
        cfg = json.loads((path / "config.json").read_text())
        info = {
            "path": str(path),
            "architecture": cfg.get("architectures", ["?"])[0],
            "hidden_size": cfg.get("hidden_size"),
            "layers": cfg.get("num_hidden_layers"),
            "layer_types": cfg.get("layer_types"),
            "sliding_window": cfg.get("sliding_window"),
        }
        st = path / "model.safetensors"
        if st.is_file():
            from safetensors import safe_open

            with safe_open(str(st), "pt") as f:
                n = 0
                for k in f.keys():
                    shape = f.get_slice(k).get_shape()
                    n += math.prod(shape)
            info["parameters"] = n
            info["safetensors_mib"] = round(st.stat().st_size / 2**20, 1)
        if self.spec is not None:
            info.update(
                name=self.spec.name,
                kind=self.spec.kind,
                geometry=self.spec.geometry,
                drafter=self.drafter,
                engine_args=list(self.spec.engine_args),
                num_gpu_blocks=self.num_gpu_blocks,
            )
        return info

    # -- servers
    def _server(self, tag: str, kv: dict | None, env: dict | None = None) -> VllmServer:
        extra = [
            "--num-gpu-blocks-override",
            str(self.num_gpu_blocks),
            "--max-num-batched-tokens",
            str(self.args.max_num_batched_tokens),
            "--max-num-seqs",
            str(self.args.max_num_seqs),
            "--seed",
            "0",
        ]
        if self.spec is not None:
            extra += list(self.spec.engine_args)
        if self.drafter:
            extra += [
                "--speculative-config",
                json.dumps(
                    {
                        "method": "eagle",
                        "model": self.drafter,
                        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                    }
                ),
            ]
        return VllmServer(
            self.model,
            max_model_len=self.args.max_model_len,
            kv_transfer_config=kv,
            extra_args=extra,
            log_path=self.workdir / f"vllm-{tag}.log",
            startup_timeout_s=self.args.startup_timeout,
            env=env,
        )

    @staticmethod
    def _start_all(servers: list[VllmServer]) -> None:
        """Start servers concurrently (two CPU engines boot in about the time of one and a half)."""
        errors: list[BaseException] = []

        def go(s: VllmServer) -> None:
            try:
                s.start()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=go, args=(s,)) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            for s in servers:
                s.stop()
            raise errors[0]

    def _store_child(self, master: str) -> dict:
        return {
            "kv_connector": "HybridStoreConnector",
            "kv_connector_module_path": "hybridkv.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master_address": master, "global_segment_size": SEGMENT},
        }

    @contextlib.contextmanager
    def deploy(self, name: str):
        with contextlib.ExitStack() as stack:
            master = None
            if name in ("hybrid", "mooncake", "pd-store"):
                master = EmbeddedMasterCM(self.workdir / f"master-{name}", self.args.lease_ttl_ms)
                stack.enter_context(master)
            if name in ("none", "hybrid", "mooncake"):
                env = None
                if name == "none":
                    kv = None
                elif name == "hybrid":
                    kv = self._store_child(master.address)
                else:
                    cfg_path = self.workdir / "mooncake_store.json"
                    cfg_path.write_text(
                        json.dumps(
                            {
                                "metadata_server": "P2PHANDSHAKE",
                                "master_server_address": master.address,
                                "protocol": "tcp",
                                "device_name": "",
                                "mode": "embedded",
                                "global_segment_size": "512MB",
                                "local_buffer_size": self.args.mooncake_local_buffer,
                            },
                            indent=2,
                        )
                    )
                    env = {"MOONCAKE_CONFIG_PATH": str(cfg_path)}
                    kv = {
                        "kv_connector": "MooncakeStoreConnector",
                        "kv_role": "kv_both",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"save_decode_cache": True},
                    }
                srv = self._server(name, kv, env)
                self._start_all([srv])
                stack.callback(srv.stop)
                yield Deployment(
                    name,
                    srv.url,
                    srv.url,
                    {"engine": srv.url},
                    "engine",
                    [shlex.join(srv.command())],
                    [str(srv.log_path)],
                )
                return
            # P/D: prefill + decode engines, then the proxy in front.
            if name == "pd":
                pre_kv = {
                    "kv_connector": "HybridPDConnector",
                    "kv_connector_module_path": "hybridkv.connector",
                    "kv_role": "kv_producer",
                }
                dec_kv = {
                    "kv_connector": "HybridPDConnector",
                    "kv_connector_module_path": "hybridkv.connector",
                    "kv_role": "kv_consumer",
                    "kv_load_failure_policy": "recompute",
                }
            else:  # pd-store: as tests/e2e/test_pd_store_multiconnector.py (store first on decode)
                pd_child = {
                    "kv_connector": "HybridPDConnector",
                    "kv_connector_module_path": "hybridkv.connector",
                }
                pre_kv = {
                    "kv_connector": "MultiConnector",
                    "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {
                        "connectors": [
                            {**pd_child, "kv_role": "kv_producer"},
                            self._store_child(master.address),
                        ]
                    },
                }
                dec_kv = {
                    "kv_connector": "MultiConnector",
                    "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {
                        "connectors": [
                            self._store_child(master.address),
                            {**pd_child, "kv_role": "kv_both"},
                        ]
                    },
                }
            # Disjoint cores, as PDStack does: on shared cores the two engines starve each other.
            pre_env, dec_env = disjoint_core_envs()
            # The pair's deployment secret (signs kv_transfer_params and the P/D side channel;
            # without one HybridPDConnector refuses to start), fresh per run, as PDStack does.
            if not os.environ.get(SECRET_ENV) and not os.environ.get(SECRET_FILE_ENV):
                secret = write_secret_file(self.workdir / f"{name}-pd-secret")
                for e in (pre_env, dec_env):
                    e[SECRET_FILE_ENV] = str(secret)
            pre = self._server(f"{name}-prefill", pre_kv, pre_env)
            dec = self._server(f"{name}-decode", dec_kv, dec_env)
            self._start_all([pre, dec])
            stack.callback(pre.stop)
            stack.callback(dec.stop)
            proxy = stack.enter_context(
                ProxyCM(pre.url, dec.url, self.workdir / f"proxy-{name}.log")
            )
            yield Deployment(
                name,
                proxy.url,
                dec.url,
                {"prefill": pre.url, "decode": dec.url},
                "prefill",
                [shlex.join(pre.command()), shlex.join(dec.command()), shlex.join(proxy.cmd)],
                [str(pre.log_path), str(dec.log_path), str(proxy.log)],
            )


SINGLE_ENGINE = ("none", "hybrid", "mooncake")


def enter_concurrently(cms: dict, errors: dict[str, str], log=None) -> dict:  # noqa: ANN001
    """Enter each deployment's context manager in its own thread (engines boot in parallel).
    A deployment that fails to start lands in ``errors`` (and ``log``, which keeps the
    progress bar out of the line); the caller exits the others."""
    if log is None:

        def log(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)

    out: dict[str, tuple[Deployment, float]] = {}
    lock = threading.Lock()

    def enter(name: str, cm) -> None:
        t = time.monotonic()
        try:
            dep = cm.__enter__()
        except Exception as e:  # noqa: BLE001 - reported in the results
            with lock:
                errors[name] = f"{type(e).__name__}: {e}"[-3000:]
            log(f"{name}: FAILED to start: {str(e)[-1500:]}")
            return
        with lock:
            out[name] = (dep, time.monotonic() - t)

    threads = [threading.Thread(target=enter, args=item) for item in cms.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {n: out[n] for n in cms if n in out}


def healthy(dep: Deployment) -> bool:
    """Every engine (and the front door) answers /health within 20 s."""
    for url in {dep.url, *dep.engines.values()}:
        try:
            with urllib.request.urlopen(url + "/health", timeout=20) as r:
                if r.status != 200:
                    return False
        except (urllib.error.URLError, OSError):
            return False
    return True


class EmbeddedMasterCM:
    def __init__(self, log_dir: pathlib.Path, lease_ttl_ms: int) -> None:
        self.log_dir, self.lease_ttl_ms, self.m = log_dir, lease_ttl_ms, None

    def __enter__(self):
        from hybridkv.store.embedded_master import EmbeddedMaster

        self.m = EmbeddedMaster(
            default_kv_lease_ttl_ms=self.lease_ttl_ms, log_dir=str(self.log_dir)
        )
        return self

    @property
    def address(self) -> str:
        return self.m.address

    def __exit__(self, *exc) -> None:
        self.m.stop()


class ProxyCM:
    """``python -m hybridkv.cli.proxy`` as a child process, healthy when both engines are."""

    def __init__(self, prefill: str, decode: str, log: pathlib.Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = log
        self.cmd = [
            sys.executable,
            "-m",
            "hybridkv.cli.proxy",
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--host",
            HOST,
            "--port",
            str(self.port),
        ]
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"proxy exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        self.__exit__()
        raise RuntimeError("proxy not healthy after 60 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


# ------------------------------------------------------------------------ one level


@dataclass
class Record:
    user: int
    slot: int
    generation: int
    turn: int  # 0-based within its session
    t_start: float
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    latency_ms: float
    output_tokens: int
    prompt: str = field(repr=False, default="")
    completion: Completion | None = field(repr=False, default=None)
    seed: int = 0  # the session's Trajectory seed: with turn, the request's input
    local_hits: int | None = (
        None  # this request's local / external hit tokens (--per-request-split)
    )
    external_hits: int | None = None


@dataclass
class LevelResult:
    config: str
    users: int
    duration_s: float
    wall_s: float
    requests: int
    failures: int
    failure_examples: list[str]
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float | None
    hit_rate_turn2plus: float | None
    hit_turns: int
    later_turns: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p50_hit_ms: float | None
    ttft_p90_hit_ms: float | None
    ttft_p50_later_ms: float | None
    ttft_p50_miss_ms: float | None
    output_tokens: int
    output_tok_s: float
    engine_metrics: dict[str, dict[str, float]]
    checked: int
    differ: int
    near_ties: int
    identical_tokens: int
    check_errors: int
    check_notes: list[str]
    note: str = ""
    model: str = ""  # the --models name (empty without --models)
    # Sampled turns that differ from their recompute: the failing inputs (session seed, turn).
    failing_inputs: list[dict] = field(default_factory=list)
    # Every request in order (seed, 1-based turn, prompt and cached tokens, TTFT): lets a
    # report compare the same turn across configs.
    turns: list[dict] = field(default_factory=list)
    # Each sampled turn: its input, its hit split (when known) and whether it matched.
    checked_turns: list[dict] = field(default_factory=list)


def _seed(level: int, slot: int, generation: int) -> int:
    return (level * 1000 + slot) * 100_000 + generation


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _metrics(url: str) -> dict[str, float]:
    """``/metrics``: vLLM's counters summed over label sets, plus the store connectors' own
    counters (``vllm:hybridkv_store_*``, ``vllm:mooncake_store_*``) kept per label set."""
    try:
        r = Client(url).http.get(url + "/metrics", timeout=30)
        r.raise_for_status()
    except Exception:  # noqa: BLE001 - a missing snapshot reads as zero deltas
        return {}
    from hybridkv.cli.agentic_demo import parse_prometheus

    out = parse_prometheus(r.text)
    for line in r.text.splitlines():
        if (
            line.startswith(("vllm:hybridkv_store_", "vllm:mooncake_store_"))
            and "_bucket" not in line
        ):
            key, _, value = line.rpartition(" ")
            key = _drop_engine_labels(key)
            try:
                out["store|" + key] = out.get("store|" + key, 0.0) + float(value)
            except ValueError:
                pass
    return out


def _drop_engine_labels(key: str) -> str:
    if "{" not in key:
        return key
    name, _, labels = key.partition("{")
    keep = [
        x
        for x in labels.rstrip("}").split(",")
        if x and not x.startswith(("engine=", "model_name="))
    ]
    return name + ("{" + ",".join(keep) + "}" if keep else "")


def _metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, name in (
        ("local_queries", METRIC_LOCAL_QUERIES),
        ("local_hits", METRIC_LOCAL_HITS),
        ("external_queries", METRIC_STORE_QUERIES),
        ("external_hits", METRIC_STORE_HITS),
    ):
        out[key] = (counter(after, name) or 0.0) - (counter(before, name) or 0.0)
    for key in after:
        if key.startswith("store|") and (
            key.endswith("_total") or "_total{" in key or "_sum" in key or "_count" in key
        ):
            d = after[key] - before.get(key, 0.0)
            if d:
                out[key[len("store|") :]] = round(d, 4)
    return out


def run_level(
    dep: Deployment, model: str, users: int, level: int, args: argparse.Namespace
) -> LevelResult:
    records: list[Record] = []
    failures: list[str] = []
    lock = threading.Lock()
    before = {role: _metrics(url) for role, url in dep.engines.items()}
    t0 = time.monotonic()
    deadline = t0 + args.duration

    # One request in flight at a time: the hit engine's counters between two requests are that
    # request's own local / external hit tokens (cross-checked against usage.cached_tokens).
    split_url = dep.engines[dep.hit_engine] if args.per_request_split and users == 1 else None
    last = {"m": _metrics(split_url) if split_url else {}}

    def split(rec: Record) -> None:
        now = _metrics(split_url)
        d = _metric_deltas(last["m"], now)
        last["m"] = now
        rec.local_hits, rec.external_hits = int(d["local_hits"]), int(d["external_hits"])

    def user_loop(user: int) -> None:
        client = Client(dep.url, timeout_s=args.request_timeout)
        # This user's share of the fixed set of sessions (global slots u, u + users, ...).
        slots = list(range(user, args.sessions, users))
        state = {slot: dict(gen=0, turn=0, prompt="", answer="") for slot in slots}
        i = 0
        while time.monotonic() < deadline:
            slot = slots[i % len(slots)]
            i += 1
            s = state[slot]
            traj = Trajectory(
                _seed(level, slot, s["gen"]), args.first_prompt_tokens, args.turn_growth_tokens
            )
            prompt = traj.prompt(s["turn"], s["prompt"], s["answer"])
            if args.reset_local:  # every hit must come from the store (POST /reset_prefix_cache)
                try:
                    for url in dep.engines.values():
                        Client(url).reset_prefix_cache()
                except Exception as e:  # noqa: BLE001 - a failure of this request, as below
                    with lock:
                        failures.append(f"user {user} slot {slot}: reset_prefix_cache: {e}"[:300])
                    time.sleep(1.0)
                    continue
                if split_url:
                    last["m"] = _metrics(split_url)
            t_start = time.perf_counter()
            try:
                c = client.complete(model, prompt, args.max_tokens)
                if not c.token_ids or math.isnan(c.ttft_s):
                    raise RuntimeError("empty completion")
            except Exception as e:  # noqa: BLE001 - counted as a failure; the session restarts
                with lock:
                    failures.append(
                        f"user {user} slot {slot} turn {s['turn'] + 1}: {type(e).__name__}: "
                        f"{str(e)[:300]}"
                    )
                state[slot] = dict(gen=s["gen"] + 1, turn=0, prompt="", answer="")
                time.sleep(1.0)  # a dead server must not turn this loop into a CPU hog
                continue
            latency = time.perf_counter() - t_start
            rec = Record(
                user,
                slot,
                s["gen"],
                s["turn"],
                t_start,
                c.prompt_tokens,
                c.cached_tokens or 0,
                c.ttft_s * 1e3,
                latency * 1e3,
                len(c.token_ids),
                prompt,
                c,
                traj.seed,
            )
            if split_url:
                split(rec)
            with lock:
                records.append(rec)
            if s["turn"] + 1 >= args.turns:
                state[slot] = dict(gen=s["gen"] + 1, turn=0, prompt="", answer="")
            else:
                state[slot] = dict(gen=s["gen"], turn=s["turn"] + 1, prompt=prompt, answer=c.text)

    threads = [threading.Thread(target=user_loop, args=(u,), daemon=True) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    time.sleep(1.0)  # stats land a moment after the last output
    after = {role: _metrics(url) for role, url in dep.engines.items()}
    engine_metrics = {role: _metric_deltas(before[role], after[role]) for role in dep.engines}

    # Recompute check on a sample of hit turns (spread over the level), then misses if short.
    hits = [r for r in records if r.cached_tokens > 0]
    misses = [r for r in records if r.cached_tokens == 0]
    sample = _spread(hits, args.check_sample)
    if len(sample) < args.check_sample:
        sample += _spread(misses, args.check_sample - len(sample))
    checker = Client(dep.check_url, timeout_s=args.request_timeout)
    differ = ties = identical = check_errors = 0
    notes: list[str] = []
    failing: list[dict] = []
    checked_turns: list[dict] = []
    for r in sample:
        try:
            ref = checker.complete(
                model,
                r.prompt,
                args.max_tokens,
                cache_salt=f"agentic-replay-recompute-{uuid.uuid4().hex}",
            )
        except Exception as e:  # noqa: BLE001 - not a comparison: counted apart from "differ"
            check_errors += 1
            notes.append(f"recompute request failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        cmp = compare(r.completion, ref, args.logprob_tolerance)
        ok = cmp.matches and not (ref.cached_tokens or 0)
        differ += not ok
        ties += cmp.tie_at is not None
        identical += r.completion.token_ids == ref.token_ids
        if not ok or cmp.tie_at is not None:
            notes.append(
                f"turn {r.turn + 1} (cached {r.cached_tokens}/{r.prompt_tokens}): "
                f"{cmp.why or 'recompute was not a miss'}"
            )
        checked_turns.append(
            {
                "seed": r.seed,
                "turn": r.turn + 1,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "local_hits": r.local_hits,
                "external_hits": r.external_hits,
                "matches": ok,
            }
        )
        if not ok:
            failing.append(
                {
                    "seed": r.seed,
                    "turn": r.turn + 1,
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens,
                    "local_hits": r.local_hits,
                    "external_hits": r.external_hits,
                    "recompute_cached": ref.cached_tokens or 0,
                    "prompt": r.prompt,
                    "why": cmp.why or "recompute was not a miss",
                    "served_tokens": list(r.completion.token_ids),
                    "recompute_tokens": list(ref.token_ids),
                }
            )

    later = [r for r in records if r.turn > 0]
    hit_later = [r for r in later if r.cached_tokens > 0]
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    lp = sum(r.prompt_tokens for r in later)
    lc = sum(r.cached_tokens for r in later)
    out_tokens = sum(r.output_tokens for r in records)
    ttft = [r.ttft_ms for r in records]
    return LevelResult(
        config=dep.name,
        users=users,
        duration_s=args.duration,
        wall_s=round(wall, 2),
        requests=len(records),
        failures=len(failures),
        failure_examples=failures[:5],
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=cached / prompt if prompt else None,
        hit_rate_turn2plus=lc / lp if lp else None,
        hit_turns=len(hit_later),
        later_turns=len(later),
        ttft_p50_ms=_pct(ttft, 0.5),
        ttft_p90_ms=_pct(ttft, 0.9),
        ttft_p50_hit_ms=_pct([r.ttft_ms for r in hit_later], 0.5),
        ttft_p90_hit_ms=_pct([r.ttft_ms for r in hit_later], 0.9),
        ttft_p50_later_ms=_pct([r.ttft_ms for r in later], 0.5),
        ttft_p50_miss_ms=_pct([r.ttft_ms for r in records if r.cached_tokens == 0], 0.5),
        output_tokens=out_tokens,
        output_tok_s=out_tokens / wall if wall else 0.0,
        engine_metrics=engine_metrics,
        checked=len(sample) - check_errors,
        differ=differ,
        near_ties=ties,
        identical_tokens=identical,
        check_errors=check_errors,
        check_notes=notes[:10],
        failing_inputs=failing,
        checked_turns=checked_turns,
        turns=[
            {
                "seed": r.seed,
                "turn": r.turn + 1,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "local_hits": r.local_hits,
                "external_hits": r.external_hits,
                "ttft_ms": round(r.ttft_ms, 1),
            }
            for r in records
        ],
    )


def _spread(xs: list, k: int) -> list:
    if k <= 0 or not xs:
        return []
    if len(xs) <= k:
        return list(xs)
    return [xs[round(i * (len(xs) - 1) / (k - 1))] if k > 1 else xs[len(xs) // 2] for i in range(k)]


# ------------------------------------------------------------------------ report


def _f(x, spec: str = ".1f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def _ext_share(r: LevelResult, dep_hit_engine: str) -> str:
    m = r.engine_metrics.get(dep_hit_engine, {})
    loc, ext = m.get("local_hits", 0.0), m.get("external_hits", 0.0)
    return f"{int(loc)}/{int(ext)}"


HIT_ENGINE = {
    "none": "engine",
    "hybrid": "engine",
    "mooncake": "engine",
    "pd": "prefill",
    "pd-store": "prefill",
}

TABLE_HEAD = (
    "| config | users | requests | failures | hit rate | hit rate turns 2+ | local/external hit tokens "
    "| TTFT p50 ms | TTFT p90 ms | TTFT p50 hit turns ms | TTFT p50 miss ms | out tok/s "
    "| checked | differ | near-ties |"
)


def table_rows(results: list[LevelResult]) -> list[str]:
    lines = [TABLE_HEAD, "|" + "---|" * (TABLE_HEAD.count("|") - 1)]
    for r in results:
        lines.append(
            f"| {r.config} | {r.users} | {r.requests} | {r.failures} | {_f(_pc(r.hit_rate))} % "
            f"| {_f(_pc(r.hit_rate_turn2plus))} % | {_ext_share(r, HIT_ENGINE[r.config])} "
            f"| {_f(r.ttft_p50_ms)} | {_f(r.ttft_p90_ms)} | {_f(r.ttft_p50_hit_ms)} ({r.hit_turns}/{r.later_turns}) "
            f"| {_f(r.ttft_p50_miss_ms)} | {r.output_tok_s:.1f} "
            f"| {r.checked}{f' (+{r.check_errors} failed)' if r.check_errors else ''} | {r.differ} | {r.near_ties} |"
        )
    return lines


def _pc(x):
    return None if x is None else 100 * x


def store_io(r: LevelResult) -> dict[str, float] | None:
    """Bytes loaded from the store, seconds spent in those loads, failed loads (store configs)."""
    mib = secs = failed = 0.0
    seen = False
    for m in r.engine_metrics.values():
        for k, v in m.items():
            if k.startswith("vllm:hybridkv_store_"):
                seen = True
                if k == "vllm:hybridkv_store_loaded_bytes_total":
                    mib += v / 2**20
                elif k == "vllm:hybridkv_store_load_seconds_total":
                    secs += v
                elif k == "vllm:hybridkv_store_failed_loads_total":
                    failed += v
            elif k.startswith("vllm:mooncake_store_") and 'operation="load_get"' in k:
                seen = True
                if k.startswith("vllm:mooncake_store_operation_bytes_total") and 'status="ok"' in k:
                    mib += v / 2**20
                elif k.startswith("vllm:mooncake_store_operation_time_seconds_sum"):
                    secs += v
                elif k.startswith("vllm:mooncake_store_operation_failed_keys_total"):
                    failed += v
    return (
        {"loaded_mib": round(mib, 1), "load_s": round(secs, 3), "failed": failed} if seen else None
    )


def store_rows(results: list[LevelResult]) -> list[str]:
    lines = [
        "| config | users | loaded from store MiB | seconds in store loads | failed loads (hybridkv: loads; in-tree: keys) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        io = store_io(r)
        if io:
            lines.append(
                f"| {r.config} | {r.users} | {io['loaded_mib']} | {io['load_s']} | {int(io['failed'])} |"
            )
    return lines if len(lines) > 2 else []


def targets(results: list[LevelResult]) -> list[str]:
    by = {(r.config, r.users): r for r in results}
    lines = []
    levels = sorted({r.users for r in results})
    if any(r.config == "hybrid" for r in results) and any(r.config == "mooncake" for r in results):
        for u in levels:
            h, m = by.get(("hybrid", u)), by.get(("mooncake", u))
            if not h or not m:
                continue
            hit_ok = (h.hit_rate or 0) >= (m.hit_rate or 0)
            ratio = (
                h.ttft_p50_hit_ms / m.ttft_p50_hit_ms
                if h.ttft_p50_hit_ms and m.ttft_p50_hit_ms
                else None
            )
            lines.append(
                f"- {u} user(s): hit rate hybridkv {_f(_pc(h.hit_rate))} % vs in-tree {_f(_pc(m.hit_rate))} % "
                f"-> {'MET' if hit_ok else 'NOT met'}; TTFT p50 on hit turns hybridkv {_f(h.ttft_p50_hit_ms)} ms "
                f"vs in-tree {_f(m.ttft_p50_hit_ms)} ms = {_f(ratio, '.2f')}x (target <= 0.80) -> "
                f"{'MET' if ratio is not None and ratio <= 0.8 else 'NOT met'}"
            )
    mine = [r for r in results if r.config in ("hybrid", "pd", "pd-store")]
    d = sum(r.differ for r in mine)
    c = sum(r.checked for r in mine)
    lines.append(
        f"- outputs differing from recompute (hybridkv configs): {d} of {c} checked -> "
        f"{('MET' if d == 0 else 'NOT met') if c else 'not measured'}"
    )
    others = [r for r in results if r.config not in ("hybrid", "pd", "pd-store")]
    if others:
        lines.append(
            f"- (for reference, other configs: {sum(r.differ for r in others)} of "
            f"{sum(r.checked for r in others)} checked differ)"
        )
    return lines


def plot(results: list[LevelResult], path: pathlib.Path, model: str = "tiny gemma3") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = [
        ("hit rate (%)", lambda r: _pc(r.hit_rate)),
        ("TTFT p50, hit turns (ms)", lambda r: r.ttft_p50_hit_ms),
        ("TTFT p50 / p90, all (ms)", None),
        ("output tok/s", lambda r: r.output_tok_s),
    ]
    configs = [c for c in ALL_CONFIGS if any(r.config == c for r in results)]
    for ax, (title, get) in zip(axes, panels):
        for c in configs:
            rs = sorted((r for r in results if r.config == c), key=lambda r: r.users)
            xs = [r.users for r in rs]
            if get is None:
                (line,) = ax.plot(xs, [r.ttft_p50_ms for r in rs], marker="o", label=c)
                ax.plot(
                    xs, [r.ttft_p90_ms for r in rs], marker="x", ls="--", color=line.get_color()
                )
            else:
                ax.plot(xs, [get(r) for r in rs], marker="o", label=c)
        ax.set_title(title)
        ax.set_xlabel("concurrent users")
        ax.set_xticks(sorted({r.users for r in results}))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"agentic replay, {model} on the vLLM CPU engine (small local KV cache)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return matplotlib.__version__


# ------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/agentic_replay.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--configs",
        default=None,
        help=f"default: {','.join(ALL_CONFIGS)}; with --models: {','.join(SINGLE_ENGINE)}",
    )
    p.add_argument(
        "--models",
        default=None,
        help=f"NAME[:BLOCKS],... of {', '.join(MODELS)}: the geometries run, one model "
        "after the other; BLOCKS overrides --num-gpu-blocks for that model",
    )
    p.add_argument(
        "--per-request-split",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="at 1 user, read the engine's /metrics after every request: each turn's own local / "
        "external hit tokens (default: on with --models)",
    )
    p.add_argument(
        "--reset-local",
        action="store_true",
        help="empty every engine's local prefix cache before each request (all hits external: "
        "isolates the store's load path from the local cache)",
    )
    p.add_argument(
        "--out-stem",
        default=None,
        help="result file names (default agentic_replay; with --models agentic_replay_geometries)",
    )
    p.add_argument("--users", default="1,2,4")
    p.add_argument(
        "--duration", type=float, default=40.0, help="seconds of traffic per (config, users)"
    )
    p.add_argument("--kind", default="gemma3")
    p.add_argument("--model", default=None, help="model folder instead of the tiny --kind")
    p.add_argument(
        "--sessions",
        type=int,
        default=6,
        help="agent sessions in flight, split evenly over the users (round robin per user)",
    )
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first-prompt-tokens", type=int, default=768)
    p.add_argument("--turn-growth-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--num-gpu-blocks", type=int, default=48, help="--num-gpu-blocks-override of every engine"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--mooncake-local-buffer", default="64MB")
    p.add_argument("--lease-ttl-ms", type=int, default=30_000)
    p.add_argument(
        "--check-sample", type=int, default=6, help="turns re-sent as a salted recompute per level"
    )
    p.add_argument("--logprob-tolerance", type=float, default=DEFAULT_LOGPROB_TOL)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out-dir", type=pathlib.Path, default=REPO / "bench" / "results")
    p.add_argument("--quick", action="store_true", help="smoke run: 10 s per level, 3 checks")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a bar of (config, users) levels on stderr, below the log lines (default: only "
        "when stderr is a terminal; --no-progress for logs)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.check_sample = 10.0, 3
    try:
        specs = parse_models(args.models) if args.models else None
    except ValueError as e:
        p.error(str(e))
    if args.configs is None:
        args.configs = ",".join(SINGLE_ENGINE if specs else ALL_CONFIGS)
    if args.per_request_split is None:
        args.per_request_split = bool(specs)
    if args.out_stem is None:
        args.out_stem = "agentic_replay_geometries" if specs else "agentic_replay"
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in ALL_CONFIGS]
    if bad:
        p.error(f"unknown config(s) {bad}; choose from {', '.join(ALL_CONFIGS)}")
    levels = [int(u) for u in args.users.split(",")]
    if (
        Trajectory(0, args.first_prompt_tokens, args.turn_growth_tokens).prompt_budget(
            args.turns, args.max_tokens
        )
        > args.max_model_len
    ):
        p.error("--turns/--first-prompt-tokens/--turn-growth-tokens exceed --max-model-len")

    started = time.monotonic()
    load_start = os.getloadavg()
    results: list[LevelResult] = []
    progress = Progress(
        len(configs) * len(levels) * (len(specs) if specs else 1),
        desc="levels",
        unit="level",
        enabled=args.progress,
    )

    def log(msg: str) -> None:
        progress.write(
            f"[{time.monotonic() - started:6.0f} s] {msg}", file=sys.stderr
        )  # above the bar

    signal.signal(signal.SIGTERM, _on_sigterm)
    if specs is None:  # the original bench: one model, all configs
        bench = Bench(args)
        model_info = bench.model_summary()
        print(f"model: {model_info}\nlogs: {bench.workdir}", file=sys.stderr)
        deployments: dict[str, dict] = {}
        errors: dict[str, str] = {}
        write_report = make_reporter(
            args, argv, configs, started, load_start, model_info, deployments, errors
        )
        try:
            run_configs(
                bench,
                configs,
                levels,
                args,
                log,
                progress,
                deployments,
                errors,
                lambda r: (results.append(r), write_report(results, final=False)),
            )
        except KeyboardInterrupt as e:
            log(f"interrupted ({e}); stopping what this run started, writing the partial report")
            errors["(run)"] = f"interrupted: {e}; results are partial"
        finally:
            progress.close()
        return write_report(results, final=True)

    # Geometries: one model's engines at a time (three CPU engines of one model are what the
    # 2-core machine holds), the same configs and seeds on each.
    per_model: dict[str, dict] = {}
    write_report = make_geometries_reporter(
        args, argv, configs, specs, started, load_start, per_model
    )
    try:
        for spec in specs:
            bench = Bench(args, spec)
            entry = per_model[spec.name] = {
                "model": bench.model_summary(),
                "deployments": {},
                "errors": {},
            }
            log(
                f"model {spec.name}: {spec.geometry}; --num-gpu-blocks-override {bench.num_gpu_blocks}; "
                f"logs {bench.workdir}"
            )

            def done(r: LevelResult, name: str = spec.name) -> None:
                r.model = name
                results.append(r)
                write_report(results, final=False)

            run_configs(
                bench,
                configs,
                levels,
                args,
                log,
                progress,
                entry["deployments"],
                entry["errors"],
                done,
            )
            write_report(results, final=False)  # a config that never started shows up at once
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}); stopping what this run started, writing the partial report")
        per_model.setdefault("(run)", {"errors": {}})["errors"]["(run)"] = (
            f"interrupted: {e}; results are partial"
        )
    finally:
        progress.close()
    return write_report(results, final=True)


def run_configs(
    bench: Bench,
    configs: list[str],
    levels: list[int],
    args: argparse.Namespace,
    log,
    progress,
    deployments: dict[str, dict],
    errors: dict[str, str],
    on_result,
) -> None:  # noqa: ANN001
    """Every (config, users) level of one model; ``on_result(LevelResult)`` after each.

    Single-engine configs are up together and their levels interleaved (users level by users
    level, config order rotated), so a change of the shared machine's load hits all of them;
    each P/D config (two engines + proxy) runs alone, to bound memory. Stops what it started
    (also on KeyboardInterrupt, which it re-raises)."""
    singles = [c for c in configs if c in SINGLE_ENGINE]
    groups = ([singles] if singles else []) + [[c] for c in configs if c not in SINGLE_ENGINE]
    live: dict[str, tuple] = {}  # name -> (context manager, Deployment)

    def up(names: list[str]) -> None:
        cms = {n: bench.deploy(n) for n in names}
        got = enter_concurrently(cms, errors, log)
        for name, (dep, boot) in got.items():
            live[name] = (cms[name], dep)
            info = deployments.setdefault(name, {"restarts": 0})
            info.update(commands=dep.commands, logs=info.get("logs", []) + dep.logs)
            info.setdefault("boot_s", []).append(round(boot, 1))
            info["kv_cache_tokens"] = _kv_cache_tokens(dep.logs)
            errors.pop(name, None)
            log(f"{name}: up in {boot:.0f} s (local KV cache {info['kv_cache_tokens']} tokens)")
            try:
                Client(dep.url).complete(
                    bench.model, "warm up", 2, cache_salt=f"warmup-{uuid.uuid4().hex}"
                )
            except Exception as e:  # noqa: BLE001 - reported; the levels will show failures
                log(f"{name}: warm-up failed: {e}")

    def down(name: str) -> None:
        cm, _ = live.pop(name)
        try:
            cm.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001
            log(f"{name}: stop raised {e}")

    def ensure(name: str) -> bool:
        """Redeploy a config whose processes died (on this shared machine other jobs' clean-ups
        have killed vLLM servers); the fresh deployment has a fresh master and local cache."""
        if name in live and healthy(live[name][1]):
            return True
        if name in live:
            log(f"{name}: a server is gone; redeploying")
            down(name)
            deployments[name]["restarts"] += 1
        up([name])
        return name in live

    try:
        for group in groups:
            log(f"starting {', '.join(group)} ...")
            up(group)
            names = [n for n in group if n in live]
            for li, users in enumerate(levels):
                order = names[li % len(names) :] + names[: li % len(names)] if names else []
                for name in order:
                    r = None
                    for attempt in (1, 2):
                        if not ensure(name):
                            break
                        r = run_level(live[name][1], bench.model, users, li + 1, args)
                        if healthy(live[name][1]):
                            break
                        r.note = "a server died during this level"
                        log(
                            f"{name} x{users}: a server died during the level"
                            + ("; rerunning it on a fresh deployment" if attempt == 1 else "")
                        )
                    progress.update()
                    if r is None:
                        continue
                    if attempt == 2:
                        r.note = (r.note + "; " if r.note else "") + "rerun after a server died"
                    on_result(r)
                    log(
                        f"{name} x{users}: {r.requests} req, {r.failures} failed, hit {_f(_pc(r.hit_rate))} %, "
                        f"TTFT p50 {_f(r.ttft_p50_ms)} ms (hit turns {_f(r.ttft_p50_hit_ms)}), "
                        f"{r.output_tok_s:.1f} tok/s, differ {r.differ}/{r.checked}, "
                        "local/external hit tokens "
                        + ", ".join(
                            f"{role} {int(m['local_hits'])}/{int(m['external_hits'])}"
                            for role, m in r.engine_metrics.items()
                        )
                    )
                for name in [n for n in group if n not in live and n in errors]:
                    progress.update()  # a config that never started: its level is done (as an error)
            for name in group:
                if name in live:
                    down(name)
    finally:
        for name in list(live):
            down(name)


def _kv_cache_tokens(logs: list[str]) -> int | None:
    """The engine's local KV cache size in tokens, from its log (``GPU KV cache size: N tokens``)."""
    import re

    for path in logs:
        try:
            m = re.findall(
                r"KV cache size: ([\d,]+) tokens", pathlib.Path(path).read_text(errors="replace")
            )
        except OSError:
            continue
        if m:
            return int(m[-1].replace(",", ""))
    return None


def _on_sigterm(signum, frame) -> None:  # noqa: ARG001
    # Turn a SIGTERM into an exception in the main thread: the deployments' exits then stop
    # the servers and masters this run started, and the partial report is written.
    raise KeyboardInterrupt(f"signal {signum}")


def make_reporter(args, argv, configs, started, load_start, model_info, deployments, errors):
    def write_report(results: list[LevelResult], final: bool) -> int:
        results = sorted(results, key=lambda r: (configs.index(r.config), r.users))
        runtime = time.monotonic() - started
        lines = table_rows(results)
        tgt = targets(results)
        if final:
            print("\n".join(lines))
            print("\n".join(tgt))
            print(f"runtime {runtime:.0f} s")
        args.out_dir.mkdir(parents=True, exist_ok=True)
        mpl_version = (
            plot(
                results,
                args.out_dir / f"{args.out_stem}.png",
                f"tiny {args.kind}" if not args.model else pathlib.Path(args.model).name,
            )
            if results
            else "n/a"
        )
        given = argv if argv is not None else sys.argv[1:]
        cmd = "python bench/agentic_replay.py" + (" " + shlex.join(given) if given else "")
        doc = {
            "command": cmd,
            "complete": final and "(run)" not in errors,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "host": {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_start": load_start,
                "loadavg_end": os.getloadavg(),
            },
            "matplotlib": mpl_version,
            "model": model_info,
            "settings": {
                k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
            },
            "deployments": deployments,
            "errors": errors,
            "runtime_s": round(runtime, 1),
            "results": [asdict(r) for r in results],
            "targets": tgt,
            "store_rows": store_rows(results),
        }
        (args.out_dir / f"{args.out_stem}.json").write_text(
            json.dumps(doc, indent=2, default=str) + "\n"
        )
        (args.out_dir / f"{args.out_stem}.md").write_text(_markdown(doc, lines, tgt, args))
        if final:
            print(f"wrote {args.out_dir / (args.out_stem + '.md')}, .json, .png", file=sys.stderr)
        return 0 if not errors else 1

    return write_report


def _markdown(doc: dict, table: list[str], tgt: list[str], args) -> str:
    m, h, s = doc["model"], doc["host"], doc["settings"]
    out = [
        "# Agentic replay: multi-turn agent sessions at 1/2/4 users, connectors side by side",
        "",
        f"- command: `{doc['command']}` (runtime {doc['runtime_s']:.0f} s, {doc['date']})"
        + ("" if doc["complete"] else " -- PARTIAL: the run did not finish"),
        f"- host: {h['machine']}, {h['cpus']} cores, {h['platform']}, Python {h['python']}; load average at "
        f"start / end: {h['loadavg_start'][0]:.2f} / {h['loadavg_end'][0]:.2f} (shared machine)",
        f"- model: {m.get('architecture')} tiny `{args.kind}` (hidden {m.get('hidden_size')}, {m.get('layers')} "
        f"layers {m.get('layer_types')}, sliding window {m.get('sliding_window')}), "
        f"{m.get('parameters', 0) / 1e6:.1f} M parameters, {m.get('safetensors_mib')} MiB bf16; seeded random "
        "weights (cli/harness/tiny_models.py)",
        f"- engines: vLLM CPU, `--num-gpu-blocks-override {s['num_gpu_blocks']}` (a small local KV cache, "
        f"{s['num_gpu_blocks']} blocks of 128 tokens shared by the sliding and full-attention groups), "
        f"`--max-num-batched-tokens {s['max_num_batched_tokens']} --max-num-seqs {s['max_num_seqs']} "
        f"--max-model-len {s['max_model_len']}`, prefix caching on; stores: {SEGMENT} segment per engine, "
        f"master lease TTL {s['lease_ttl_ms']} ms; in-tree MooncakeStoreConnector: `save_decode_cache: true`, "
        f"local buffer {s['mooncake_local_buffer']}, tcp, P2PHANDSHAKE",
        f"- workload: {s['sessions']} agent sessions split over the users, each user round robin over its "
        f"share, one request at a time; {s['turns']} turns per session "
        f"(first prompt {s['first_prompt_tokens']} tokens, +answer +{s['turn_growth_tokens']} tokens per turn, "
        f"{s['max_tokens']} greedy output tokens), then a fresh session; {s['duration']:.0f} s of traffic per "
        "level; the same seeded trajectories for every config, disjoint seeds per level",
        f"- checks: per level {s['check_sample']} hit turns (spread over the level) re-sent with a fresh "
        f"`cache_salt` to the decoding engine; greedy tokens + top-5 logprobs compared (tolerance "
        f"{s['logprob_tolerance']}, greedy near-ties excused, as in `hybridkv demo`)",
        f"- plot: `{args.out_stem}.png` (matplotlib {doc['matplotlib']})",
        "",
        "Columns: hit rate = cached / prompt tokens over all requests (turns 2+: excluding each session's "
        "cold first turn); local/external hit tokens = the hit engine's `vllm:prefix_cache_hits` / "
        "`vllm:external_prefix_cache_hits` deltas over the level (P/D: the prefill engine); hit turns = "
        "turns 2+ with cached tokens > 0 (n of turns 2+); TTFT at the first streamed token; out tok/s = "
        "output tokens / wall time of the level; differ = sampled turns whose output differs from the "
        "recompute.",
        "",
        *table,
        "",
        *(
            [
                "Store reads over each level (the connectors' own counters on /metrics):",
                "",
                *doc["store_rows"],
                "",
            ]
            if doc["store_rows"]
            else []
        ),
        "## Issue targets",
        "",
        *tgt,
        "",
    ]
    if doc["errors"]:
        out += ["## Configs that did not run", ""]
        out += [f"- {k}: ```{v[-800:]}```" for k, v in doc["errors"].items()]
        out.append("")
    notes = [
        f"- {r['config']} x{r['users']}: "
        + "; ".join(([r["note"]] if r.get("note") else []) + r["check_notes"])
        for r in doc["results"]
        if r["check_notes"] or r.get("note")
    ]
    restarts = {k: v.get("restarts", 0) for k, v in doc["deployments"].items() if v.get("restarts")}
    if restarts:
        out += [
            "## Redeployments",
            "",
            "A server of these configs was found dead between levels (on this shared machine other "
            "jobs' clean-ups have killed vLLM servers) and the config was redeployed (fresh engine(s), "
            f"fresh master): {restarts}",
            "",
        ]
    fails = [
        f"- {r['config']} x{r['users']}: " + "; ".join(r["failure_examples"])
        for r in doc["results"]
        if r["failure_examples"]
    ]
    if notes:
        out += ["## Check notes", "", *notes, ""]
    if fails:
        out += ["## Failures (first 5 per level)", "", *fails, ""]
    return "\n".join(out)


# ------------------------------------------------------------------------ geometries report

GEO_HEAD = (
    "| model | config | requests | hit rate | local / external hit tokens (% of prompt) | hit turns "
    "| TTFT p50 / p90 hit turns ms | TTFT p50 miss ms | differ / sampled | near-ties |"
)
_GENERIC_ERRORS = (
    "ServerStartError",
    "Engine core initialization failed",
    "RuntimeError: Engine process failed",
    "see root cause above",
)


def error_line(text: str) -> str:
    """The line of a start failure that says why: the first ``...Error: ...`` line of the log
    tail that is not a generic wrapper (engine core failed, server did not start)."""
    import re

    lines = [ln.strip() for ln in text.splitlines()]
    errs = [ln for ln in lines if re.search(r"(\w+(Error|Exception)|AssertionError)(: |$)", ln)]
    specific = [ln for ln in errs if not any(g in ln for g in _GENERIC_ERRORS)]
    pick = (specific or errs or [ln for ln in lines if ln] or ["?"])[0]
    pick = re.sub(r"^\(\w+ pid=\d+\)\s*", "", pick)  # "(EngineCore pid=123) " prefix
    return pick[:400]


def _hits_vs(
    results: list[LevelResult], model: str, base: str, other: str
) -> tuple[list[dict], int]:
    """Turns where ``other`` cached fewer tokens than ``base`` on the same input (seed, turn,
    prompt length), and how many such inputs both served. With one user both configs replay
    the same request sequence, so the local cache saw the same history up to that turn."""
    by = {r.config: r for r in results if r.model == model and r.users == 1}
    if base not in by or other not in by:
        return [], 0
    key = lambda t: (t["seed"], t["turn"], t["prompt_tokens"])  # noqa: E731
    b = {key(t): t["cached_tokens"] for t in by[base].turns}
    lost, common = [], 0
    for t in by[other].turns:
        k = key(t)
        if k not in b:
            continue
        common += 1
        if t["cached_tokens"] < b[k]:
            lost.append(
                {
                    "seed": k[0],
                    "turn": k[1],
                    "prompt_tokens": k[2],
                    base: b[k],
                    other: t["cached_tokens"],
                }
            )
    return lost, common


def geometries_headline(
    results: list[LevelResult], specs: list[ModelSpec], per_model: dict
) -> list[str]:
    """One line per model: in-tree vs hybridkv on correctness and hits (users 1)."""
    out = []
    for spec in specs:
        by = {r.config: r for r in results if r.model == spec.name and r.users == 1}
        errs = per_model.get(spec.name, {}).get("errors", {})
        if "mooncake" in errs:
            out.append(
                f"- `{spec.name}`: in-tree did not start (`{error_line(errs['mooncake'])[:200]}`)"
            )
            continue
        h, m = by.get("hybrid"), by.get("mooncake")
        if not h or not m:
            continue
        lost, common = _hits_vs(results, spec.name, "hybrid", "mooncake")
        won, _ = _hits_vs(results, spec.name, "mooncake", "hybrid")
        out.append(
            f"- `{spec.name}`: outputs differing from recompute: in-tree {m.differ}/{m.checked}{_by_kind(m)}, "
            f"hybridkv {h.differ}/{h.checked}{_by_kind(h)}; hit rate in-tree {_f(_pc(m.hit_rate))} %, "
            f"hybridkv {_f(_pc(h.hit_rate))} %; on the {common} turns both served with the same input, "
            f"in-tree cached fewer tokens on {len(lost)}, more on {len(won)}; TTFT p50 on hit turns in-tree "
            f"{_f(m.ttft_p50_hit_ms)} ms, hybridkv {_f(h.ttft_p50_hit_ms)} ms"
        )
    return out


def geometries_findings(
    results: list[LevelResult], specs: list[ModelSpec], per_model: dict
) -> list[str]:
    out = []
    for spec in specs:
        errs = per_model.get(spec.name, {}).get("errors", {})
        for cfg, text in errs.items():
            out.append(f"- **{spec.name} / {cfg}: did not start** -- `{error_line(text)}`")
        for r in (r for r in results if r.model == spec.name):
            if not r.failing_inputs:
                continue
            ex = "; ".join(
                f"seed {f['seed']} turn {f['turn']} (prompt {f['prompt_tokens']}, cached "
                f"{f['cached_tokens']}{_split(f)}: {f['why']})"
                for f in r.failing_inputs[:5]
            )
            more = len(r.failing_inputs) - 5
            out.append(
                f"- **{spec.name} / {r.config}: {r.differ} of {r.checked} sampled hit turns differ from "
                f"recompute**{_by_kind(r)}; failing inputs (model {spec.name}, session seed, turn): {ex}"
                + (f"; {more} more in the table below" if more > 0 else "")
                + _after_local(r)
            )
        for other in ("mooncake", "none"):
            lost, common = _hits_vs(results, spec.name, "hybrid", other)
            if lost and other == "mooncake":
                ex = "; ".join(
                    f"seed {x['seed']} turn {x['turn']}: {x['hybrid']} vs {x['mooncake']}"
                    for x in lost[:4]
                )
                out.append(
                    f"- **{spec.name} / mooncake: fewer cached tokens than hybridkv** on {len(lost)} of "
                    f"{common} identical turns (hybridkv vs in-tree cached tokens; e.g. {ex})"
                )
        lost, common = _hits_vs(results, spec.name, "mooncake", "hybrid")
        if lost:
            ex = "; ".join(
                f"seed {x['seed']} turn {x['turn']}: {x['mooncake']} vs {x['hybrid']}"
                for x in lost[:4]
            )
            out.append(
                f"- {spec.name} / hybrid: fewer cached tokens than in-tree on {len(lost)} of {common} "
                f"identical turns (in-tree vs hybridkv; e.g. {ex})"
            )
    return out or [
        "- nothing: every config started, no sampled output differed, in-tree lost no hits"
    ]


def _after_local(r: LevelResult) -> str:
    """Where checked turns that loaded external tokens differ: after a local-only hit earlier in the
    same session, or not. A store connector saves what the engine computed; if a local hit
    corrupted a turn, its saved KV is wrong and a later external hit serves it."""
    served = {(t["seed"], t["turn"]): t for t in r.turns}

    def tainted(t: dict) -> bool:
        return any(
            (e := served.get((t["seed"], k))) and e["cached_tokens"] and e.get("external_hits") == 0
            for k in range(2, t["turn"])
        )

    ext = [t for t in r.checked_turns if t.get("external_hits")]
    if not any(not t["matches"] for t in ext):
        return ""
    a = [t for t in ext if tainted(t)]
    b = [t for t in ext if not tainted(t)]
    bad = lambda xs: sum(not t["matches"] for t in xs)  # noqa: E731
    return (
        f". Of the checked turns that loaded external tokens, those after a local-only hit earlier in the same "
        f"session differ {bad(a)}/{len(a)}, the others {bad(b)}/{len(b)}"
    )


def _split(t: dict) -> str:
    if t.get("local_hits") is None:
        return ""
    return f" = local {t['local_hits']} + external {t['external_hits']}"


def _by_kind(r: LevelResult) -> str:
    """Differ / sampled among local-only hits and among hits with external tokens (split known)."""
    ts = [t for t in r.checked_turns if t.get("local_hits") is not None and t["cached_tokens"] > 0]
    if not ts:
        return ""
    ext = [t for t in ts if t["external_hits"] > 0]
    loc = [t for t in ts if t["external_hits"] == 0]
    bad = lambda xs: sum(not t["matches"] for t in xs)  # noqa: E731
    return f" (local-only hits {bad(loc)}/{len(loc)}, with external {bad(ext)}/{len(ext)})"


def split_check(r: LevelResult) -> tuple[int, int]:
    """(turns whose per-request local + external hit tokens equal usage.cached_tokens, turns split)."""
    split = [t for t in r.turns if t.get("local_hits") is not None]
    return sum(t["local_hits"] + t["external_hits"] == t["cached_tokens"] for t in split), len(
        split
    )


def geometries_rows(
    results: list[LevelResult], specs: list[ModelSpec], configs: list[str], per_model: dict
) -> list[str]:
    lines = [GEO_HEAD, "|" + "---|" * (GEO_HEAD.count("|") - 1)]
    for spec in specs:
        errs = per_model.get(spec.name, {}).get("errors", {})
        for cfg in configs:
            rs = [r for r in results if r.model == spec.name and r.config == cfg]
            if not rs and cfg in errs:
                lines.append(
                    f"| {spec.name} | {cfg} | did not start: `{error_line(errs[cfg])[:200]}` "
                    "| | | | | | | |"
                )
            for r in rs:
                m = r.engine_metrics.get(HIT_ENGINE[r.config], {})
                loc, ext = m.get("local_hits", 0.0), m.get("external_hits", 0.0)
                pt = r.prompt_tokens or 1
                lines.append(
                    f"| {spec.name} | {r.config} | {r.requests}{f' ({r.failures} failed)' if r.failures else ''} "
                    f"| {_f(_pc(r.hit_rate))} % | {int(loc)} / {int(ext)} ({100 * loc / pt:.1f} / {100 * ext / pt:.1f} %) "
                    f"| {r.hit_turns}/{r.later_turns} | {_f(r.ttft_p50_hit_ms)} / {_f(r.ttft_p90_hit_ms)} "
                    f"| {_f(r.ttft_p50_miss_ms)} | {r.differ} / {r.checked}"
                    f"{f' (+{r.check_errors} failed)' if r.check_errors else ''}{_by_kind(r)} | {r.near_ties} |"
                )
    return lines


def plot_geometries(
    results: list[LevelResult], specs: list[ModelSpec], configs: list[str], path: pathlib.Path
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.name for s in specs]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    width = 0.8 / max(len(configs), 1)
    for ci, cfg in enumerate(configs):
        xs, loc, ext, p50, p90, dif, chk = [], [], [], [], [], [], []
        for mi, name in enumerate(names):
            r = next((r for r in results if r.model == name and r.config == cfg), None)
            if r is None:
                continue
            m = r.engine_metrics.get(HIT_ENGINE[r.config], {})
            pt = r.prompt_tokens or 1
            xs.append(mi + (ci - (len(configs) - 1) / 2) * width)
            loc.append(100 * m.get("local_hits", 0.0) / pt)
            ext.append(100 * m.get("external_hits", 0.0) / pt)
            p50.append(r.ttft_p50_hit_ms or 0.0)
            p90.append(r.ttft_p90_hit_ms or 0.0)
            dif.append(r.differ)
            chk.append(r.checked)
        color = f"C{ci}"
        axes[0].bar(xs, loc, width, color=color, alpha=0.5, label=f"{cfg} local")
        axes[0].bar(xs, ext, width, bottom=loc, color=color, label=f"{cfg} external")
        axes[1].bar(xs, p50, width, color=color, label=f"{cfg} p50")
        axes[1].scatter(xs, p90, color=color, marker="_", s=300, label=f"{cfg} p90")
        axes[2].bar(xs, dif, width, color=color, label=cfg)
        for x, d, c in zip(xs, dif, chk):
            axes[2].text(x, d, f"{d}/{c}", ha="center", va="bottom", fontsize=7)
    for ax, title in zip(
        axes,
        (
            "hit tokens, % of prompt (light: local, dark: external)",
            "TTFT on hit turns (ms): bar p50, tick p90",
            "sampled outputs differing from recompute",
        ),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7, ncol=2)
    axes[1].legend(fontsize=7, ncol=2)
    axes[2].set_ylim(0, max([1] + [r.differ + 1 for r in results]))
    fig.suptitle(
        "agentic replay on hybrid KV-cache geometries, vLLM CPU engine, small local KV cache (1 user)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return matplotlib.__version__


def make_geometries_reporter(args, argv, configs, specs, started, load_start, per_model):  # noqa: ANN001
    def write_report(results: list[LevelResult], final: bool) -> int:
        runtime = time.monotonic() - started
        order = {s.name: i for i, s in enumerate(specs)}
        results = sorted(
            results, key=lambda r: (order.get(r.model, 99), configs.index(r.config), r.users)
        )
        rows = geometries_rows(results, specs, configs, per_model)
        findings = geometries_findings(results, specs, per_model)
        run_error = per_model.get("(run)", {}).get("errors", {})
        if final:
            print("\n".join(rows))
            print("\n".join(findings))
            print(f"runtime {runtime:.0f} s")
        args.out_dir.mkdir(parents=True, exist_ok=True)
        mpl_version = (
            plot_geometries(results, specs, configs, args.out_dir / f"{args.out_stem}.png")
            if results
            else "n/a"
        )
        given = argv if argv is not None else sys.argv[1:]
        cmd = "python bench/agentic_replay.py" + (" " + shlex.join(given) if given else "")
        doc = {
            "command": cmd,
            "reproduce": (
                "flock /tmp/hybridkv-engine.lock env VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 "
                ".venv/bin/" + cmd
            ),
            "complete": final and not run_error,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "host": {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_start": load_start,
                "loadavg_end": os.getloadavg(),
            },
            "matplotlib": mpl_version,
            "settings": {
                k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
            },
            "models": per_model,
            "runtime_s": round(runtime, 1),
            "findings": findings,
            "headline": geometries_headline(results, specs, per_model),
            "error_lines": {
                f"{m}/{c}": error_line(t)
                for m, e in per_model.items()
                for c, t in e.get("errors", {}).items()
            },
            "results": [asdict(r) for r in results],
            "split_checks": [split_check(r) for r in results],
        }
        (args.out_dir / f"{args.out_stem}.json").write_text(
            json.dumps(doc, indent=2, default=str) + "\n"
        )
        (args.out_dir / f"{args.out_stem}.md").write_text(
            _geometries_markdown(doc, rows, findings, specs, args)
        )
        if final:
            print(f"wrote {args.out_dir / (args.out_stem + '.md')}, .json, .png", file=sys.stderr)
        # A config refusing a geometry is a result; a run that did not finish, or where hybridkv
        # or the no-connector baseline did not start, is a failure of the bench.
        broken = [
            f"{m}/{c}" for m, e in per_model.items() for c in e.get("errors", {}) if c != "mooncake"
        ]
        return 0 if not broken else 1

    return write_report


def _geometries_markdown(
    doc: dict, rows: list[str], findings: list[str], specs: list[ModelSpec], args
) -> str:
    h, s = doc["host"], doc["settings"]
    out = [
        "# Agentic replay on the hybrid geometries: hybridkv vs vLLM's in-tree MooncakeStoreConnector",
        "",
        "Reproduce (from the repository root):",
        "",
        f"    {doc['reproduce']}",
        "",
        f"- runtime {doc['runtime_s']:.0f} s, {doc['date']}"
        + ("" if doc["complete"] else " -- PARTIAL: the run did not finish"),
        f"- host: {h['machine']}, {h['cpus']} cores, {h['platform']}, Python {h['python']}; load average at "
        f"start / end: {h['loadavg_start'][0]:.2f} / {h['loadavg_end'][0]:.2f} (shared machine)",
        f"- workload: {s['users']} user(s), {s['sessions']} agent sessions round robin, {s['turns']} turns each "
        f"(first prompt {s['first_prompt_tokens']} tokens, +answer +{s['turn_growth_tokens']} per turn, "
        f"{s['max_tokens']} greedy output tokens), {s['duration']:.0f} s of traffic per (model, config); the same "
        "seeded trajectories on every config",
        f"- engines: vLLM 0.32 CPU, prefix caching on, `--max-num-batched-tokens {s['max_num_batched_tokens']} "
        f"--max-num-seqs {s['max_num_seqs']} --max-model-len {s['max_model_len']}`, a small local KV cache per "
        f"model (below); stores: {SEGMENT} segment per engine, lease TTL {s['lease_ttl_ms']} ms; in-tree "
        f"MooncakeStoreConnector with `save_decode_cache: true`, local buffer {s['mooncake_local_buffer']}, tcp",
        f"- checks: {s['check_sample']} hit turns per (model, config) re-sent with a fresh `cache_salt` to the "
        f"same engine; greedy tokens + top-5 logprobs compared (tolerance {s['logprob_tolerance']}, greedy "
        "near-ties excused, as in `hybridkv demo`)",
        f"- plot: `{args.out_stem}.png` (matplotlib {doc['matplotlib']})",
        "",
        "Models (tiny, seeded random weights, cli/harness/tiny_models.py):",
        "",
    ]
    for spec in specs:
        e = doc["models"].get(spec.name, {})
        m = e.get("model", {})
        kv = {c: d.get("kv_cache_tokens") for c, d in e.get("deployments", {}).items()}
        out.append(
            f"- `{spec.name}`: {spec.geometry}; `--num-gpu-blocks-override {m.get('num_gpu_blocks')}`"
            + (f" {' '.join(spec.engine_args)}" if spec.engine_args else "")
            + (
                f", EAGLE drafter `{spec.drafter}` ({NUM_SPECULATIVE_TOKENS} speculative tokens)"
                if spec.drafter
                else ""
            )
            + (f"; local KV cache (engine log) {kv} tokens" if kv else "")
        )
    out += [
        "",
        "## In-tree vs hybridkv",
        "",
        *doc["headline"],
        "",
        "## Findings",
        "",
        *findings,
        "",
        "## Per (model, config)",
        "",
        "hit rate = cached / prompt tokens over all requests (usage); local / external hit tokens = the "
        "engine's `vllm:prefix_cache_hits` / `vllm:external_prefix_cache_hits` deltas over the run (in % of "
        "the prompt tokens); hit turns = turns 2+ with cached > 0 (of turns 2+); TTFT at the first streamed "
        "token; differ / sampled = sampled hit turns whose output differs from the recompute, split (1 user, "
        "per-request counters) into turns whose hit was local only and turns that loaded external tokens.",
        "",
        *rows,
        "",
        "TTFT: a model's configs run one after another (30 s each, not interleaved) on a shared 2-core "
        "machine, so a change of the machine's load between them moves a whole cell; differences in TTFT "
        "between configs are only as good as the load was steady (load average at start / end above). The "
        "hit and correctness columns do not depend on load (1 user replays the same request sequence).",
        "",
    ]
    fails = [(r["model"], r["config"], f) for r in doc["results"] for f in r["failing_inputs"]]
    if fails:
        out += [
            "## Failing inputs (differ from recompute)",
            "",
            "(prompt text of each in the json: results[].failing_inputs[].prompt)",
            "",
            "| model | config | session seed | turn | prompt tokens | cached | local + external | why |",
            "|---|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {m} | {c} | {f['seed']} | {f['turn']} | {f['prompt_tokens']} | {f['cached_tokens']} "
            f"| {f.get('local_hits')} + {f.get('external_hits')} | {f['why']} |"
            for m, c, f in fails
        ]
        out.append("")
    notes = [
        f"- {r['model']} / {r['config']}: "
        + "; ".join(([r["note"]] if r.get("note") else []) + r["check_notes"])
        for r in doc["results"]
        if r["check_notes"] or r.get("note")
    ]
    if notes:
        out += ["## Check notes", "", *notes, ""]
    checks = [
        (r["model"], r["config"], doc["split_checks"][i]) for i, r in enumerate(doc["results"])
    ]
    if any(n for _, _, (_, n) in checks):
        out += [
            "## Per-request split (local / external hit tokens of each turn)",
            "",
            "At 1 user the engine's counters are read after every request; the split is exact when local + "
            "external equals the request's usage.cached_tokens: "
            + ", ".join(f"{m}/{c} {ok}/{n}" for m, c, (ok, n) in checks)
            + ".",
            "",
        ]
    if doc["error_lines"]:
        out += ["## Configs that did not start (error line; full log tail in the json)", ""]
        out += [f"- {k}: `{v}`" for k, v in doc["error_lines"].items()]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
