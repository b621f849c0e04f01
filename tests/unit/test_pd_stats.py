"""HybridPDConnector's metrics (connector/pd_stats.py): exact sums, exact Prometheus samples,
and the counts PDWorker's real read function makes.

The read tests run ``PDWorker._read`` itself through its read loop; only what lies under it is
FAKE: the NIXL transport (``FakeTransport``: READs done at once or never, with the byte counts
a real ``ReadHandle`` carries), the peer lookup and the side channel's claim / release (no
prefill process). Decode TP1 reads a TP2 prefill here, so one request is TWO READs: a count
over only one of them is wrong. What each test was shown to fail on is in its docstring.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import prometheus_client
import pytest
from vllm.config import KVTransferConfig, VllmConfig

import hybridkv.connector.pd_worker as pd_worker
from hybridkv.connector import pd_stats
from hybridkv.connector.pd_connector import HybridPDConnector
from hybridkv.connector.pd_handshake import LeaseRefused
from hybridkv.connector.pd_metadata import Lease, PDConnectorMetadata, ReadJob
from hybridkv.connector.pd_stats import HybridPDPromMetrics, HybridPDStats
from hybridkv.connector.pd_transport import ReadHandle, TransferTimeout
from hybridkv.connector.pd_worker import PDWorker, PDWorkerSettings

LABELS = ["model_name", "engine"]


# ------------------------------------------------------------------- the stats object
def test_aggregate_sums_counters_and_concatenates_latencies_exactly() -> None:
    a = HybridPDStats()
    a.add("reads")
    a.add("read_bytes", 1000)
    a.add("fail.TransferTimeout")
    a.add_latency("read", 0.5)
    b = HybridPDStats(
        data={"reads": 2, "read_bytes": 234, "failed_reads": 1, "lat.read": [0.25, 1.0]}
    )
    assert a.aggregate(b) is a
    assert a.data == {
        "reads": 3,
        "read_bytes": 1234,
        "fail.TransferTimeout": 1,
        "failed_reads": 1,
        "lat.read": [0.5, 0.25, 1.0],
    }
    assert b.data == {
        "reads": 2,
        "read_bytes": 234,
        "failed_reads": 1,
        "lat.read": [0.25, 1.0],
    }  # untouched


def test_reduce_reports_sums_percentiles_and_throughput_exactly() -> None:
    s = HybridPDStats(
        data={
            "reads": 4,
            "read_bytes": 3_000_000_000,
            "read_seconds": 1.5,
            "fail.LeaseRefused": 1,
            "lat.read": [0.004, 0.001, 0.003, 0.002],
        }
    )
    assert s.reduce() == {
        "fail.LeaseRefused": 1,
        "read_bytes": 3_000_000_000,
        "read_seconds": 1.5,
        "reads": 4,
        "read_p50_ms": 3.0,
        "read_p99_ms": 4.0,
        "read_GBps": 2.0,
    }


def test_empty_and_reset() -> None:
    s = HybridPDStats()
    assert s.is_empty()
    s.add("leases_expired")
    assert not s.is_empty()
    s.reset()
    assert s.is_empty() and s.data == {}
    assert HybridPDStats(data={"lat.read": []}).is_empty()


def test_the_connector_rebuilds_its_stats_and_its_prometheus_class() -> None:
    rebuilt = HybridPDConnector.build_kv_connector_stats({"reads": 2, "lat.read": [0.1]})
    assert isinstance(rebuilt, HybridPDStats) and rebuilt.data == {"reads": 2, "lat.read": [0.1]}
    assert HybridPDConnector.build_kv_connector_stats().data == {}
    prom = HybridPDConnector.build_prom_metrics(
        VllmConfig(), _private_types(prometheus_client.CollectorRegistry()), LABELS, {0: ["m", "0"]}
    )
    assert isinstance(prom, HybridPDPromMetrics)


# ------------------------------------------------------------------------ Prometheus
def _private_types(registry: prometheus_client.CollectorRegistry) -> dict:
    def scoped(cls):  # noqa: ANN001, ANN202 - register into a private registry
        return lambda *args, **kw: cls(*args, registry=registry, **kw)

    return {
        t: scoped(t)
        for t in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)
    }


def _samples(registry: prometheus_client.CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in registry.collect()
        for s in metric.samples
    }


def test_prometheus_counters_causes_and_histogram_take_exact_values() -> None:
    """Shown to fail: the failures counter without its ``cause`` label value (a fixed label)."""
    registry = prometheus_client.CollectorRegistry()
    prom = HybridPDPromMetrics(
        VllmConfig(), _private_types(registry), LABELS, {0: ["m", "0"], 1: ["m", "1"]}
    )
    prom.observe(
        {
            "reads": 3,
            "read_blocks": 27,
            "read_bytes": 1234,
            "failed_reads": 2,
            "timed_out_reads": 1,
            "fail.TransferTimeout": 1,
            "fail.LeaseRefused": 1,
            "leases_expired": 0,
            "lat.read": [0.003, 0.2, 7.0],
        },
        0,
    )
    prom.observe({"reads": 1, "fail.TransferTimeout": 2, "lat.read": [0.5]}, 1)
    got = _samples(registry)

    def at(name: str, engine: str = "0", **labels: str) -> float:
        return got[(name, tuple(sorted({"model_name": "m", "engine": engine, **labels}.items())))]

    assert at("vllm:hybridkv_pd_reads_total") == 3
    assert at("vllm:hybridkv_pd_reads_total", "1") == 1
    assert at("vllm:hybridkv_pd_read_blocks_total") == 27
    assert at("vllm:hybridkv_pd_read_bytes_total") == 1234
    assert at("vllm:hybridkv_pd_failed_reads_total") == 2
    assert at("vllm:hybridkv_pd_timed_out_reads_total") == 1
    assert at("vllm:hybridkv_pd_failures_total", cause="TransferTimeout") == 1
    assert at("vllm:hybridkv_pd_failures_total", cause="LeaseRefused") == 1
    assert at("vllm:hybridkv_pd_failures_total", "1", cause="TransferTimeout") == 2
    failures = {k for k in got if k[0] == "vllm:hybridkv_pd_failures_total"}
    assert len(failures) == 3  # no other cause (and no series for a cause never seen)
    with pytest.raises(KeyError):
        at("vllm:hybridkv_pd_leases_expired_total")  # a zero is not observed: no series yet
    assert at("vllm:hybridkv_pd_read_latency_seconds_count") == 3
    assert at("vllm:hybridkv_pd_read_latency_seconds_sum") == pytest.approx(7.203)
    assert at("vllm:hybridkv_pd_read_latency_seconds_bucket", le="0.25") == 2
    assert at("vllm:hybridkv_pd_read_latency_seconds_bucket", le="10.0") == 3
    assert at("vllm:hybridkv_pd_read_latency_seconds_count", "1") == 1
    help_text = {m.name: m.documentation for m in registry.collect()}
    assert help_text["vllm:hybridkv_pd_read_bytes"] == pd_stats.COUNTERS["read_bytes"]
    assert help_text["vllm:hybridkv_pd_failures"] == pd_stats.FAILURES_HELP


def test_every_cause_the_worker_counts_is_a_documented_cause() -> None:
    """The ``cause`` values are the ones docs/config.md lists (FAILURE_CAUSES), read off the
    worker's source: a new except branch with a new cause must be documented."""
    source = Path(pd_worker.__file__).read_text()
    calls = re.findall(r"self\._failed\((.+?)\)\n", source)
    causes = {c for call in calls for c in re.findall(r'"([A-Za-z]+)"', call)}
    assert causes == set(pd_stats.FAILURE_CAUSES), (causes, calls)


def test_under_multiconnector_the_stats_are_rebuilt_by_class_name_and_exported() -> None:
    """vLLM's MultiConnector keys its children's stats by class name; across processes it rebuilds
    them through the connector registry by that name (our plugin registers it), and exports them
    through the child's own Prometheus class."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from hybridkv.connector.plugin import register

    register()
    rebuilt = MultiConnector.build_kv_connector_stats(
        {
            "HybridPDConnector": {"reads": 2, "read_bytes": 10, "lat.read": [0.1, 0.2]},
            "HybridStoreConnector": {"lookups": 1},
        }
    )
    pd = rebuilt.data["HybridPDConnector"]
    assert isinstance(pd, HybridPDStats) and pd.data == {
        "reads": 2,
        "read_bytes": 10,
        "lat.read": [0.1, 0.2],
    }
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "connectors": [
                    {"kv_connector": "HybridStoreConnector", "kv_role": "kv_both"},
                    {"kv_connector": "HybridPDConnector", "kv_role": "kv_both"},
                ]
            },
        )
    )
    registry = prometheus_client.CollectorRegistry()
    prom = MultiConnector.build_prom_metrics(
        config, _private_types(registry), LABELS, {0: ["m", "0"]}
    )
    prom.observe(rebuilt.to_dict(), 0)
    got = _samples(registry)
    e0 = (("engine", "0"), ("model_name", "m"))  # sorted label items
    assert got[("vllm:hybridkv_pd_reads_total", e0)] == 2
    assert got[("vllm:hybridkv_pd_read_latency_seconds_count", e0)] == 2
    assert got[("vllm:hybridkv_store_lookups_total", e0)] == 1


# ------------------------------------------------------- through PDWorker's read function
HANDLE_BYTES = {0: 1000, 1: 234}  # the READ from prefill rank 0, from prefill rank 1


class FakeTransport:
    """FAKE NIXL transport: READs from each prefill rank with ``HANDLE_BYTES`` bytes; done at
    once, or (``stuck``) never done within the wait, then DONE for the straggler drain."""

    def __init__(self, stuck: bool = False) -> None:
        self.stuck, self.waits = stuck, 0

    def read_blocks(self, peer, remote_block_ids, local_block_ids, slices=None):  # noqa: ANN001, ANN201
        rank = int(peer.rsplit("-", 1)[1])
        return ReadHandle(peer=peer, num_descs=1, nbytes=HANDLE_BYTES[rank], num_regions=3)

    def wait(self, handle: ReadHandle, timeout_s: float) -> None:
        self.waits += 1
        if self.stuck:
            raise TransferTimeout(f"FAKE: READ from {handle.peer} not done after {timeout_s} s")

    def poll(self, handle: ReadHandle) -> str:
        return "PROC" if self.stuck else "DONE"

    def release(self, handle: ReadHandle) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _worker(monkeypatch, transport: FakeTransport, claim=None) -> PDWorker:  # noqa: ANN001
    monkeypatch.setattr(PDWorker, "_peer", lambda self, job, rank: (f"FAKE-prefill-{rank}", None))
    monkeypatch.setattr(PDWorker, "_slices", lambda self, part, peer_layout, job: None)
    monkeypatch.setattr(
        pd_worker, "claim_lease", claim or (lambda *a, **k: 10.0)
    )  # FAKE side channel
    monkeypatch.setattr(pd_worker, "release_blocks", lambda *a, **k: None)
    # decode TP1, 4 KV heads; the prefill instance runs TP2: two READs per request
    worker = PDWorker(
        PDWorkerSettings("decode", 0, 1, "127.0.0.1", 0, 1.0, 0.5, total_kv_heads=4), None
    )
    worker._transport = transport
    worker._local = object()  # registered (only its presence is checked on this path)
    return worker


def _job(req: str) -> ReadJob:
    # 3 blocks of group 0, 1 of group 1: read_blocks 4
    return ReadJob(
        req,
        f"p-{req}",
        "prefill",
        "10.0.0.1",
        1000,
        [[1, 2, 3], [7]],
        [[4, 5, 6], [8]],
        lease_id="0" * 32,
        remote_ports=[1000, 1001],
    )


def _read(worker: PDWorker, *jobs: ReadJob) -> None:
    worker.start_load_kv(PDConnectorMetadata(reads=list(jobs)))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with worker._lock:
            if {j.req_id for j in jobs} <= worker._recv_done:
                return
        time.sleep(0.01)
    raise AssertionError("the reads did not end")


def test_a_successful_read_counts_the_provenance_lines_numbers(monkeypatch, vllm_caplog) -> None:
    """Shown to fail: bytes of only the first READ counted (1000, not 1234); blocks of only the
    first group (3, not 4); the read counted before its lease claims (a discarded read then
    counts as a read, see the next test)."""
    worker = _worker(monkeypatch, FakeTransport())
    try:
        with vllm_caplog.at_level(logging.INFO, logger="vllm.hybridkv.connector.pd_worker"):
            _read(worker, _job("ok"))
        stats = worker.take_stats()
        assert stats is not None
        seconds = stats.data.pop("read_seconds")
        assert stats.data.pop("lat.read") == [seconds] and seconds > 0
        assert stats.data == {
            "reads": 1,
            "read_blocks": 4,
            "read_bytes": 1234,
            "read_descriptors": 2,
            "read_regions": 6,
        }
        (line,) = [
            r.getMessage() for r in vllm_caplog.records if "hybridkv P/D: read " in r.getMessage()
        ]
        assert line.startswith("hybridkv P/D: read 4 blocks (1234 bytes) for ok "), line
        assert worker.take_stats() is None  # taken: the next interval starts empty
    finally:
        worker.shutdown()


def test_a_timed_out_read_counts_one_failure_and_no_read(monkeypatch) -> None:
    """Shown to fail: failed_reads counted per READ (2, not 1); the timeout counted only as
    ``TransferError``."""
    worker = _worker(monkeypatch, FakeTransport(stuck=True))
    try:
        _read(worker, _job("slow"))
        stats = worker.take_stats()
        assert stats is not None
        assert stats.data == {"failed_reads": 1, "timed_out_reads": 1, "fail.TransferTimeout": 1}
        assert worker.unsettled_reads() == 1  # kept: its READs may still write
    finally:
        worker.shutdown()


def test_a_refused_claim_and_a_refused_job_count_as_failures_by_cause(monkeypatch) -> None:
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003 - FAKE: the prefill side says the lease expired
        raise LeaseRefused("FAKE: the lease on its blocks has expired")

    worker = _worker(monkeypatch, FakeTransport(), claim=refuse)
    try:
        refused = ReadJob("bad", "", "", "", 0, [], [], refused="FAKE: kv_transfer_params refused")
        _read(worker, _job("late"), refused)
        stats = worker.take_stats()
        assert stats is not None
        assert stats.data == {"failed_reads": 2, "fail.LeaseRefused": 1, "fail.refused": 1}
    finally:
        worker.shutdown()


def test_prefill_leases_count_issued_released_and_expired(monkeypatch) -> None:
    """Shown to fail: an expired lease counted as released (the two branches swapped); a
    renewed lease (same request, still held) counted twice (leases 4: never ends as often)."""
    worker = PDWorker(PDWorkerSettings("prefill", 0, 1, "127.0.0.1", 0, 1.0, 1.0), None)
    try:
        worker.start_load_kv(
            PDConnectorMetadata(
                leases=[
                    Lease("read", "a" * 32, 60.0),
                    Lease("never", "b" * 32, 0.05),
                    Lease("kept", "c" * 32, 60.0),
                ]
            )
        )
        worker.start_load_kv(PDConnectorMetadata(leases=[Lease("kept", "d" * 32, 60.0)]))  # renewed
        worker._released_by_decode(["read"])
        time.sleep(0.1)
        assert worker.get_transfer_results().finished_sending == {"read", "never"}
        stats = worker.take_stats()
        assert stats is not None
        assert stats.data == {"leases": 3, "leases_released": 1, "leases_expired": 1}
    finally:
        worker.shutdown()
