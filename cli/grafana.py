"""A Grafana dashboard for hybridkv's metrics next to vLLM's own, generated from the code.

Why generated: the panels must name exactly the series ``/metrics`` exposes. The
store's counters and latency histograms come from ``connector/store_stats``, the P/D
connector's from ``connector/pd_stats`` (the same tables the Prometheus classes
register), so a counter added there gets its panel and its description here; the vLLM series are the few an operator reads next to
them (TTFT, queue, KV cache usage, local and connector prefix hit rates), checked
against the installed vLLM's metric names by tests/unit/test_grafana_dashboard.py.

``hybridkv grafana`` prints the JSON; ``docs/grafana/hybridkv.json`` is its output
(``hybridkv grafana --out docs/grafana/hybridkv.json`` regenerates it; import it in
Grafana: Dashboards -> New -> Import; pick the Prometheus data source).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hybridkv.connector import pd_stats
from hybridkv.connector.store_stats import COUNTERS, LATENCIES

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SELECTOR = 'model_name=~"$model_name"'
RATE = "$__rate_interval"
STORE = "vllm:hybridkv_store_"
PD = "vllm:hybridkv_pd_"

# vLLM series this dashboard reads (names as registered in vllm/v1/metrics/loggers.py).
VLLM_SERIES = (
    "vllm:time_to_first_token_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens",
)


def _rate(metric: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group}(rate({metric}{{{SELECTOR}}}[{RATE}]))"


def _ratio(num: str, den: str) -> str:
    return f"{_rate(num)} / clamp_min({_rate(den)}, 1e-9)"


def _quantile(histogram: str, q: float) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{SELECTOR}}}[{RATE}])))"


def _panel(
    title: str,
    targets: list[tuple[str, str]],
    unit: str = "short",
    description: str = "",
    width: int = 8,
) -> dict[str, Any]:
    """One time-series panel; ``targets``: (PromQL, legend)."""
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(65 + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
        "gridPos": {"w": width, "h": 8},
    }


def _row(title: str) -> dict[str, Any]:
    return {
        "type": "row",
        "title": title,
        "collapsed": False,
        "panels": [],
        "gridPos": {"w": 24, "h": 1},
    }


def panels() -> list[dict[str, Any]]:
    """Every panel in order: vLLM, the store's headline panels, then one panel per counter;
    the same for P/D."""
    out = [_row("vLLM (next to hybridkv)")]
    out.append(
        _panel(
            "Time to first token",
            [
                (_quantile("vllm:time_to_first_token_seconds", 0.5), "p50"),
                (_quantile("vllm:time_to_first_token_seconds", 0.99), "p99"),
            ],
            unit="s",
        )
    )
    out.append(
        _panel(
            "Requests",
            [
                (f"sum(vllm:num_requests_running{{{SELECTOR}}})", "running"),
                (f"sum(vllm:num_requests_waiting{{{SELECTOR}}})", "waiting"),
            ],
        )
    )
    out.append(
        _panel(
            "KV cache usage",
            [(f"max(vllm:kv_cache_usage_perc{{{SELECTOR}}})", "usage")],
            unit="percentunit",
        )
    )
    out.append(
        _panel(
            "Prefix hit rate: local vs connector (tokens)",
            [
                (
                    _ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
                    "local prefix cache",
                ),
                (
                    _ratio(
                        "vllm:external_prefix_cache_hits_total",
                        "vllm:external_prefix_cache_queries_total",
                    ),
                    "KV connector (store / P/D)",
                ),
            ],
            unit="percentunit",
            width=12,
        )
    )
    out.append(
        _panel("Prompt tokens", [(_rate("vllm:prompt_tokens_total"), "prompt tokens/s")], width=12)
    )
    out.append(_row("hybridkv store"))
    out.append(
        _panel(
            "Store hit rate",
            [
                (
                    _ratio(f"{STORE}hit_tokens_total", f"{STORE}query_tokens_total"),
                    "tokens loaded / prompt tokens asked",
                ),
                (
                    _ratio(f"{STORE}lookup_hits_total", f"{STORE}lookups_total"),
                    "admissions with a loaded hit",
                ),
            ],
            unit="percentunit",
            description=f"hit_tokens: {COUNTERS['hit_tokens']}; lookup_hits: {COUNTERS['lookup_hits']}",
        )
    )
    out.append(
        _panel(
            "Store bytes",
            [
                (_rate(f"{STORE}saved_bytes_total"), "saved"),
                (_rate(f"{STORE}loaded_bytes_total"), "loaded"),
            ],
            unit="Bps",
        )
    )
    out.append(
        _panel(
            "Fallbacks to recompute, by cause",
            [(_rate(f"{STORE}failures_total", by="cause"), "{{cause}}")],
            description="Store failures by cause (each falls back to recompute)",
        )
    )
    out.append(
        _panel(
            "Tokens served per KV cache group",
            [(_rate(f"{STORE}group_hit_tokens_total", by="group"), "group {{group}}")],
            width=12,
        )
    )
    out.append(
        _panel(
            "Store call latency",
            [
                target
                for kind in LATENCIES
                for target in (
                    (_quantile(f"{STORE}{kind}_latency_seconds", 0.5), f"{kind} p50"),
                    (_quantile(f"{STORE}{kind}_latency_seconds", 0.99), f"{kind} p99"),
                )
            ],
            unit="s",
            width=12,
            description="; ".join(f"{k}: {v}" for k, v in LATENCIES.items()),
        )
    )
    out.append(_row("hybridkv store: every counter (per second)"))
    for name, doc in COUNTERS.items():
        out.append(_panel(name, [(_rate(f"{STORE}{name}_total"), name)], description=doc, width=6))
    return out + pd_panels()


def pd_panels() -> list[dict[str, Any]]:
    """HybridPDConnector's panels (decode: reads; prefill: leases), from ``connector/pd_stats``."""
    c = pd_stats.COUNTERS
    out = [_row("hybridkv P/D")]
    out.append(
        _panel(
            "P/D reads",
            [
                (_rate(f"{PD}reads_total"), "read and used"),
                (_rate(f"{PD}failed_reads_total"), "failed"),
                (_rate(f"{PD}timed_out_reads_total"), "timed out"),
            ],
            description=f"reads: {c['reads']}; failed_reads: {c['failed_reads']}",
        )
    )
    out.append(
        _panel(
            "P/D bytes read",
            [(_rate(f"{PD}read_bytes_total"), "read")],
            unit="Bps",
            description=c["read_bytes"],
        )
    )
    out.append(
        _panel(
            "P/D failed reads, by cause",
            [(_rate(f"{PD}failures_total", by="cause"), "{{cause}}")],
            description="; ".join(
                [pd_stats.FAILURES_HELP] + [f"{k}: {v}" for k, v in pd_stats.FAILURE_CAUSES.items()]
            ),
        )
    )
    out.append(
        _panel(
            "P/D read latency",
            [
                target
                for kind in pd_stats.LATENCIES
                for target in (
                    (_quantile(f"{PD}{kind}_latency_seconds", 0.5), f"{kind} p50"),
                    (_quantile(f"{PD}{kind}_latency_seconds", 0.99), f"{kind} p99"),
                )
            ],
            unit="s",
            width=12,
            description="; ".join(f"{k}: {v}" for k, v in pd_stats.LATENCIES.items()),
        )
    )
    out.append(
        _panel(
            "P/D leases (prefill)",
            [
                (_rate(f"{PD}leases_total"), "issued"),
                (_rate(f"{PD}leases_released_total"), "released"),
                (_rate(f"{PD}leases_expired_total"), "expired"),
            ],
            width=12,
            description=f"leases_expired: {c['leases_expired']}",
        )
    )
    out.append(_row("hybridkv P/D: every counter (per second)"))
    for name, doc in c.items():
        out.append(
            _panel(f"P/D {name}", [(_rate(f"{PD}{name}_total"), name)], description=doc, width=6)
        )
    return out


def _layout(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give each panel an id and a position (left to right, wrapping at 24 columns)."""
    x = y = row_h = 0
    for i, item in enumerate(items, start=1):
        pos = item["gridPos"]
        if item["type"] == "row" or x + pos["w"] > 24:
            x, y, row_h = 0, y + row_h, 0
        pos.update(x=x, y=y)
        item["id"] = i
        x, row_h = x + pos["w"], max(row_h, pos["h"])
        if item["type"] == "row":
            x, y, row_h = 0, y + pos["h"], 0
    return items


def dashboard() -> dict[str, Any]:
    """The whole dashboard (Grafana JSON model)."""
    return {
        "title": "hybridkv + vLLM",
        "uid": "hybridkv",
        "description": "hybridkv's KV connector metrics (vllm:hybridkv_store_*, vllm:hybridkv_pd_*) next to "
        "vLLM's. Generated by `hybridkv grafana` from connector/store_stats.py and "
        "connector/pd_stats.py.",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "tags": ["vllm", "hybridkv"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                },
                {
                    "name": "model_name",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "label": "model",
                    "query": "label_values(vllm:num_requests_running, model_name)",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "panels": _layout(panels()),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1, sort_keys=True) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="write the JSON to this file instead of standard output")


def run_from_args(args: argparse.Namespace) -> int:
    text = render()
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0
