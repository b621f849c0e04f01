"""docs/config.md and README.md state what the code does: the key tables equal the config
declarations, every config line printed in them passes the checks the connectors run at startup,
the GPU install line is one line, and the object trailer is described as the code writes it.

A docs table written by hand drifts from the code it describes (the trailer's size and hash, a
key's default); these tests fail on the first such difference, as test_metrics_documented.py
does for the metrics tables.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import pytest

from hybridkv.connector.pd_connector import PDConnectorConfig
from hybridkv.connector.store_config import StoreConnectorConfig, markdown_table
from hybridkv.store.object_trailer import TRAILER_BYTES

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MD = ROOT / "docs" / "config.md"
README = ROOT / "README.md"
GPU_INSTALL = 'python3.12 -m venv .venv && .venv/bin/pip install -e ".[gpu]"'
CONFIG_LINE = re.compile(r"--kv-transfer-config '(\{.*?\})'", re.S)


def _table_after(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_store_key_table_is_the_declarations() -> None:
    """The table is ``python -m hybridkv.connector.store_config``'s output, row for row."""
    table = markdown_table(StoreConnectorConfig).splitlines()
    assert _table_after(CONFIG_MD.read_text(), table[0]) == table


def test_pd_key_table_is_the_declarations() -> None:
    """The P/D table is ``markdown_table(PDConnectorConfig)``, the whole table and only it."""
    table = markdown_table(PDConnectorConfig)
    assert len(table.splitlines()) == 2 + len(fields(PDConnectorConfig))
    assert f"\n\n{table}\n\n" in CONFIG_MD.read_text()


@pytest.mark.parametrize("doc", [README, CONFIG_MD], ids=lambda p: p.name)
def test_every_printed_config_line_passes_the_startup_checks(doc: Path) -> None:
    """Each ``--kv-transfer-config '...'`` as printed: vLLM's KVTransferConfig and connector
    lookup accept it, each hybridkv connector's ``from_extra_config`` accepts its keys (the
    doctor's config checks), and each P/D connector has a secret or says it runs without one
    (HybridPDConnector refuses to start otherwise)."""
    from hybridkv.cli.doctor import config_checks

    lines = CONFIG_LINE.findall(doc.read_text())
    assert lines, f"{doc.name} prints no config line"
    for text in lines:
        # The one placeholder a reader replaces: the address of their running mooncake_master.
        checks, uses = config_checks(
            json.loads(text.replace("HOST:PORT", "127.0.0.1:50051")), source=doc.name
        )
        assert [c for c in checks if c.status == "fail"] == [], text
        assert uses, text
        for use in uses:
            if use.kind == "pd":
                assert use.cfg.auth_secret_file or use.cfg.allow_unauthenticated, text


def test_the_gpu_install_line_is_one_line_everywhere() -> None:
    for doc in (README, CONFIG_MD, ROOT / "docs" / "gpu.md"):
        lines = {
            ln.strip() for ln in doc.read_text().splitlines() if '".[gpu]"' in ln or "[gpu]`" in ln
        }
        assert lines == {GPU_INSTALL}, (doc.name, lines)


def test_the_object_trailer_is_described_as_written() -> None:
    """The trailer's size, hash and MAC as store/object_trailer.py writes them, nowhere a CRC."""
    for doc in (README, CONFIG_MD, ROOT / "docs" / "results.md"):
        text = doc.read_text()
        sizes = set(re.findall(r"(\d+)-byte trailer", text))
        assert sizes <= {str(TRAILER_BYTES)}, (doc.name, sizes)
        assert (
            re.findall(r"CRC[- ]checked|CRC trailer|trailer \(CRC\)|CRC-32 of the payload", text)
            == []
        ), doc.name
    config = CONFIG_MD.read_text()
    assert (
        f"{TRAILER_BYTES}-byte trailer" in config
        and "XXH3-64" in config
        and "keyed BLAKE3" in config
    )
