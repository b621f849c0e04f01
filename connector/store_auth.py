"""The store's object MAC key, from the same deployment secret as P/D.

Why: anyone who reaches the Mooncake master can write objects; without a keyed tag a
planted object with a correct XXH3 trailer loads into another request's KV cache.
The secret is found exactly as ``pd_auth.load_key`` finds it
(``auth_secret_file``, ``$HYBRIDKV_AUTH_SECRET_FILE``, ``$HYBRIDKV_AUTH_SECRET``): one
loader, one set of file checks. Running without a secret stays allowed for the store
(it is a cache; single-tenant loopback deployments are the default) and is logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from hybridkv.connector import pd_auth
from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.store.logs import get_logger
from hybridkv.store.object_trailer import ObjectMac

logger = get_logger(__name__, "store")


def secret_configured(cfg: StoreConnectorConfig) -> bool:
    return bool(
        cfg.auth_secret_file
        or os.environ.get(pd_auth.SECRET_FILE_ENV)
        or os.environ.get(pd_auth.SECRET_ENV)
    )


@dataclass(frozen=True)
class StoreSecret:
    """The deployment secret as the store uses it, loaded once per process.

    Why one object: the key prefix (``tenant``) and the object MAC both come from the
    secret; loading it separately for each read the file (and ran its checks) twice and
    could, if the file changed in between, give a worker keys of one secret and MACs of
    another. ``key`` is None when no secret is configured (allowed for the store; logged).
    """

    key: pd_auth.DeploymentKey | None

    @classmethod
    def load(cls, cfg: StoreConnectorConfig) -> "StoreSecret":
        """Raises ``ConfigError`` for a bad secret; warns when there is none."""
        if not secret_configured(cfg):
            logger.warning(
                "no deployment secret (auth_secret_file / $%s / $%s): stored objects carry "
                "XXH3 only, so anyone who can reach the master can plant objects that load into requests' KV; "
                "set auth_secret_file unless every process reaching the master is trusted",
                pd_auth.SECRET_FILE_ENV,
                pd_auth.SECRET_ENV,
            )
            return cls(None)
        key = pd_auth.load_key(cfg.auth_secret_file or None, allow_unauthenticated=False)
        assert key is not None  # load_key returns None only when allow_unauthenticated is set
        logger.info("keys and object MACs from the deployment secret in %s", key.source)
        return cls(key)

    @property
    def tenant(self) -> str:
        """A short public id of the secret, for the store keys ('' without one).

        Why: two tenants on one master with the same ``namespace`` and different secrets
        named the same keys; each saw the other's objects as forgeries and removed them, so
        they thrashed each other's cache. With this id in the key prefix each secret has its
        own keys. It is an HMAC of a constant under the secret: it names the secret without
        revealing it, and nobody without the secret can compute another tenant's id from it.
        """
        if self.key is None:
            return ""
        return hmac.new(
            self.key.secret, b"hybridkv store key tenant v1", hashlib.sha256
        ).hexdigest()[:16]

    def object_mac(self) -> ObjectMac | None:
        """The MAC every object this worker writes carries and every object it loads must
        carry, or None (XXH3 trailers only) without a secret."""
        return None if self.key is None else ObjectMac(self.key.secret)
