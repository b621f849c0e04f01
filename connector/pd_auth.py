"""The P/D deployment secret: where it comes from, and the one MAC rule every P/D message uses.

Why a secret at all: ``kv_transfer_params`` travel through API clients (a client can
POST any it likes to a decode server), and the gRPC side channel is reachable by
anyone who can reach its port. Without a MAC, forged parameters make decode connect to
any address and READ any prefill block, and a forged ReleaseBlocks frees any lease.
With one, only processes holding the deployment's secret can issue parameters or talk
on the side channel.

The secret is found, in this order, at ``kv_connector_extra_config.auth_secret_file``,
at the file named by ``$HYBRIDKV_AUTH_SECRET_FILE``, or in ``$HYBRIDKV_AUTH_SECRET``
itself. None of them: the connector refuses to start unless
``allow_unauthenticated: true`` says the operator chose to run without (logged loudly).

Every MAC is HMAC-SHA256 under a key derived per purpose (params, rpc request, rpc
answer), over a canonical JSON list of the fields, so one message can never be replayed
as another kind.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.connector.store_config import ConfigError
from hybridkv.store.logs import get_logger

logger = get_logger(__name__, "P/D")

SECRET_ENV = "HYBRIDKV_AUTH_SECRET"
SECRET_FILE_ENV = "HYBRIDKV_AUTH_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAC_HEX_CHARS = 64  # SHA-256

PURPOSE_PARAMS = "hybridkv-pd-params-v1"
PURPOSE_RPC_REQUEST = "hybridkv-pd-rpc-request-v1"
PURPOSE_RPC_ANSWER = "hybridkv-pd-rpc-answer-v1"


@dataclass(frozen=True)
class DeploymentKey:
    """The deployment secret (never printed) and the MAC rule over it."""

    secret: bytes = field(repr=False)
    source: str = ""  # where it came from, for log lines (never the value)

    def mac(self, purpose: str, *fields: Any) -> str:
        """Hex HMAC-SHA256 of ``fields`` (JSON-encodable) under the key for ``purpose``."""
        sub = hmac.new(self.secret, purpose.encode(), hashlib.sha256).digest()
        body = json.dumps([purpose, *fields], separators=(",", ":"), sort_keys=True).encode()
        return hmac.new(sub, body, hashlib.sha256).hexdigest()

    def verify(self, mac: object, purpose: str, *fields: Any) -> bool:
        """Constant-time check of ``mac`` (anything: a client may send garbage)."""
        if not isinstance(mac, str) or len(mac) != MAC_HEX_CHARS:
            return False
        return hmac.compare_digest(mac, self.mac(purpose, *fields))


def _read_secret_file(path: str, what: str) -> bytes:
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise ConfigError(f"{what}={path!r}: cannot read the P/D secret file: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what}={path!r}: not a regular file")
    if st.st_mode & 0o022:
        raise ConfigError(
            f"{what}={path!r}: writable by group or others (mode {st.st_mode & 0o777:o}); chmod 600 it"
        )
    if st.st_mode & 0o044:
        logger.warning(
            "secret file %s is readable by group or others (mode %o); chmod 600 it",
            path,
            st.st_mode & 0o777,
        )
    return p.read_bytes().strip()


def load_key(secret_file: str | None, allow_unauthenticated: bool) -> DeploymentKey | None:
    """The deployment key, or None when the operator explicitly runs without one.

    Raises :class:`ConfigError` (at connector start, so a misconfigured instance never
    serves) when there is no secret and ``allow_unauthenticated`` is not set, or when
    the secret is too short.
    """
    if secret_file:
        secret, source = (
            _read_secret_file(secret_file, "kv_connector_extra_config.auth_secret_file"),
            secret_file,
        )
    elif os.environ.get(SECRET_FILE_ENV):
        path = os.environ[SECRET_FILE_ENV]
        secret, source = _read_secret_file(path, f"${SECRET_FILE_ENV}"), path
    elif os.environ.get(SECRET_ENV):
        secret, source = os.environ[SECRET_ENV].strip().encode(), f"${SECRET_ENV}"
    else:
        if not allow_unauthenticated:
            raise ConfigError(
                "HybridPDConnector needs the deployment secret that signs kv_transfer_params and the "
                "handshake/release RPCs: set kv_connector_extra_config.auth_secret_file (a file only the "
                f"operator can read, the same on prefill and decode), ${SECRET_FILE_ENV} or ${SECRET_ENV}; "
                "or set kv_connector_extra_config.allow_unauthenticated=true to accept that any API client "
                "or host reaching the side channel can read other requests' KV"
            )
        logger.warning(
            "RUNNING WITHOUT AUTHENTICATION (allow_unauthenticated=true): any API client can "
            "forge kv_transfer_params (make decode read any prefill block, poison decode's prefix cache), and "
            "anyone reaching the handshake port can fetch the NIXL agent metadata, free leases, and with that "
            "metadata READ and WRITE this prefill's registered KV memory over UCX (NIXL has no read-only "
            "registration), poisoning the KV of other requests. Set auth_secret_file for any deployment with "
            "untrusted clients or a shared network."
        )
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"P/D secret from {source} has {len(secret)} bytes; use at least {MIN_SECRET_BYTES} random bytes "
            "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > FILE; chmod 600 FILE`)"
        )
    if allow_unauthenticated:
        logger.warning("a secret is configured (%s); allow_unauthenticated is ignored", source)
    return DeploymentKey(secret, source)


def write_secret_file(path: str | os.PathLike) -> Path:
    """Create a fresh random secret at ``path`` (mode 600), for the demo, PDStack and tests."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(secrets.token_hex(32) + "\n")
    return p


__all__ = [
    "DeploymentKey",
    "MAC_HEX_CHARS",
    "PURPOSE_PARAMS",
    "PURPOSE_RPC_ANSWER",
    "PURPOSE_RPC_REQUEST",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "load_key",
    "write_secret_file",
]
