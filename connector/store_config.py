"""``kv_connector_extra_config`` of HybridStoreConnector, validated once at startup.

Why a module of its own: a typo in a JSON config line must be refused when the
engine starts, naming the key and the fix, not discovered as a silent miss (an
unknown key ignored) or a crash mid-request. Every key the connector reads is
declared here with its type, default and meaning; nothing else reads the dict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as ``"512MiB"`` / ``"2GB"`` (binary units)."""
    if isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: expected a size such as 1073741824 or \"1GiB\"")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = (m.group(2) or "").upper().replace("I", "").replace("B", "")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(
            f"kv_connector_extra_config.{key}={value!r}: expected a size in bytes "
            "(an integer) or a string such as \"512MiB\" / \"2GiB\""
        )
    if n < 0:
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: must be >= 0")
    return n


@dataclass(frozen=True)
class StoreConnectorConfig:
    """Validated settings; field docs are what ``--help``-style errors print."""

    # host:port of an existing mooncake_master; None starts an embedded one on 127.0.0.1.
    master_address: str | None = None
    # Memory this engine contributes to the store (holds other engines' objects too).
    # 512 MiB: on the 2-core CI machine a 1 GiB segment next to a 1 GiB CPU KV cache made
    # store reads in the worker take 2-5 s (the same client alone: 2 ms); see the README.
    global_segment_size: int = 512 << 20
    # Client staging buffer for small objects.
    local_buffer_size: int = 16 << 20
    # Mooncake transfer protocol: "tcp" (works everywhere) or "rdma".
    protocol: str = "tcp"
    # RDMA device list for protocol "rdma" (comma separated), "" = auto.
    rdma_devices: str = ""
    # Address other store nodes use to reach this engine's segment.
    local_hostname: str = "127.0.0.1"
    # Mooncake 0.3.13 binds its store client's handshake and data listeners to ALL interfaces
    # with no setting; hybridkv rebinds them to local_hostname by interposing bind() in
    # Mooncake's own libraries (store/mooncake_backend.pin_listeners). false: leave them as
    # Mooncake opens them (then firewall their ports), e.g. if the interposer misbehaves.
    pin_mooncake_listeners: bool = True
    # Fault the whole global segment in at start (madvise MADV_POPULATE_WRITE): the engine's
    # RSS includes global_segment_size from the beginning instead of growing up to it as
    # objects land in the segment (e.g. a dead node's objects saved again here). false: pages
    # become resident on first write (memory committed lazily).
    populate_segment: bool = True
    # Nice level (0-19) of the threads that wait for store reads. Mooncake 0.3.13 polls for a
    # read's completion on the waiting thread (a busy loop for as long as the read takes), so
    # a read from a slow peer takes a core from the forward pass and from the peer serving it;
    # at 19 the poll only gets CPU nothing else wants. 0: normal priority.
    read_wait_nice: int = 19
    # Bound on any one store call (seconds); a dead store costs at most this per request.
    timeout_s: float = 5.0
    # Bound on the scheduler's existence query (seconds); on expiry the lookup is a miss.
    lookup_timeout_s: float = 1.0
    # Also save blocks filled during decode (agentic turns re-send the answer).
    save_decode: bool = True
    # Prefix mixed into every key. Names, it does not isolate: anyone reaching the master
    # can read or write any key; tenants are kept apart only with auth_secret_file too
    # (docs/security.md, Store).
    namespace: str = ""
    # The deployment secret that MACs every stored object (the P/D secret, found the same
    # way: this file, else $HYBRIDKV_AUTH_SECRET_FILE, else $HYBRIDKV_AUTH_SECRET). Unset
    # and none in the environment: objects carry XXH3 only (a writer who reaches the
    # master can plant loadable objects), logged at startup.
    auth_secret_file: str = ""
    # Master lease TTL for the embedded master (ms); must exceed the slowest batch transfer.
    embedded_lease_ttl_ms: int = 30_000
    # Max blocks per store batch call (bounds one call's bytes and latency).
    max_batch_blocks: int = 256
    # Share of the KV cache's blocks that saves in flight may pin (a pinned block waits for
    # its put before vLLM may reuse it); beyond it a step's save job is skipped and counted.
    # Bounds what a slow or unreachable store node can take from new requests.
    max_pinned_save_fraction: float = 0.5
    # Seconds a lookup's answer is reused when the scheduler re-asks for a request it could
    # not admit yet (0: always ask the store).
    lookup_cache_s: float = 1.0
    # Debugging: append "<key> <group> <bytes>" of every object this worker writes to this file.
    key_log_path: str = ""
    # How blocks reach the store: "auto" = zero-copy from a host KV cache, through a host
    # staging buffer (BlockStager) from a GPU one; "always" = stage even a host cache (the
    # GPU path's logic, testable on a CPU engine; objects are byte-identical either way).
    staging: str = "auto"
    # Host staging memory per KV-cache group and direction (load, save) when staging.
    staging_buffer_size: int = 64 << 20
    # Seconds between glibc malloc_trim(0) calls in the worker process (one daemon thread per
    # StoreWorker, i.e. per engine worker process; store/malloc_trim.py): hands freed heap pages back to the kernel, which glibc
    # otherwise keeps (issue 14: the worker's RSS crept +5 % after warm-up without, +0.7 %
    # with 10 s; a call took 11 ms p50, 28 ms max). 0: off. No effect without glibc.
    malloc_trim_interval_s: float = 0.0

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "StoreConnectorConfig":
        """Parse and validate; unknown keys are refused (a typo must not be a silent no-op)."""
        extra = refuse_unknown_keys(cls, extra, "HybridStoreConnector")
        kw: dict[str, Any] = {}
        for key, value in extra.items():
            if key in ("global_segment_size", "local_buffer_size", "staging_buffer_size"):
                kw[key] = parse_size(key, value)
            elif key in ("lookup_cache_s", "malloc_trim_interval_s"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: expected seconds >= 0")
                kw[key] = float(value)
            elif key == "max_pinned_save_fraction":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                    raise ConfigError(
                        f"kv_connector_extra_config.max_pinned_save_fraction={value!r}: expected a share of "
                        "the KV cache in (0, 1], e.g. 0.5"
                    )
                kw[key] = float(value)
            elif key in ("timeout_s", "lookup_timeout_s"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ConfigError(
                        f"kv_connector_extra_config.{key}={value!r}: expected a positive number of seconds"
                    )
                kw[key] = float(value)
            elif key in ("embedded_lease_ttl_ms", "max_batch_blocks"):
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: expected a positive integer")
                kw[key] = value
            elif key == "read_wait_nice":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
                    raise ConfigError(
                        f"kv_connector_extra_config.read_wait_nice={value!r}: expected a nice level from 0 "
                        "(normal priority) to 19 (only CPU nothing else wants)"
                    )
                kw[key] = value
            elif key in ("save_decode", "pin_mooncake_listeners", "populate_segment"):
                if not isinstance(value, bool):
                    raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: expected true or false")
                kw[key] = value
            elif key == "protocol":
                if value not in ("tcp", "rdma"):
                    raise ConfigError(
                        f"kv_connector_extra_config.protocol={value!r}: expected \"tcp\" or \"rdma\""
                    )
                kw[key] = value
            elif key == "staging":
                if value not in ("auto", "always"):
                    raise ConfigError(
                        f"kv_connector_extra_config.staging={value!r}: expected \"auto\" (stage only a GPU "
                        "KV cache) or \"always\""
                    )
                kw[key] = value
            elif key == "master_address":
                if value is not None and not _is_host_port(value):
                    raise ConfigError(
                        f"kv_connector_extra_config.master_address={value!r}: expected \"host:port\" of a "
                        "running mooncake_master, or leave it out to start an embedded master"
                    )
                kw[key] = value
            else:  # plain strings
                if not isinstance(value, str):
                    raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: expected a string")
                kw[key] = value
        cfg = cls(**kw)
        if cfg.staging_buffer_size == 0:
            raise ConfigError("kv_connector_extra_config.staging_buffer_size=0: give room for at least one "
                              "block, e.g. \"64MiB\"")
        if cfg.global_segment_size == 0 and cfg.master_address is None:
            raise ConfigError(
                "kv_connector_extra_config.global_segment_size=0 with an embedded master leaves the "
                "store with no memory; give a size (e.g. \"1GiB\") or a master_address of a cluster "
                "whose other nodes contribute memory"
            )
        return cfg


def refuse_unknown_keys(config_cls: type, extra: dict[str, Any] | None, connector: str) -> dict[str, Any]:
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
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size != 1:
            raise ConfigError(
                f"{connector} supports tensor parallelism only in this version: {name}={size}; "
                f"start vLLM with --{name.replace('_', '-')} 1 (any --tensor-parallel-size works)"
            )


def _is_host_port(value: Any) -> bool:
    if not isinstance(value, str) or ":" not in value:
        return False
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def load_failure_policy_warning(policy: str) -> str | None:
    """The startup warning for a ``kv_load_failure_policy`` other than ``recompute``, or None.

    One text for the connector's startup log and ``hybridkv doctor``: with ``fail`` a
    store read that fails (store down, object evicted) fails the request, although the
    store is only a cache and a recompute would give the same answer.
    """
    if policy == "recompute":
        return None
    return (
        f"kv_load_failure_policy={policy!r}: a store read that fails (store down, object evicted) will "
        "FAIL the request; add \"kv_load_failure_policy\":\"recompute\" to --kv-transfer-config to "
        "recompute instead"
    )
