"""HybridPDConnector's counters, in vLLM's connector-stats pipeline.

They show on ``/metrics`` what the provenance log lines say one request at a time: how many
requests really got their KV over NIXL, how many fell back to recompute and why, how long
the reads took and how many descriptors they posted (``read_descriptors``, against the
``read_regions`` before coalescing). Shaped like
:mod:`hybridkv.connector.store_stats`: the workers count (the scheduler side counts
nothing), vLLM sums every worker's stats per interval, logs ``reduce()`` and feeds
``observe()`` of the Prometheus class, so they show as ``vllm:hybridkv_pd_*``.

Counted per TP rank: each decode rank reads its own share of a request, so with
``--tensor-parallel-size`` > 1 ``reads`` (and ``failed_reads``) count once per rank per
request, and ``read_blocks`` / ``read_bytes`` are each rank's blocks and bytes (a rank
reading several prefill ranks counts each of its blocks once, its bytes from all of them).
Prefill ranks count their leases (one per request handed over, on every rank) the same way.
Decode side: ``reads`` + ``failed_reads`` = the read jobs this rank ran (release-only jobs,
where decode reads nothing, count in neither); a failed one is counted once, with its cause
in ``fail.<cause>`` (so the causes sum to ``failed_reads``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from hybridkv.connector.counter_stats import CounterPromMetrics, CounterStats

# Every counter is a plain sum; names are the Prometheus suffixes.
COUNTERS: dict[str, str] = {
    "reads": "Decode: requests whose KV this rank read and used (READs done, every lease claim granted; "
    "once per TP rank per request)",
    "read_blocks": "Decode: blocks this rank read for the requests counted in reads, summed over KV cache groups",
    "read_bytes": "Decode: bytes this rank's READs moved for the requests counted in reads",
    "read_descriptors": "Decode: NIXL descriptors the READs counted in reads posted (coalesced: one per run of "
    "blocks contiguous on both sides, per region)",
    "read_regions": "Decode: (block, region) pairs those READs covered before coalescing",
    "read_seconds": "Decode: seconds the reads counted in reads took on their read thread (handshake with a "
    "new peer, READs, lease claims, release)",
    "failed_reads": "Decode: requests whose read on this rank failed, timed out, was refused or discarded "
    "(no KV used: the request recomputes or fails per kv_load_failure_policy)",
    "timed_out_reads": "Decode: reads counted in failed_reads whose READs did not finish within read_timeout_s",
    "leases": "Prefill: requests this rank holds blocks for until the decode side reads them (one lease each)",
    "leases_released": "Prefill: leases ended because every decode rank reading this rank released them "
    "(their blocks freed)",
    "leases_expired": "Prefill: leases that expired (lease_s) before every decode rank reading this rank "
    "released them: read never came, failed, or its release was lost (their blocks freed)",
}

# Why a read failed (``fail.<cause>``, the ``cause`` label); each is also counted in ``failed_reads``.
FAILURE_CAUSES: dict[str, str] = {
    "TransferTimeout": "the READs did not finish within read_timeout_s; also counted in timed_out_reads",
    "TransferError": "a READ could not be posted or failed, or the prefill rank's NIXL agent could not be added",
    "LeaseRefused": "the prefill side refused the lease claim after the READ: expired, claimed before or "
    "unknown; the bytes are discarded",
    "HandshakeError": "the side channel failed: no or a bad answer to the handshake or lease claim, or the "
    "handshake refused the peer's layout",
    "plan": "a TP plan, span or KV layout the two sides cannot serve",
    "refused": "the scheduler refused the request's hand-over: kv_transfer_params or KV cache groups",
    "crash": "an unexpected error in the read",
}
FAILURES_HELP = "Failed P/D reads by cause (each counted in failed_reads too)"

# Latencies (seconds) kept per call, exported as histograms: a sum hides the slow calls.
LATENCIES: dict[str, str] = {
    "read": "Decode: one request's successful read on one rank (as in read_seconds)",
}
# Up to read_timeout_s's default (30 s); a read also waits for a new peer's handshake (5 s).
LATENCY_BUCKETS = [
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
    30.0,
    60.0,
]


@dataclass
class HybridPDStats(CounterStats):
    """``data``: counter name -> value, plus ``fail.<cause>`` and ``lat.<kind>`` (a list of
    per-call seconds)."""

    LATENCY_KINDS: ClassVar[Sequence[str]] = tuple(LATENCIES)

    def reduce(self) -> dict[str, int | float]:
        d, out = self.data, super().reduce()
        if d.get("read_seconds"):
            out["read_GBps"] = round(d.get("read_bytes", 0) / d["read_seconds"] / 1e9, 3)
        return out


class HybridPDPromMetrics(CounterPromMetrics):
    """``vllm:hybridkv_pd_<counter>_total``; failures by cause as a label;
    ``vllm:hybridkv_pd_<kind>_latency_seconds`` histograms."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:  # noqa: ANN001
        super().__init__(
            vllm_config,
            metric_types,
            labelnames,
            per_engine_labelvalues,
            prefix="vllm:hybridkv_pd_",
            counters=COUNTERS,
            failures_help=FAILURES_HELP,
            latencies=LATENCIES,
            buckets=LATENCY_BUCKETS,
        )
