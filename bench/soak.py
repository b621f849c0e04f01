"""The soak: agentic sessions against real vLLM servers while the store and the prefill fail.

    flock /tmp/hybridkv-engine.lock .venv/bin/python bench/soak.py [--sessions 16] [--phase-s 60]
        [--out bench/results] [--pd]

The code is :mod:`hybridkv.cli.harness.soak` (its docstring lists the phases, the faults and the
targets); CI runs a short variant of it (tests/e2e/test_soak.py).
"""

from __future__ import annotations

import pathlib

from hybridkv.cli.harness.soak import main

if __name__ == "__main__":
    raise SystemExit(main(results=pathlib.Path(__file__).resolve().parent / "results"))
