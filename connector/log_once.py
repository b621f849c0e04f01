"""Warn once per cause: a dead store must not log one line per block or per step."""

from __future__ import annotations

import logging
import threading

from hybridkv.store.logs import PrefixedLogger, get_logger

_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def warn_once(
    logger: PrefixedLogger | logging.Logger, cause: str, message: str, *args: object
) -> None:
    """Log ``message`` at WARNING the first time ``cause`` is seen by ``logger``, after the
    logger's ``hybridkv`` prefix (a plain logger gets ``get_logger``'s) and ``[cause]``."""
    if not isinstance(logger, PrefixedLogger):
        logger = get_logger(logger.name)
    key = (logger.name, cause)
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    logger.warning("[%s] " + message + " (further %s warnings suppressed)", cause, *args, cause)
