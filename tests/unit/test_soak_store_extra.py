"""bench/soak.py ``--store-extra``: the operator options an A/B soak run adds reach every
HybridStoreConnector config the soak builds (store-only and both P/D instances), and a
malformed item is refused with the expected form."""

from __future__ import annotations

import pathlib

import pytest

from hybridkv.cli.harness.soak import SoakConfig, _store_config, main, pd_configs, store_extra


def test_items_parse_as_json_values_or_strings() -> None:
    assert store_extra(["malloc_trim_interval_s=10", "read_wait_nice=0", "x=abc", "y=1.5"]) == {
        "malloc_trim_interval_s": 10,
        "read_wait_nice": 0,
        "x": "abc",
        "y": 1.5,
    }
    assert store_extra([]) == {}


@pytest.mark.parametrize("item", ["malloc_trim_interval_s", "=10"])
def test_malformed_item_is_refused_with_the_form(item: str) -> None:
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        main(["--store-extra", item])


def test_keys_the_soak_sets_itself_are_refused() -> None:
    with pytest.raises(SystemExit, match="set by the soak itself"):
        store_extra(["timeout_s=30"])


def test_every_store_child_gets_the_options(tmp_path: pathlib.Path) -> None:
    cfg = SoakConfig(store_extra={"malloc_trim_interval_s": 10})
    logs = (tmp_path / "p.log", tmp_path / "d.log")
    alone = _store_config(cfg, "127.0.0.1:1", logs[0], "recompute", "256MiB")
    assert alone["kv_connector_extra_config"]["malloc_trim_interval_s"] == 10
    prefill, decode = pd_configs(cfg, "127.0.0.1:1", logs, "recompute")
    for multi in (prefill, decode):
        stores = [
            c
            for c in multi["kv_connector_extra_config"]["connectors"]
            if c["kv_connector"] == "HybridStoreConnector"
        ]
        assert [c["kv_connector_extra_config"]["malloc_trim_interval_s"] for c in stores] == [10]
    # Without the option the config is what it was (no key added).
    plain = _store_config(SoakConfig(), "127.0.0.1:1", logs[0], "recompute", "256MiB")
    assert "malloc_trim_interval_s" not in plain["kv_connector_extra_config"]
