"""The result tables in docs/ are checked against what the end-to-end tests assert.

Why: a table written by hand from a test run drifts. A test changes (a case is
replaced, a hit moves by a block) and the docs go on claiming the old numbers
for a case nothing runs any more. So each e2e test, after its assertions
passed, records the cells it proved (``observe``), and this module compares
the docs' tables with those records (``python -m tests.docs_tables --check``;
scripts/test.sh runs it after the e2e pass) or rewrites the cells from them
(``--write``).

A checked table is marked in the markdown by a comment on the line before its
header, naming the table and its rows (one id per row, in order)::

    <!-- observed: store-e2e rows: gemma3-block, qwen3next-block -->

Only the columns a test records are checked; other columns (prose, ranges of
measured noise) stay free text. Every marked row must have a record, every
recorded column must exist in the table, and every cell must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "docs" / "results.md", ROOT / "docs" / "matrix.md")
OBSERVED = Path(os.environ.get("HYBRIDKV_E2E_OBSERVED", "/tmp/hybridkv-e2e-observed.jsonl"))
_MARKER = re.compile(r"^<!--\s*observed:\s*(?P<table>[\w.-]+)\s+rows:\s*(?P<rows>[^>]*?)\s*-->\s*$")


def observe(table: str, row: str, cells: dict[str, str]) -> None:
    """Record the cells a test has just asserted, by the table's column headers."""
    with OBSERVED.open("a") as f:
        f.write(json.dumps({"table": table, "row": row, "cells": cells}) + "\n")


def load_observed(path: Path = OBSERVED) -> dict[tuple[str, str], dict[str, str]]:
    """The latest record per (table, row): a later run of a test replaces an earlier one."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[(rec["table"], rec["row"])] = dict(rec["cells"])
    return out


@dataclass
class MarkedTable:
    """A docs table under an ``observed:`` marker: where its lines are and what they hold."""

    doc: Path
    table: str
    row_ids: list[str]
    header: list[str]
    first_row_line: int  # index into the document's lines
    rows: list[list[str]]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def marked_tables(doc: Path, lines: list[str]) -> list[MarkedTable]:
    """Every marked table of one document; a marker whose row count differs from the
    table's is an error (a row added or removed without its id)."""
    found = []
    for i, line in enumerate(lines):
        m = _MARKER.match(line.strip())
        if not m:
            continue
        row_ids = [r.strip() for r in m["rows"].split(",") if r.strip()]
        header, j = _cells(lines[i + 1]), i + 3  # header, separator, rows
        rows = []
        while j + len(rows) < len(lines) and lines[j + len(rows)].lstrip().startswith("|"):
            rows.append(_cells(lines[j + len(rows)]))
        if len(rows) != len(row_ids):
            raise ValueError(
                f"{doc.name}: table {m['table']!r} has {len(rows)} rows but its marker names "
                f"{len(row_ids)} ({', '.join(row_ids)}): name every row, in order"
            )
        found.append(MarkedTable(doc, m["table"], row_ids, header, j, rows))
    return found


def mismatches(
    tables: list[MarkedTable], observed: dict[tuple[str, str], dict[str, str]]
) -> list[str]:
    """What differs between the docs and the records, one line each (empty: they agree)."""
    problems = []
    for t in tables:
        for row_id, row in zip(t.row_ids, t.rows):
            cells = observed.get((t.table, row_id))
            if cells is None:
                problems.append(
                    f"{t.doc.name} {t.table}/{row_id}: no test recorded this row (run the e2e "
                    f"tests; a row no test backs must go)"
                )
                continue
            for column, value in cells.items():
                if column not in t.header:
                    problems.append(
                        f"{t.doc.name} {t.table}: the test records column {column!r}, the table "
                        f"has {t.header}"
                    )
                elif row[t.header.index(column)] != value:
                    problems.append(
                        f"{t.doc.name} {t.table}/{row_id} [{column}]: docs say "
                        f"{row[t.header.index(column)]!r}, the test asserted {value!r}"
                    )
    return problems


def rewrite(
    lines: list[str], tables: list[MarkedTable], observed: dict[tuple[str, str], dict[str, str]]
) -> list[str]:
    """The document's lines with every recorded cell written from the records."""
    out = list(lines)
    for t in tables:
        for k, (row_id, row) in enumerate(zip(t.row_ids, t.rows)):
            cells = observed.get((t.table, row_id), {})
            new = list(row)
            for column, value in cells.items():
                if column in t.header:
                    new[t.header.index(column)] = value
            out[t.first_row_line + k] = "| " + " | ".join(new) + " |"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--observed", type=Path, default=OBSERVED)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--check", action="store_true", help="fail on any cell that differs from the records"
    )
    mode.add_argument(
        "--write", action="store_true", help="rewrite the recorded cells from the records"
    )
    args = p.parse_args(argv)
    observed = load_observed(args.observed)
    problems, checked = [], 0
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        tables = marked_tables(doc, lines)
        checked += sum(len(t.rows) for t in tables)
        if args.write:
            lines = rewrite(lines, tables, observed)
            doc.write_text("\n".join(lines) + "\n")
            tables = marked_tables(doc, lines)
        problems += mismatches(tables, observed)
    for line in problems:
        print("docs table:", line, file=sys.stderr)
    print(
        f"docs tables: {checked} rows checked against {args.observed}, {len(problems)} problem(s)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
