"""cli/harness/engine_start.py: which start method vLLM's get_mp_context() gives, and when."""

from __future__ import annotations

import multiprocessing

import pytest

from hybridkv.cli.harness import engine_start


@pytest.fixture
def restored():  # noqa: ANN201
    yield
    engine_start.restore_spawn()


def test_unset_or_spawn_keeps_vllms_spawn_and_a_typo_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.delenv(engine_start.ENV, raising=False)
    assert engine_start.fork_requested() is False
    monkeypatch.setenv(engine_start.ENV, "spawn")
    assert engine_start.fork_requested() is False
    monkeypatch.setenv(engine_start.ENV, "fork")
    assert engine_start.fork_requested() is True
    monkeypatch.setenv(engine_start.ENV, "forkserver")
    with pytest.raises(ValueError, match=engine_start.ENV):
        engine_start.fork_requested()


def test_install_fork_turns_vllms_spawn_into_fork_and_restore_undoes_it(monkeypatch, restored):
    import vllm.utils.system_utils as system_utils

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM's CPU platform sets
    assert system_utils.get_mp_context().get_start_method() == "spawn"
    engine_start.install_fork()
    assert system_utils.get_mp_context().get_start_method() == "fork"
    engine_start.restore_spawn()
    assert system_utils.get_mp_context().get_start_method() == "spawn"
    assert system_utils.multiprocessing is multiprocessing


def test_the_server_command_runs_the_api_server_under_the_launcher_only_when_asked(
    monkeypatch, tmp_path
):
    from hybridkv.cli.server import VllmServer

    server = VllmServer(str(tmp_path), port=1)
    monkeypatch.delenv(engine_start.ENV, raising=False)
    assert server.command()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    monkeypatch.setenv(engine_start.ENV, "fork")
    assert server.command()[1:5] == [
        "-m",
        "hybridkv.cli.harness.engine_start",
        "vllm.entrypoints.openai.api_server",
        "--model",
    ]


def test_the_worker_side_connector_releases_its_store_clients_at_shutdown(monkeypatch):
    """A forked worker (vLLM's default on GPU) exits by os._exit, so the atexit hook never
    closes its Mooncake client; shutdown() must (cli/harness/engine_start.py found it: the next engine
    on the master got TRANSFER_FAIL on the dead worker's segment)."""
    from hybridkv.connector import store_connector

    calls: list[str] = []

    class Worker:
        def shutdown(self) -> None:
            calls.append("worker threads")

    monkeypatch.setattr(store_connector, "release_all", lambda: calls.append("release_all"))
    connector = object.__new__(store_connector.HybridStoreConnector)
    connector._worker, connector._scheduler = Worker(), None  # the worker side
    connector.shutdown()
    assert calls == ["worker threads", "release_all"]


def _write_where_stdout_points(line: str) -> None:
    import os as _os

    _os.write(
        1, f"{line} cwd={_os.getcwd()} env={_os.environ.get('HYBRIDKV_TEST_MARK')}\n".encode()
    )


def test_a_fork_server_child_writes_where_the_callers_stdout_points_at_its_start(
    tmp_path, monkeypatch
):
    """The e2e tests point fds 1 and 2 at a log file and read the engine workers' lines there
    (cli/harness/llm_engine.engine_output_to); a fork server's child inherits the server's fds
    instead, unless the caller's travel with it (otherwise an e2e test under fork fails with
    "expected one P/D read line, got []"). Its environment and directory are the caller's too."""
    import multiprocessing.forkserver
    import os

    context = engine_start._ForkServerWithCallersState()
    multiprocessing.forkserver.ensure_running()  # started before the redirect, as in the e2e tests
    log, workdir = tmp_path / "engine.log", tmp_path / "work"
    workdir.mkdir()
    monkeypatch.setenv("HYBRIDKV_TEST_MARK", "callers")
    monkeypatch.chdir(workdir)
    saved = os.dup(1)
    try:
        with open(log, "ab") as f:
            os.dup2(f.fileno(), 1)
        process = context.Process(target=_write_where_stdout_points, args=("child",))
        process.start()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    process.join(60)
    assert process.exitcode == 0
    assert log.read_text() == f"child cwd={workdir} env=callers\n"
