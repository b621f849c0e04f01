"""The docs-table check (tests/docs_tables.py): it must see every way docs drift from tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import docs_tables
from tests.docs_tables import load_observed, marked_tables, mismatches, rewrite

DOC = """# results

<!-- observed: demo rows: a, b -->
| case | turn 2 cached / expected | note |
|---|---|---|
| first | 896 / 896 | free text |
| second | 768 / 768 | more |

after
"""
RECORDS = {
    ("demo", "a"): {"turn 2 cached / expected": "896 / 896"},
    ("demo", "b"): {"turn 2 cached / expected": "768 / 768"},
}


def _tables(text: str = DOC):
    return marked_tables(Path("results.md"), text.splitlines())


def test_docs_equal_to_the_records_pass():
    assert mismatches(_tables(), RECORDS) == []


def test_a_cell_that_drifted_is_named_with_both_values():
    drifted = {**RECORDS, ("demo", "b"): {"turn 2 cached / expected": "512 / 512"}}
    assert mismatches(_tables(), drifted) == [
        "results.md demo/b [turn 2 cached / expected]: docs say '768 / 768', the test asserted '512 / 512'"
    ]


def test_a_row_no_test_records_fails():
    (problem,) = mismatches(_tables(), {("demo", "a"): RECORDS[("demo", "a")]})
    assert problem.startswith("results.md demo/b: no test recorded this row")


def test_a_recorded_column_the_table_lacks_fails():
    extra = {**RECORDS, ("demo", "a"): {**RECORDS[("demo", "a")], "turn 3": "1408"}}
    (problem,) = mismatches(_tables(), extra)
    assert "records column 'turn 3'" in problem


def test_a_row_added_without_its_id_is_refused():
    text = DOC.replace(
        "| second | 768 / 768 | more |", "| second | 768 / 768 | more |\n| third | 1 / 1 | x |"
    )
    with pytest.raises(ValueError, match="has 3 rows but its marker names 2"):
        _tables(text)


def test_write_sets_recorded_cells_and_keeps_free_text():
    lines = DOC.splitlines()
    drifted = {**RECORDS, ("demo", "b"): {"turn 2 cached / expected": "512 / 512"}}
    out = rewrite(lines, _tables(), drifted)
    assert out[6] == "| second | 512 / 512 | more |"
    assert out[:6] == lines[:6] and out[7:] == lines[7:]
    assert mismatches(marked_tables(Path("results.md"), out), drifted) == []


def test_the_latest_record_of_a_row_wins(tmp_path, monkeypatch):
    path = tmp_path / "observed.jsonl"
    monkeypatch.setattr(docs_tables, "OBSERVED", path)
    docs_tables.observe("demo", "a", {"c": "1"})
    docs_tables.observe("demo", "a", {"c": "2"})
    assert load_observed(path) == {("demo", "a"): {"c": "2"}}


def test_the_real_docs_parse_and_name_every_row():
    """docs/results.md's marked tables parse (every row has an id) and hold the tables
    CI checks; the cells themselves are checked after the e2e pass (scripts/test.sh)."""
    doc = docs_tables.DOCS[0]
    tables = {t.table: t.row_ids for t in marked_tables(doc, doc.read_text().splitlines())}
    assert set(tables) >= {"store-e2e", "pd-e2e", "store-tp2", "local-sub-block"}
