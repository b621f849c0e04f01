"""HybridStoreConnector's counters, in vLLM's connector-stats pipeline.

Both sides count (the scheduler: lookups and hit tokens per group; workers:
bytes, latency, failures by cause); vLLM sums them per interval, logs
``reduce()`` and feeds ``observe()`` of the Prometheus class, so users see hit
rates and bytes moved on ``/metrics`` as ``vllm:hybridkv_store_*``.

What the request counters mean: ``lookups``, ``query_tokens``,
``lookup_hits``, ``hit_tokens``, ``hit_tokens.g<id>`` and ``failed_loads`` count
ONE decision per request admission, kept by :class:`RequestLedger`: a lookup's
answer is only remembered (re-asks of a request the scheduler could not admit,
and the dense reference's pre-lookup, replace it); the admission counts the
lookup; the hit counts once the load has really succeeded (a hit granted fewer
tokens counts the tokens granted, a refused or failed load counts in
``failed_loads`` once, whatever the number of workers). What each store round
trip costs is counted separately (``lookup_round_trips``, ``lookup_errors``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from hybridkv.connector.counter_stats import CounterPromMetrics, CounterStats

# Every counter is a plain sum; names are the Prometheus suffixes.
COUNTERS: dict[str, str] = {
    "lookups": "Request admissions that consulted the store (once per admission, not per re-ask)",
    "lookup_hits": "Admissions whose store hit was granted and loaded successfully",
    "lookup_errors": "Lookups that failed (store down or slow) and were treated as misses",
    "lookup_round_trips": "Existence queries sent to the store (what lookups cost)",
    "query_tokens": "Prompt tokens of the admissions counted in lookups",
    "hit_tokens": "Tokens loaded from the store beyond the local prefix cache (granted and loaded)",
    "saved_blocks": "Blocks written to the store",
    "saved_bytes": "Bytes written to the store",
    "save_parts": "Parts of the objects written to the store, trailer excluded (regions back to back in a "
    "block are one part)",
    "save_seconds": "Seconds spent in store writes",
    "loaded_blocks": "Blocks read from the store",
    "loaded_bytes": "Bytes read from the store",
    "load_parts": "Parts of the objects read from the store, trailer excluded (regions back to back in a "
    "block are one part)",
    "load_seconds": "Seconds spent in store reads",
    "failed_loads": "Request loads that failed or were refused (once per request; it recomputes)",
    "rank_failed_loads": "Worker-side loads that failed (once per TP rank of a failed request load)",
    "failed_saves": "Blocks whose write failed",
    "skipped_saves": "Blocks not written: save queue full, the step's synchronous save budget spent, "
    "or the blocks pinned by saves in flight at max_pinned_save_fraction of the KV cache",
    "pin_budget_skipped_jobs": "Save jobs skipped because saves in flight already pinned max_pinned_save_fraction "
    "of the KV cache (a slow or unreachable store)",
    "snapshot_blocks": "Blocks copied before their checksum and write (partial tails still being written)",
    "removed_objects": "Stored objects this instance removed because they failed verification (corrupt, forged)",
    "recent_saves_dropped": "Times the 'saved recently' set was emptied because the master lost its objects",
    "recent_saves_forgotten": "Keys offered for saving again: their save was skipped or failed, their load failed, "
    "or a lookup found them missing (lost by the store: evicted, or a segment dropped)",
    "failed_load_deferrals": "Admissions skipped once after a failed load, so vLLM frees other failed loads' "
    "blocks first (else a stall when several loads fail in one step)",
}

# Latencies (seconds) kept per call, exported as histograms: a sum hides the slow calls.
LATENCIES: dict[str, str] = {
    "lookup": "Scheduler lookup (key building, existence query, hit computation)",
    "load": "One batched store read (up to max_batch_blocks objects)",
    "save": "One batched store write (up to max_batch_blocks objects)",
}
LATENCY_BUCKETS = [
    1e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
]


@dataclass
class HybridStoreStats(CounterStats):
    """``data``: counter name -> value, plus ``fail.<cause>``, ``hit_tokens.g<id>`` and
    ``lat.<kind>`` (a list of per-call seconds)."""

    LATENCY_KINDS: ClassVar[Sequence[str]] = tuple(LATENCIES)

    def reduce(self) -> dict[str, int | float]:
        d, out = self.data, super().reduce()
        if d.get("query_tokens"):
            out["hit_rate"] = round(d.get("hit_tokens", 0) / d["query_tokens"], 4)
        if d.get("load_seconds"):
            out["load_GBps"] = round(d.get("loaded_bytes", 0) / d["load_seconds"] / 1e9, 3)
        if d.get("save_seconds"):
            out["save_GBps"] = round(d.get("saved_bytes", 0) / d["save_seconds"] / 1e9, 3)
        return out


class HybridStorePromMetrics(CounterPromMetrics):
    """``vllm:hybridkv_store_<counter>_total``; causes and groups as labels;
    ``vllm:hybridkv_store_<kind>_latency_seconds`` histograms."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:  # noqa: ANN001
        super().__init__(
            vllm_config,
            metric_types,
            labelnames,
            per_engine_labelvalues,
            prefix="vllm:hybridkv_store_",
            counters=COUNTERS,
            failures_help="Store failures by cause (each falls back to recompute)",
            latencies=LATENCIES,
            buckets=LATENCY_BUCKETS,
            labeled={
                "hit_tokens.g": (
                    "group_hit_tokens",
                    "Tokens served from the store, per KV cache group",
                    "group",
                )
            },
        )


def covered_tokens(
    groups: Sequence[tuple[int, bool]], block_group_ids: Sequence[int], granted_tokens: int
) -> dict[int, int]:
    """Tokens each group's loaded objects really stand for.

    ``groups``: per group id, ``(block_size, is_mamba)``; ``block_group_ids``: the group of
    every object the load moved. An attention block holds ``block_size`` tokens (blocks
    the local cache already had are not loaded and not counted); ONE Mamba state stands
    for every granted token before it (it summarises them), not ``block_size`` per state.
    """
    out: dict[int, int] = {}
    for gid in block_group_ids:
        block_size, is_mamba = groups[gid]
        out[gid] = granted_tokens if is_mamba else out.get(gid, 0) + block_size
    return out


@dataclass
class _Granted:
    query_tokens: int
    tokens: int
    per_group: dict[int, int]


class RequestLedger:
    """One lookup decision per request admission, counted into ``stats`` (see module doc).

    ``stats`` returns the stats object to count into (the scheduler's current one).
    Scheduler-side calls: ``offered`` after every lookup answer, ``admitted`` in
    ``update_state_after_alloc``, ``load_done`` when the workers report the request's load
    (``finished_recving`` / ``failed_recving``: a set over workers, so once per request),
    ``forget`` when the request finishes. State per request is dropped on admission or
    ``forget`` and capped at ``max_requests`` (oldest dropped first).
    """

    def __init__(self, stats: Callable[[], HybridStoreStats], max_requests: int = 1 << 16) -> None:
        self._stats = stats  # a getter: the owner swaps its stats object every interval
        self.max_requests = max_requests
        self._offers: OrderedDict[str, tuple[int, int]] = (
            OrderedDict()
        )  # req -> (query tokens, offered)
        self._granted: OrderedDict[str, _Granted] = OrderedDict()

    def offered(self, req_id: str, query_tokens: int, ext_tokens: int) -> None:
        """A lookup's answer; a later answer for the same request replaces it, nothing counts yet."""
        self._offers[req_id] = (query_tokens, ext_tokens)
        self._offers.move_to_end(req_id)
        self._trim(self._offers)

    def admitted(
        self,
        req_id: str,
        granted_tokens: int,
        per_group: dict[int, int] | None = None,
        refused: bool = False,
    ) -> None:
        """The admission: counts the lookup; a grant waits for its load's outcome.

        ``refused``: the scheduler gave up on the grant before any I/O (counted as a failed load now).
        """
        offer = self._offers.pop(req_id, None)
        if offer is None:
            return  # the store was not consulted for this admission
        self._stats().add("lookups")
        self._stats().add("query_tokens", offer[0])
        if granted_tokens <= 0:
            return
        if refused:
            self._stats().add("failed_loads")
            return
        self._granted[req_id] = _Granted(offer[0], granted_tokens, dict(per_group or {}))
        self._trim(self._granted)

    def load_done(self, req_id: str, ok: bool) -> None:
        """The request's load ended (all workers): a hit, or one failed load."""
        granted = self._granted.pop(req_id, None)
        if granted is None:
            return
        if not ok:
            self._stats().add("failed_loads")
            return
        self._stats().add("lookup_hits")
        self._stats().add("hit_tokens", granted.tokens)
        for gid, tokens in granted.per_group.items():
            self._stats().add(f"hit_tokens.g{gid}", tokens)

    def forget(self, req_id: str) -> None:
        self._offers.pop(req_id, None)
        self._granted.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._offers) + len(self._granted)

    def _trim(self, d: "OrderedDict[str, Any]") -> None:
        while len(d) > self.max_requests:
            d.popitem(last=False)
