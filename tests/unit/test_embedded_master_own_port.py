"""The embedded master is "up" only when ITS process listens on the rpc port.

A foreign listener on the chosen port (another test's server, another local user squatting it
between ``_free_port`` and the master's bind) must not be handed to clients as our master:
start() refuses with the port named. Real ``mooncake_master``; the squatter is a plain socket
of this test process (it is what any other process holding the port looks like from /proc).
"""

from __future__ import annotations

import os
import socket

import pytest

from hybridkv.store.embedded_master import EmbeddedMaster, MasterError, listener_is


def _listener() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def test_listener_is_names_the_process_holding_the_port() -> None:
    with _listener() as s:
        port = s.getsockname()[1]
        assert listener_is(os.getpid(), port) is True
        with EmbeddedMaster(default_kv_lease_ttl_ms=1_000) as m:
            assert m.pid is not None and m.rpc_port is not None
            assert (
                listener_is(m.pid, m.rpc_port) is True
            )  # the master itself (mooncake's cli execs)
            assert listener_is(m.pid, port) is False  # this process's port, not the master's
            assert listener_is(os.getpid(), m.rpc_port) is False


def test_a_foreign_listener_on_the_rpc_port_is_refused_not_served() -> None:
    with _listener() as s:
        port = s.getsockname()[1]
        m = EmbeddedMaster(rpc_port=port, start=False, start_timeout_s=5.0)
        with pytest.raises(MasterError) as ei:
            m.start()  # before: the port answered, so start() returned and clients met the squatter
        text = str(ei.value)
        # Either the master failed to bind and exited (its log says so), or it kept running
        # and start() saw another process on the port; both name what went wrong.
        assert f"another process listens on port {port}" in text or "exited with code" in text, text
        assert not m.is_running()


def test_ports_it_chose_are_chosen_again_when_one_was_taken_meanwhile(monkeypatch) -> None:
    """``_free_port`` releases a port before the master binds it; on a busy host another
    process can take it (CI runs the unit tests beside the engines). A master that
    chose its ports itself and exits with "Address already in use" is started again on new
    ports. Planted: the first port handed out (the rpc port) is held by a listener of this
    process; without the re-choice start() raises "exited with code 1"."""
    import hybridkv.store.embedded_master as em

    with _listener() as squatter:
        taken = squatter.getsockname()[1]
        handed = iter([taken])
        real = em._free_port
        monkeypatch.setattr(em, "_free_port", lambda: next(handed, None) or real())
        with EmbeddedMaster(default_kv_lease_ttl_ms=1_000) as m:
            assert m.rpc_port != taken and m.pid is not None
            assert listener_is(m.pid, m.rpc_port) is True
            assert listener_is(os.getpid(), taken) is True  # the squatter kept its port
