"""cli/harness/stall_cpu.py: the soak's stall attribution finds exactly the windows with no answered
turn and charges each process the CPU it used across them (from the samples bracketing it)."""

from __future__ import annotations

import os
import subprocess
import sys

from hybridkv.cli.harness.stall_cpu import describe, machine_times, process_cpu_s, stalls


def _row(t: float, busy: float, steal: float, worker: float, harness: float) -> dict:
    return {
        "t": t,
        "busy": busy,
        "idle": 2 * t - busy - steal,
        "iowait": 0.0,
        "steal": steal,
        "procs": {"prefill/VLLM::Worker[7]": worker, "harness/python[1]": harness},
    }


def test_a_gap_is_charged_from_the_samples_around_it() -> None:
    records = [
        {"ok": True, "t": 0.0, "latency_s": 5.0},
        {"ok": True, "t": 1.0, "latency_s": 5.5},
        {"ok": False, "t": 8.0, "latency_s": 1.0},  # a failed turn answers nothing
        {"ok": True, "t": 6.0, "latency_s": 15.0},
    ]  # answered at 21 s: the gap is 6.5 -> 21
    rows = [
        _row(6.0, 10.0, 0.0, 3.0, 1.0),
        _row(7.0, 12.0, 0.0, 4.0, 1.0),
        _row(20.0, 38.0, 0.5, 29.0, 1.1),
        _row(22.0, 42.0, 0.5, 31.0, 1.2),
    ]
    [gap] = stalls(records, rows)
    assert (gap["from_s"], gap["to_s"], gap["window_s"]) == (
        6.5,
        21.0,
        16.0,
    )  # samples at 6 and 22 bracket it
    assert (gap["busy"], gap["steal"]) == (32.0, 0.5)
    assert gap["top"] == [("prefill/VLLM::Worker[7]", 28.0), ("harness/python[1]", 0.2)]
    assert gap["longest_sample_gap_s"] == 13.0
    assert "prefill/VLLM::Worker[7] 28 s" in describe([gap])[0]


def test_a_process_restarted_inside_a_gap_keeps_its_cpu_and_edges_count() -> None:
    records = [{"ok": True, "t": 0.0, "latency_s": 1.0}]  # then nothing is answered until the end
    old, new = "prefill/VLLM::Worker[7]", "prefill/VLLM::Worker[9]"
    rows = [
        {"t": 0.5, "busy": 1.0, "idle": 0.0, "iowait": 0.0, "steal": 0.0, "procs": {old: 1.0}},
        {
            "t": 5.0,
            "busy": 9.0,
            "idle": 0.0,
            "iowait": 0.0,
            "steal": 0.0,
            "procs": {old: 6.0},
        },  # last seen
        {"t": 20.0, "busy": 39.0, "idle": 0.0, "iowait": 0.0, "steal": 0.0, "procs": {new: 25.0}},
    ]
    [gap] = stalls(records, rows)
    assert (gap["from_s"], gap["to_s"]) == (
        1.0,
        20.0,
    )  # the run's last sample closes the last window
    assert dict(gap["top"]) == {new: 25.0, old: 5.0}


def test_no_gap_under_the_threshold() -> None:
    records = [{"ok": True, "t": float(i), "latency_s": 1.0} for i in range(30)]
    assert stalls(records, [_row(float(i), i, 0.0, i, i) for i in range(31)]) == []


def test_proc_readers() -> None:
    m = machine_times()
    assert set(m) == {"busy", "idle", "iowait", "steal"} and m["busy"] > 0
    assert process_cpu_s(os.getpid()) > 0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_cpu_s(child.pid) is None  # reaped: gone
