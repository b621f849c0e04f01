"""One way to get a logger: under vLLM's ``vllm.`` tree, every message prefixed ``hybridkv``.

vLLM configures the handlers and level of the ``vllm`` logger only, so a logger outside that tree
prints nothing in a vLLM server's log; and operators find hybridkv's lines with
``grep hybridkv server.log``. Both rules live here: a module calls
``logger = get_logger(__name__)`` (or ``get_logger(__name__, "P/D")``) and writes its messages
without the prefix.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

TREE = "vllm"
PREFIX = "hybridkv"


class PrefixedLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger whose every message starts with ``self.prefix``."""

    def __init__(self, logger: logging.Logger, prefix: str) -> None:
        super().__init__(logger, {})
        self.prefix = prefix

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{self.prefix}{msg}", kwargs


def logger_name(name: str) -> str:
    """``name`` placed under vLLM's logger tree (unchanged when it already is)."""
    return name if name == TREE or name.startswith(TREE + ".") else f"{TREE}.{name}"


def get_logger(name: str, component: str = "") -> PrefixedLogger:
    """The logger for module ``name``: ``vllm.<name>``, messages prefixed ``hybridkv: `` or, with
    a component, ``hybridkv <component>: `` (e.g. ``hybridkv P/D: ``)."""
    prefix = f"{PREFIX} {component}: " if component else f"{PREFIX}: "
    return PrefixedLogger(logging.getLogger(logger_name(name)), prefix)
