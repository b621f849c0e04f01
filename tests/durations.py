"""Where the suite's time goes, from pytest's JUnit XML: seconds per directory and per file.

Why: the suite must stay well under its CI budget, and ``--durations`` names only
the slowest tests, not what the unit tests cost together or which files to shrink first.
``scripts/test.sh`` prints this after pass 1. Usage: ``python -m tests.durations JUNIT.xml``.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def seconds_per_file(junit_xml: str) -> Counter[str]:
    """Seconds (setup + call + teardown, as JUnit records them) per test file path."""
    per_file: Counter[str] = Counter()
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is dotted: tests.e2e.test_x[.TestClass]; keep the module part.
        parts = [p for p in module if not p[:1].isupper()]
        per_file["/".join(parts) + ".py"] += float(case.get("time", 0) or 0)
    return per_file


def report(per_file: Counter[str], top: int = 12) -> str:
    per_dir: Counter[str] = Counter()
    for path, s in per_file.items():
        per_dir[path.rsplit("/", 1)[0]] += s
    lines = [
        "== time per directory: "
        + ", ".join(f"{d} {s / 60:.1f} min" for d, s in per_dir.most_common())
    ]
    lines += [f"   {s:7.0f} s  {path}" for path, s in per_file.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(seconds_per_file(sys.argv[1])))
