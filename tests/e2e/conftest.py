"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from hybridkv.store.embedded_master import EmbeddedMaster


@pytest.fixture(scope="module")
def master():
    """A real mooncake_master per test module; a short KV lease so tests can remove objects."""
    with EmbeddedMaster(default_kv_lease_ttl_ms=2_000) as m:
        yield m
