"""HybridStoreConnector's counters, in vLLM's connector-stats pipeline.

Both sides count (the scheduler: lookups and hit tokens per group; workers:
bytes, latency, failures by cause); vLLM sums them per interval, logs
``reduce()`` and feeds ``observe()`` of the Prometheus class, so users see hit
rates and bytes moved on ``/metrics`` as ``vllm:hybridkv_store_*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Every counter is a plain sum; names are the Prometheus suffixes.
COUNTERS: dict[str, str] = {
    "lookups": "Store lookups (one batched existence query each)",
    "lookup_hits": "Lookups that found tokens beyond the local prefix cache",
    "lookup_errors": "Lookups that failed (store down or slow) and were treated as misses",
    "query_tokens": "Prompt tokens looked up",
    "hit_tokens": "Tokens the store offered beyond the local prefix cache",
    "saved_blocks": "Blocks written to the store",
    "saved_bytes": "Bytes written to the store",
    "save_seconds": "Seconds spent in store writes",
    "loaded_blocks": "Blocks read from the store",
    "loaded_bytes": "Bytes read from the store",
    "load_seconds": "Seconds spent in store reads",
    "failed_loads": "Request loads that failed (the request recomputes)",
    "failed_saves": "Blocks whose write failed",
}

# Latencies (seconds) kept per call, exported as histograms: a sum hides the slow calls.
LATENCIES: dict[str, str] = {
    "lookup": "Scheduler lookup (key building, existence query, hit computation)",
    "load": "One batched store read (up to max_batch_blocks objects)",
    "save": "One batched store write (up to max_batch_blocks objects)",
}
LATENCY_BUCKETS = [1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class HybridStoreStats(KVConnectorStats):
    """``data``: counter name -> value, plus ``fail.<cause>``, ``hit_tokens.g<id>`` and
    ``lat.<kind>`` (a list of per-call seconds)."""

    data: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, value: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def add_latency(self, kind: str, seconds: float) -> None:
        self.data.setdefault(f"lat.{kind}", []).append(seconds)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(d.items()) if not isinstance(v, list)
        }
        for kind in LATENCIES:
            if d.get(f"lat.{kind}"):
                out[f"{kind}_p50_ms"] = round(1e3 * _percentile(d[f"lat.{kind}"], 0.5), 3)
                out[f"{kind}_p99_ms"] = round(1e3 * _percentile(d[f"lat.{kind}"], 0.99), 3)
        if d.get("query_tokens"):
            out["hit_rate"] = round(d.get("hit_tokens", 0) / d["query_tokens"], 4)
        if d.get("load_seconds"):
            out["load_GBps"] = round(d.get("loaded_bytes", 0) / d["load_seconds"] / 1e9, 3)
        if d.get("save_seconds"):
            out["save_GBps"] = round(d.get("saved_bytes", 0) / d["save_seconds"] / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HybridStorePromMetrics(KVConnectorPromMetrics):
    """``vllm:hybridkv_store_<counter>_total``; causes and groups as labels;
    ``vllm:hybridkv_store_<kind>_latency_seconds`` histograms."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:  # noqa: ANN001
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:hybridkv_store_{name}", documentation=doc, labelnames=labelnames
            )
            for name, doc in COUNTERS.items()
        }
        self._failures = self._counter_cls(
            name="vllm:hybridkv_store_failures",
            documentation="Store failures by cause (each falls back to recompute)",
            labelnames=labelnames + ["cause"],
        )
        self._group_hits = self._counter_cls(
            name="vllm:hybridkv_store_group_hit_tokens",
            documentation="Tokens served from the store, per KV cache group",
            labelnames=labelnames + ["group"],
        )
        self._latencies = {
            kind: self._histogram_cls(
                name=f"vllm:hybridkv_store_{kind}_latency_seconds", documentation=doc,
                buckets=LATENCY_BUCKETS, labelnames=labelnames,
            )
            for kind, doc in LATENCIES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            if key in self._counters:
                self._counters[key].labels(*labels).inc(value)
            elif key.startswith("fail."):
                self._failures.labels(*labels, key[5:]).inc(value)
            elif key.startswith("hit_tokens.g"):
                self._group_hits.labels(*labels, key[len("hit_tokens.g"):]).inc(value)
            elif key.startswith("lat.") and key[4:] in self._latencies:
                histogram = self._latencies[key[4:]].labels(*labels)
                for seconds in value:
                    histogram.observe(seconds)
