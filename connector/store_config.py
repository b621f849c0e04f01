"""``kv_connector_extra_config`` of HybridStoreConnector, validated once at startup.

A typo in a JSON config line is refused when the engine starts, naming the key and the
fix, rather than ignored (a silent miss) or found mid-request. Each key is declared once,
as a field of ``StoreConnectorConfig``: its name, type, default, check and one-line doc
(``key(...)``). ``parse_declared`` validates any config declared that way;
``markdown_table`` renders the declarations as docs/config.md's table, and a unit test
keeps that table equal to them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


def bad_value(key: str, value: Any, expected: str) -> ConfigError:
    """The error for one key's value: ``kv_connector_extra_config.KEY=VALUE: EXPECTED``."""
    return ConfigError(f"kv_connector_extra_config.{key}={value!r}: {expected}")


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as ``"512MiB"`` / ``"2GB"`` (binary units)."""
    if isinstance(value, bool):
        raise bad_value(key, value, 'expected a size such as 1073741824 or "1GiB"')
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = (m.group(2) or "").upper().replace("I", "").replace("B", "")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise bad_value(
            key,
            value,
            'expected a size in bytes (an integer) or a string such as "512MiB" / "2GiB"',
        )
    if n < 0:
        raise bad_value(key, value, "must be >= 0")
    return n


@dataclass(frozen=True)
class Check:
    """How one key's value is parsed: ``kind`` names the accepted values in the docs table,
    ``parse(key, value)`` returns the typed value or raises ConfigError naming key and fix."""

    kind: str
    parse: Callable[[str, Any], Any]


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def _seconds(key: str, value: Any) -> float:
    if not _number(value) or value <= 0:
        raise bad_value(key, value, "expected a positive number of seconds")
    return float(value)


def _seconds_or_zero(key: str, value: Any) -> float:
    if not _number(value) or value < 0:
        raise bad_value(key, value, "expected seconds >= 0")
    return float(value)


def _positive_int(key: str, value: Any) -> int:
    if not _int(value) or value <= 0:
        raise bad_value(key, value, "expected a positive integer")
    return value


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_value(key, value, "expected true or false")
    return value


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise bad_value(key, value, "expected a string")
    return value


def _nonzero_size(key: str, value: Any) -> int:
    n = parse_size(key, value)
    if n == 0:
        raise bad_value(key, value, 'give room for at least one block, e.g. "64MiB"')
    return n


def _share(key: str, value: Any) -> float:
    if not _number(value) or not 0 < value <= 1:
        raise bad_value(key, value, "expected a share of the KV cache in (0, 1], e.g. 0.5")
    return float(value)


def _nice(key: str, value: Any) -> int:
    if not _int(value) or not 0 <= value <= 19:
        raise bad_value(
            key,
            value,
            "expected a nice level from 0 (normal priority) to 19 (only CPU nothing else wants)",
        )
    return value


def _is_host_port(value: Any) -> bool:
    if not isinstance(value, str) or ":" not in value:
        return False
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _master_address(key: str, value: Any) -> str | None:
    if value is not None and not _is_host_port(value):
        raise bad_value(
            key,
            value,
            'expected "host:port" of a running mooncake_master, or leave it out to start '
            "an embedded master",
        )
    return value


def _choice(first: str, other: str, hint: str = "") -> Callable[[str, Any], str]:
    def parse(key: str, value: Any) -> str:
        if value not in (first, other):
            raise bad_value(key, value, f'expected "{first}"{hint} or "{other}"')
        return value

    return parse


SIZE = Check('size (bytes or "512MiB")', parse_size)
SIZE_NONZERO = Check("size > 0", _nonzero_size)
SECONDS = Check("seconds > 0", _seconds)
SECONDS_OR_OFF = Check("seconds >= 0", _seconds_or_zero)
POSITIVE_INT = Check("integer > 0", _positive_int)
FLAG = Check("true / false", _flag)
STRING = Check("string", _string)
SHARE = Check("number in (0, 1]", _share)

T = TypeVar("T")


def key(default: T, check: Check, doc: str, shown: str | None = None) -> T:
    """Declare one config key: its default, its check, its one-line doc; ``shown`` is how the
    docs table prints the default (else its JSON form)."""
    return field(default=default, metadata={"check": check, "doc": doc, "shown": shown})


@dataclass(frozen=True)
class StoreConnectorConfig:
    """HybridStoreConnector's validated ``kv_connector_extra_config``."""

    master_address: str | None = key(
        None,
        Check("host:port", _master_address),
        "`host:port` of a running `mooncake_master`; unset: an embedded master on 127.0.0.1",
        shown="none (embedded)",
    )
    global_segment_size: int = key(
        512 << 20,
        SIZE,
        "memory this engine contributes to the store (it holds other engines' objects too)",
        shown="`512MiB`",
    )
    local_buffer_size: int = key(
        16 << 20, SIZE, "Mooncake client staging buffer for small objects", shown="`16MiB`"
    )
    protocol: str = key(
        "tcp", Check("`tcp` / `rdma`", _choice("tcp", "rdma")), "Mooncake transfer protocol"
    )
    rdma_devices: str = key(
        "", STRING, "RDMA devices for protocol `rdma`, comma separated; empty: auto"
    )
    local_hostname: str = key(
        "127.0.0.1",
        STRING,
        "address other store nodes use to reach this engine's segment; Mooncake's listeners "
        "bind it",
    )
    pin_mooncake_listeners: bool = key(
        True,
        FLAG,
        "rebind Mooncake's all-interfaces listeners to `local_hostname` ([security](security.md)); "
        "false: leave them on all interfaces",
    )
    populate_segment: bool = key(
        True,
        FLAG,
        "make the worker's `global_segment_size` resident at start (`MADV_POPULATE_WRITE`), so "
        "memory "
        "pressure shows at startup; false: pages become resident as objects land",
    )
    read_wait_nice: int = key(
        19,
        Check("integer 0-19", _nice),
        "nice level of the threads that wait for store reads (Mooncake polls on the waiting "
        "thread); "
        "0: normal priority",
    )
    timeout_s: float = key(
        5.0,
        SECONDS,
        "bound on one store call, on one request's whole load and on one step's synchronous saves",
    )
    lookup_timeout_s: float = key(
        1.0, SECONDS, "bound on the scheduler's existence query; past it the lookup is a miss"
    )
    save_decode: bool = key(
        True, FLAG, "also save blocks filled during decode (agent turns resend the answer)"
    )
    namespace: str = key(
        "",
        STRING,
        "mixed into every key: deployments with different namespaces never name each other's "
        "objects "
        "(naming, not isolation)",
    )
    auth_secret_file: str = key(
        "",
        STRING,
        "deployment secret that MACs every stored object (else `$HYBRIDKV_AUTH_SECRET_FILE` / "
        "`$HYBRIDKV_AUTH_SECRET`); none: XXH3 only, logged",
    )
    embedded_lease_ttl_ms: int = key(
        30_000, POSITIVE_INT, "lease TTL (ms) of the embedded master; must exceed the slowest batch"
    )
    max_batch_blocks: int = key(
        256, POSITIVE_INT, "blocks per store batch call (bounds one call's bytes and latency)"
    )
    max_pinned_save_fraction: float = key(
        0.5,
        SHARE,
        "share of the KV cache that saves in flight may pin; beyond it a step's save job is "
        "skipped "
        "and counted",
    )
    lookup_cache_s: float = key(
        1.0,
        SECONDS_OR_OFF,
        "seconds a lookup's answer is reused when the scheduler re-asks for a waiting "
        "request; 0: always ask",
    )
    key_log_path: str = key(
        "",
        STRING,
        "debugging: append `<key> <group> <bytes>` of every object this worker writes to this file",
    )
    staging: str = key(
        "auto",
        Check("`auto` / `always`", _choice("auto", "always", hint=" (stage only a GPU KV cache)")),
        "`auto`: zero-copy from a host KV cache, staged from a GPU one; `always`: stage a host "
        "cache too "
        "(objects are byte-identical)",
    )
    staging_buffer_size: int = key(
        64 << 20,
        SIZE_NONZERO,
        "host staging memory per KV-cache group and direction when staging",
        shown="`64MiB`",
    )
    malloc_trim_interval_s: float = key(
        0.0,
        SECONDS_OR_OFF,
        "seconds between glibc `malloc_trim(0)` calls in the worker process (one daemon thread); "
        "0: off",
    )

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "StoreConnectorConfig":
        """Parse and validate; unknown keys are refused (a typo must not be a silent no-op)."""
        cfg = parse_declared(cls, extra, "HybridStoreConnector")
        if cfg.global_segment_size == 0 and cfg.master_address is None:
            raise ConfigError(
                "kv_connector_extra_config.global_segment_size=0 with an embedded master leaves "
                "the "
                'store with no memory; give a size (e.g. "1GiB") or a master_address of a cluster '
                "whose other nodes contribute memory"
            )
        return cfg


C = TypeVar("C")


def declared_keys(config_cls: type) -> list[Field[Any]]:
    """The fields of ``config_cls`` declared with ``key(...)``, in declaration order."""
    return [f for f in fields(config_cls) if "check" in f.metadata]


def parse_declared(config_cls: type[C], extra: dict[str, Any] | None, connector: str) -> C:
    """``config_cls`` built from ``extra``: unknown keys refused, each given key through its
    check."""
    extra = refuse_unknown_keys(config_cls, extra, connector)
    checks = {f.name: f.metadata.get("check") for f in fields(config_cls)}
    kw = {k: (checks[k].parse(k, v) if checks[k] else v) for k, v in extra.items()}
    return config_cls(**kw)


def default_text(f: Field[Any]) -> str:
    """A key's default as the docs table prints it."""
    if f.metadata.get("shown"):
        return f.metadata["shown"]
    return "`" + json.dumps(f.default if f.default is not MISSING else None) + "`"


def markdown_table(config_cls: type = StoreConnectorConfig) -> str:
    """docs/config.md's table of ``config_cls``'s keys: key, accepted values, default, meaning."""
    lines = ["| key | values | default | meaning |", "|---|---|---|---|"]
    for f in declared_keys(config_cls):
        lines.append(
            f"| `{f.name}` | {f.metadata['check'].kind} | {default_text(f)} | {f.metadata['doc']} |"
        )
    return "\n".join(lines)


def refuse_unknown_keys(
    config_cls: type, extra: dict[str, Any] | None, connector: str
) -> dict[str, Any]:
    """A copy of ``extra``; raises naming every key ``config_cls`` does not declare."""
    extra = dict(extra or {})
    known = {f.name for f in fields(config_cls)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown key(s) {unknown} for {connector}; "
            f"known keys: {sorted(known)}"
        )
    return extra


def refuse_non_tensor_parallelism(parallel: Any, connector: str) -> None:
    """Refuse at startup pipeline and context parallelism (a rank's blocks would hold other
    layers or other tokens, which neither the store's per-rank keys nor P/D's rank plan
    model); any ``--tensor-parallel-size`` works. ``parallel``: vLLM's ParallelConfig."""
    for name in (
        "pipeline_parallel_size",
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
    ):
        size = int(getattr(parallel, name, 1) or 1)
        if size != 1:
            raise ConfigError(
                f"{connector} supports tensor parallelism only in this version: {name}={size}; "
                f"start vLLM with --{name.replace('_', '-')} 1 (any --tensor-parallel-size works)"
            )


def load_failure_policy_warning(policy: str) -> str | None:
    """The startup warning for a ``kv_load_failure_policy`` other than ``recompute``, or None.

    One text for the connector's startup log and ``hybridkv doctor``: with ``fail`` a
    store read that fails (store down, object evicted) fails the request, although the
    store is only a cache and a recompute would give the same answer.
    """
    if policy == "recompute":
        return None
    return (
        f"kv_load_failure_policy={policy!r}: a store read that fails (store down, object evicted) "
        "will "
        'FAIL the request; add "kv_load_failure_policy":"recompute" to --kv-transfer-config to '
        "recompute instead"
    )


if __name__ == "__main__":
    print(markdown_table())
