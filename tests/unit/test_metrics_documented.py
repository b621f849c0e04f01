"""docs/config.md's metrics tables say what each exported store and P/D metric counts, word for
word what the exporter registers as its help text (``COUNTERS`` / ``LATENCIES`` in
connector/store_stats.py and connector/pd_stats.py, and the P/D failure causes), and name no
metric the exporter does not have.

Why: the list in the docs had drifted (``lookup_round_trips`` was exported and not documented);
an operator reading the docs must find every series on /metrics and its meaning.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridkv.connector import pd_stats
from hybridkv.connector.store_stats import COUNTERS, LATENCIES

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
ROW = re.compile(r"^\| `(vllm:hybridkv_store_[a-z_]+)(?:\{[a-z]+\})?` \| (.+) \|$", re.M)
PD_ROW = re.compile(r"^\| `(vllm:hybridkv_pd_[a-z_]+)(?:\{[a-z]+\})?` \| (.+) \|$", re.M)


def documented(row: re.Pattern[str] = ROW) -> dict[str, str]:
    return dict(row.findall(DOC.read_text()))


def test_every_counter_and_latency_is_documented_with_its_help_text():
    rows = documented()
    expected = {f"vllm:hybridkv_store_{n}_total": d for n, d in COUNTERS.items()}
    expected |= {
        f"vllm:hybridkv_store_{n}_latency_seconds": f"histogram: {d}" for n, d in LATENCIES.items()
    }
    missing = {m: d for m, d in expected.items() if rows.get(m) != d}
    assert not missing, f"docs/config.md metrics table lacks or misstates: {missing}"


def test_the_table_names_no_metric_the_exporter_lacks():
    exported = (
        {f"vllm:hybridkv_store_{n}_total" for n in COUNTERS}
        | {f"vllm:hybridkv_store_{n}_latency_seconds" for n in LATENCIES}
        | {"vllm:hybridkv_store_failures_total", "vllm:hybridkv_store_group_hit_tokens_total"}
    )
    assert set(documented()) - exported == set()


def test_every_pd_counter_latency_and_cause_is_documented_with_its_help_text():
    rows = documented(PD_ROW)
    expected = {f"vllm:hybridkv_pd_{n}_total": d for n, d in pd_stats.COUNTERS.items()}
    expected |= {
        f"vllm:hybridkv_pd_{n}_latency_seconds": f"histogram: {d}"
        for n, d in pd_stats.LATENCIES.items()
    }
    causes = ", ".join(f"`{c}` ({d})" for c, d in pd_stats.FAILURE_CAUSES.items())
    expected["vllm:hybridkv_pd_failures_total"] = f"{pd_stats.FAILURES_HELP}; `cause`: {causes}"
    missing = {m: d for m, d in expected.items() if rows.get(m) != d}
    assert not missing, f"docs/config.md P/D metrics table lacks or misstates: {missing}"


def test_the_pd_table_names_no_metric_the_exporter_lacks():
    exported = (
        {f"vllm:hybridkv_pd_{n}_total" for n in pd_stats.COUNTERS}
        | {f"vllm:hybridkv_pd_{n}_latency_seconds" for n in pd_stats.LATENCIES}
        | {"vllm:hybridkv_pd_failures_total"}
    )
    assert set(documented(PD_ROW)) - exported == set()
