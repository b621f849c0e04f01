"""A process's own Mooncake wait bounds do not reach the servers it starts.

``bound_mooncake_stalls`` puts Mooncake's wait variables (MC_TCP_PROGRESS_TIMEOUT_SEC, ...) in
this process's environment for its store client; a variable present when hybridkv is imported
counts as the operator's and is never overridden. So a harness that used a store client (the
soak's chaos client, 30 s) and then starts a server would pass its bound on as if an operator
had set it: the restarted prefill's store reads would wait 30-60 s instead of its own 10 s,
polling, and stall every session (bench/soak.py --pd). The child here is a
real interpreter importing hybridkv afresh, as a server's engine and workers do.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridkv.cli.server import VllmServer
from hybridkv.store import mooncake_backend
from hybridkv.store.mooncake_backend import (
    STALL_ENV,
    STALL_ENV_MS,
    STALL_ENV_S,
    bound_mooncake_stalls,
    without_own_stall_bounds,
)

NAMES = STALL_ENV
CHILD = "from hybridkv.store.mooncake_backend import bound_mooncake_stalls as b; print(b(2))"  # a 2 s client


@pytest.fixture
def clean_env(monkeypatch):
    """This process's wait variables as hybridkv found them, whatever the test sets."""
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(mooncake_backend, "_OPERATOR_STALL_ENV", frozenset())
    return monkeypatch


def _child_bound(env: dict[str, str]) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def test_a_server_started_after_this_process_bounded_its_own_client_sets_its_own_bound(clean_env):
    assert bound_mooncake_stalls(30.0) == 30.0  # the harness's client (the soak's chaos client)
    assert os.environ[STALL_ENV_S[0]] == "30"
    server_env = VllmServer("tiny", port=1).environment()
    assert not set(NAMES) & set(server_env)
    assert _child_bound(server_env) == 10.0  # the child's own: 2 s, floored at STALL_FLOOR_S
    assert _child_bound(dict(os.environ)) == 30.0  # the planted fault: the inherited bound wins


def test_an_operators_bound_still_reaches_the_server(clean_env):
    clean_env.setenv(STALL_ENV_S[0], "45")
    clean_env.setattr(mooncake_backend, "_OPERATOR_STALL_ENV", frozenset({STALL_ENV_S[0]}))
    bound_mooncake_stalls(30.0)  # sets the other two, keeps the operator's
    env = without_own_stall_bounds(os.environ)
    assert env[STALL_ENV_S[0]] == "45" and STALL_ENV_S[1] not in env and STALL_ENV_MS not in env
    assert _child_bound(env) == 45.0
