"""The Grafana dashboard names exactly the series /metrics exposes, and the committed file is current.

Why: a panel over a misspelled series is an empty graph, found when an operator needs
it. The hybridkv series are taken from a real ``HybridStorePromMetrics`` and
``HybridPDPromMetrics`` in a private Prometheus registry after one observe() of every
counter, cause, group and latency (the exact sample names: ``..._total``, ``..._bucket``); vLLM's from the installed
vLLM's own ``vllm/v1/metrics/loggers.py`` (the pass under 0.33's Python checks 0.33's).
Shown to fail: a counter renamed in the dashboard only (``saved_bytes`` ->
``saved_byte``) fails the series check; a counter added to COUNTERS without
regenerating fails the committed-file check.
"""

from __future__ import annotations

import pathlib
import re

import prometheus_client
import pytest
import vllm
from vllm.config import VllmConfig

from hybridkv.cli import grafana
from hybridkv.connector import pd_stats
from hybridkv.connector.store_stats import COUNTERS, LATENCIES, HybridStorePromMetrics

COMMITTED = pathlib.Path(__file__).parents[2] / "docs" / "grafana" / "hybridkv.json"
SERIES = re.compile(r"vllm:[a-z0-9_:]+")


def _exposed_hybridkv_samples() -> set[str]:
    registry = prometheus_client.CollectorRegistry()

    def scoped(cls):  # noqa: ANN001, ANN202 - register into a private registry
        return lambda *args, **kw: cls(*args, registry=registry, **kw)

    types = {
        t: scoped(t)
        for t in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)
    }
    prom = HybridStorePromMetrics(VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"]})
    data = {name: 1 for name in COUNTERS} | {"fail.timeout": 1, "hit_tokens.g0": 1}
    data |= {f"lat.{kind}": [0.01] for kind in LATENCIES}
    prom.observe(data, 0)
    pd = pd_stats.HybridPDPromMetrics(
        VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    pd_data = {name: 1 for name in pd_stats.COUNTERS} | {
        f"fail.{cause}": 1 for cause in pd_stats.FAILURE_CAUSES
    }
    pd.observe(pd_data | {f"lat.{kind}": [0.01] for kind in pd_stats.LATENCIES}, 0)
    return {s.name for metric in registry.collect() for s in metric.samples}


def _vllm_metric_names() -> set[str]:
    source = (pathlib.Path(vllm.__file__).parent / "v1" / "metrics" / "loggers.py").read_text()
    return set(re.findall(r'name="(vllm:[a-z0-9_:]+)"', source))


def _expressions(doc: dict) -> list[str]:
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", ())]


def test_every_series_the_dashboard_reads_is_exposed():
    exposed = _exposed_hybridkv_samples()
    vllm_names = _vllm_metric_names()
    assert set(grafana.VLLM_SERIES) <= vllm_names, set(grafana.VLLM_SERIES) - vllm_names
    unknown = []
    for expr in _expressions(grafana.dashboard()):
        for series in SERIES.findall(expr):
            if series.startswith((grafana.STORE, grafana.PD)):
                ok = series in exposed
            else:  # vLLM's: a counter is read as <name>_total, a histogram as <name>_bucket
                ok = re.sub(r"_(total|bucket)$", "", series) in grafana.VLLM_SERIES
            if not ok:
                unknown.append(series)
    assert unknown == []


def test_every_counter_and_latency_has_a_panel_with_its_description():
    doc = grafana.dashboard()
    by_title = {p["title"]: p for p in doc["panels"]}
    for name, description in COUNTERS.items():
        assert by_title[name]["description"] == description
        assert f"{grafana.STORE}{name}_total" in by_title[name]["targets"][0]["expr"]
    text = " ".join(_expressions(doc))
    for kind in LATENCIES:
        assert f"{grafana.STORE}{kind}_latency_seconds_bucket" in text
    for name, description in pd_stats.COUNTERS.items():
        assert by_title[f"P/D {name}"]["description"] == description
        assert f"{grafana.PD}{name}_total" in by_title[f"P/D {name}"]["targets"][0]["expr"]
    for kind in pd_stats.LATENCIES:
        assert f"{grafana.PD}{kind}_latency_seconds_bucket" in text
    assert f"{grafana.PD}failures_total" in text
    ids = [p["id"] for p in doc["panels"]]
    assert ids == list(range(1, len(ids) + 1))
    for p in doc["panels"]:  # inside the 24-column grid, no two panels on the same cells
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in doc["panels"]]
    assert len(cells) == len(set(cells))


def test_committed_dashboard_is_the_generated_one():
    if COMMITTED.read_text() != grafana.render():
        pytest.fail(
            f"{COMMITTED} is stale: regenerate it with `hybridkv grafana --out {COMMITTED.relative_to(COMMITTED.parents[2])}`"
        )
