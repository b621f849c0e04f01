"""The README is a product page and the docs describe the software, not how it was built.

README.md stays at most 8 KB with the sections a newcomer needs; no document names dates,
issue or session numbers, helpers or who found what (history belongs in commit messages); and
docs/development.md's module list names exactly the modules in connector/, store/ and cli/.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted([README, ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
BUILD_WORDS = re.compile(
    r"\b20\d\d-\d\d-\d\d\b|\bstop \d+|\bhelper[- ]\d+|\bside helper\b|\bissue \d+|\bsession \d+|"
    r"\bthis session\b|\bnot lent\b|\bfound by\b|\btoday'?s?\b|\byesterday\b|\bthe lead\b",
    re.I,
)
SECTIONS = (
    "## Install",
    "## Two commands",
    "## Config lines",
    "## Guarantees and limits",
    "## When something is off",
    "## Results",
)


def test_readme_is_a_product_page() -> None:
    text = README.read_text()
    assert len(text.encode()) <= 8192
    assert [s for s in SECTIONS if s not in text.splitlines()] == []
    assert "MooncakeStoreConnector" in text and "NixlConnector" in text


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_speaks_of_how_the_project_was_built(doc: Path) -> None:
    hits = [
        f"{n}: {m.group(0)!r}"
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        for m in BUILD_WORDS.finditer(line)
    ]
    assert hits == []


def test_the_code_layout_names_every_module() -> None:
    """Every tracked module of the three packages has its line, and every line a module."""
    tracked = subprocess.run(
        ["git", "ls-files", "connector", "store", "cli"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    modules = {p for p in tracked if p.endswith(".py") and not p.endswith("__init__.py")}
    text = (ROOT / "docs" / "development.md").read_text()
    layout = text[text.index("## Code layout") :]
    listed = set(re.findall(r"^- `((?:connector|store|cli)/[\w/]+\.py)`", layout, re.M))
    assert sorted(modules - listed) == [], (
        "modules without a line in docs/development.md's Code layout"
    )
    assert sorted(listed - modules) == [], "lines naming no module"


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an external address
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert broken == []


def test_bench_readme_indexes_every_benchmark() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "bench"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    scripts = {p for p in tracked if p.endswith((".py", ".sh"))}
    index = (ROOT / "bench" / "README.md").read_text()
    assert sorted(s for s in scripts if s not in index) == []
