"""The embedded master's rendezvous trusts only a private directory and a verified record.

Why: the directory sits under a world-writable /tmp; another local user could plant it, a
symlink to it, or a record naming their own endpoint, and our engines would send KV there.
Real parts throughout: real ``mooncake_master`` processes, real files; the hostile states
(a symlink, mode 0777, a forged record) are made with ordinary file operations.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from hybridkv.store import session
from hybridkv.store.embedded_master import EmbeddedMaster


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(session, "RENDEZVOUS_BASE", str(tmp_path))
    return tmp_path


def _dir(base: Path) -> Path:
    return base / f"hybridkv-{os.getuid()}"


def test_created_private(base: Path) -> None:
    d = session._rendezvous_dir()
    st = os.lstat(d)
    assert d == _dir(base) and stat.S_ISDIR(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert session._rendezvous_dir() == d  # an existing private one is reused


def test_symlinked_dir_is_refused(base: Path) -> None:
    target = base / "elsewhere"
    target.mkdir(mode=0o700)
    _dir(base).symlink_to(target)
    with pytest.raises(session.RendezvousError) as e:
        session.embedded_master_address("symlinked", 1000)
    msg = str(e.value)
    assert str(_dir(base)) in msg and "is a symlink" in msg and "rm -rf" in msg
    assert list(target.iterdir()) == []  # nothing was written through the link


def test_world_writable_dir_is_refused(base: Path) -> None:
    d = _dir(base)
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(session.RendezvousError) as e:
        session._rendezvous_dir()
    msg = str(e.value)
    assert str(d) in msg and "mode 777" in msg and f"chmod 700 {d}" in msg


def test_recorded_address_is_checked() -> None:
    with EmbeddedMaster() as m:
        port = m.rpc_port
        good = {"address": f"127.0.0.1:{port}", "pid": m.pid}
        assert session._trusted_address(good) == f"127.0.0.1:{port}"  # the control
        assert session._trusted_address({**good, "address": f"10.1.2.3:{port}"}) is None
        assert session._trusted_address({**good, "address": f"127.0.0.1:{port + 1}"}) is None
        assert session._trusted_address({**good, "pid": os.getpid()}) is None  # alive, not a master
        dead = subprocess.Popen(["true"])
        dead.wait()
        assert session._trusted_address({**good, "pid": dead.pid}) is None
        assert session._trusted_address({"address": "garbage", "pid": "x"}) is None


def test_forged_record_is_ignored_and_normal_path_works(base: Path) -> None:
    engine = "forged"
    d = session._rendezvous_dir()
    with EmbeddedMaster() as other:  # a live master the record's pid does not own
        dead = subprocess.Popen(["true"])
        dead.wait()
        forged = {"address": f"127.0.0.1:{other.rpc_port}", "pid": dead.pid}
        (d / f"{engine}.master.json").write_text(json.dumps(forged))
        try:
            address, owned = session.embedded_master_address(engine, 1000)
            assert owned and address != forged["address"]
            info = json.loads((d / f"{engine}.master.json").read_text())
            assert info["address"] == address and info["pid"] != dead.pid
            st = os.lstat(d / f"{engine}.master.json")
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
            # Another instance of this engine joins the verified record.
            assert session.embedded_master_address(engine, 1000) == (address, False)
        finally:
            session.release_all()


def test_symlinked_record_is_not_read(base: Path) -> None:
    d = session._rendezvous_dir()
    with EmbeddedMaster() as m:
        real = base / "real.json"
        real.write_text(json.dumps({"address": m.address, "pid": m.pid}))
        (d / "linked.master.json").symlink_to(real)
        assert session._read_record(real) == {"address": m.address, "pid": m.pid}  # the control
        assert session._read_record(d / "linked.master.json") is None
