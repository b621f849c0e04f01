"""What both connectors' metrics share: plain-sum counters, per-call latencies, failures by cause.

Why one module: HybridStoreConnector (store_stats) and HybridPDConnector (pd_stats) count the
same way into vLLM's connector-stats pipeline (workers and scheduler fill a ``data`` dict,
vLLM sums the dicts per interval with ``aggregate``, logs ``reduce()`` and feeds
``observe()`` of the Prometheus class); each keeps only its names, help texts and derived
figures. ``data`` holds counter name -> value, ``fail.<cause>`` -> count and ``lat.<kind>`` ->
a list of per-call seconds (a sum would hide the slow calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class CounterStats(KVConnectorStats):
    """Counters, ``fail.<cause>`` and ``lat.<kind>`` lists in ``data``; a subclass names its
    latency kinds (``LATENCY_KINDS``: p50 / p99 in ``reduce``) and adds derived figures by
    overriding ``reduce``."""

    data: dict[str, Any] = field(default_factory=dict)
    LATENCY_KINDS: ClassVar[Sequence[str]] = ()

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
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in sorted(d.items())
            if not isinstance(v, list)
        }
        for kind in self.LATENCY_KINDS:
            if d.get(f"lat.{kind}"):
                out[f"{kind}_p50_ms"] = round(1e3 * percentile(d[f"lat.{kind}"], 0.5), 3)
                out[f"{kind}_p99_ms"] = round(1e3 * percentile(d[f"lat.{kind}"], 0.99), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> "CounterStats | None":
        """What was counted since the last take, as a new object of this class, counting on
        from zero here (None: nothing counted). The caller serialises it with its counting."""
        if self.is_empty():
            return None
        taken, self.data = type(self)(data=self.data), {}
        return taken


class CounterPromMetrics(KVConnectorPromMetrics):
    """``<prefix><counter>_total`` per counter, ``<prefix>failures_total{cause}`` from
    ``fail.<cause>``, ``<prefix><kind>_latency_seconds`` histograms from ``lat.<kind>``, and
    any ``labeled`` counters: data key prefix -> (metric suffix, help, label name), the rest
    of the key being the label's value (e.g. ``hit_tokens.g3`` -> ``group="3"``)."""

    def __init__(
        self,
        vllm_config,
        metric_types,
        labelnames,
        per_engine_labelvalues,
        *,  # noqa: ANN001
        prefix: str,
        counters: Mapping[str, str],
        failures_help: str,
        latencies: Mapping[str, str],
        buckets: Sequence[float],
        labeled: Mapping[str, tuple[str, str, str]] | None = None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"{prefix}{name}", documentation=doc, labelnames=labelnames
            )
            for name, doc in counters.items()
        }
        self._labeled = {
            "fail.": self._counter_cls(
                name=f"{prefix}failures",
                documentation=failures_help,
                labelnames=labelnames + ["cause"],
            )
        }
        for key_prefix, (suffix, doc, label) in (labeled or {}).items():
            self._labeled[key_prefix] = self._counter_cls(
                name=f"{prefix}{suffix}", documentation=doc, labelnames=labelnames + [label]
            )
        self._latencies = {
            kind: self._histogram_cls(
                name=f"{prefix}{kind}_latency_seconds",
                documentation=doc,
                buckets=list(buckets),
                labelnames=labelnames,
            )
            for kind, doc in latencies.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            if key in self._counters:
                self._counters[key].labels(*labels).inc(value)
            elif key.startswith("lat.") and key[4:] in self._latencies:
                histogram = self._latencies[key[4:]].labels(*labels)
                for seconds in value:
                    histogram.observe(seconds)
            else:
                for key_prefix, counter in self._labeled.items():
                    if key.startswith(key_prefix):
                        counter.labels(*labels, key[len(key_prefix) :]).inc(value)
                        break
