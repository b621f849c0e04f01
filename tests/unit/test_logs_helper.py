"""store/logs.py: every hybridkv logger sits under vLLM's ``vllm.`` tree (whose handlers vLLM
configures) and every message carries the ``hybridkv`` prefix the README's
``grep hybridkv server.log`` relies on."""

from __future__ import annotations

import logging

import pytest

from hybridkv.store.logs import get_logger, logger_name


def test_loggers_sit_under_vllms_tree() -> None:
    assert logger_name("hybridkv.connector.pd_handshake") == "vllm.hybridkv.connector.pd_handshake"
    assert logger_name("vllm.hybridkv.x") == "vllm.hybridkv.x"
    assert get_logger("hybridkv.store.malloc_trim").logger is logging.getLogger(
        "vllm.hybridkv.store.malloc_trim"
    )


def test_every_message_carries_the_prefix(vllm_caplog: pytest.LogCaptureFixture) -> None:
    with vllm_caplog.at_level(logging.INFO, logger="vllm.hybridkv"):
        get_logger("hybridkv.store.x").warning("segment %s lost", "a")
        get_logger("hybridkv.connector.pd_x", "P/D").info("peer %s refused", "p")
    assert [(r.name, r.getMessage()) for r in vllm_caplog.records] == [
        ("vllm.hybridkv.store.x", "hybridkv: segment a lost"),
        ("vllm.hybridkv.connector.pd_x", "hybridkv P/D: peer p refused"),
    ]
