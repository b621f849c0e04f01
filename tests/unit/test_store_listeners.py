"""Every socket a Mooncake store client listens on is on the configured host.

Real parts only: a real ``mooncake_master`` (EmbeddedMaster) and real ``MooncakeBackend``
clients, one of them in a child process that owns the segment, so puts and gets really cross
the TCP data listener between two processes. The child's and this process's listening sockets
are read from the kernel (psutil); each is named by the component that opened it, taken from
the client's own log lines ("listening on HOST:PORT" = P2P handshake, "TcpTransport: listen on
port N" = TCP data). Mooncake 0.3.13 binds both to all interfaces; the control test shows that
it still does without hybridkv's pin, so the main test fails if the pin is removed or broken.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.mooncake_backend import MooncakeBackend, _host_of, _listen_addresses

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
OBJ = 4 << 20

# A segment owner: a real backend, then one line with its pid, then it waits for stdin to close.
_OWNER = textwrap.dedent(
    """
    import os, sys
    from hybridkv.store.mooncake_backend import MooncakeBackend
    b = MooncakeBackend(sys.argv[1], global_segment_size=64 << 20, local_buffer_size=8 << 20,
                        listen_on_host=sys.argv[2] == "pin")
    print("ready", b.listeners_pinned, flush=True)
    sys.stdin.read()
    b.close()
    """
)


def listening(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every listening TCP socket and bound unconnected UDP socket of ``pid``."""
    out = set()
    for c in psutil.Process(pid).net_connections(kind="inet"):
        if c.laddr and (
            c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)
        ):
            out.add((c.laddr.ip, c.laddr.port))
    return out


def components(log: str) -> dict[int, str]:
    """Port -> the Mooncake component that opened it, from the client's log."""
    named = {
        int(p): "P2P handshake" for p in re.findall(r"P2P handshake, listening on \S+:(\d+)", log)
    }
    named |= {
        int(p): "TCP transport (data)"
        for p in re.findall(r"TcpTransport: listen on port (\d+)", log)
    }
    return named


def offenders(found: set[tuple[str, int]], names: dict[int, str]) -> list[str]:
    return sorted(
        f"{names.get(port, 'unknown listener')} on {ip}:{port}"
        for ip, port in found
        if ip not in LOOPBACK
    )


def non_loopback_addresses() -> list[str]:
    """This host's other addresses: a pinned listener must refuse connections to them."""
    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                ip = a.address.split("%")[0]
                if (
                    not ipaddress.ip_address(ip).is_loopback
                    and not ipaddress.ip_address(ip).is_link_local
                ):
                    out.append(ip)
    return out


def reachable(ip: str, port: int) -> bool:
    fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((ip, port)) == 0


@pytest.fixture(scope="module")
def master() -> Iterator[EmbeddedMaster]:
    with EmbeddedMaster() as m:
        yield m


class Owner:
    """A real backend owning the store's only segment, in a child process."""

    def __init__(self, master: EmbeddedMaster, mode: str, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _OWNER, master.address, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        line = self.proc.stdout.readline().split() if self.proc.stdout else []
        assert line[:1] == ["ready"], f"owner did not start: {line}\n{self.log()[-3000:]}"
        self.pinned = line[1] == "True"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _round_trip(client: MooncakeBackend) -> None:
    """Put into and get back from the owner's segment: bytes cross its TCP data listener."""
    src = ctypes.create_string_buffer(bytes(range(256)) * (OBJ // 256), OBJ)
    dst = ctypes.create_string_buffer(OBJ)
    key = f"test/listeners/{uuid.uuid4().hex}"
    assert client.put_from([key], [ctypes.addressof(src)], [OBJ]) == [0]
    assert client.get_into([key], [ctypes.addressof(dst)], [OBJ]) == [OBJ]
    assert dst.raw == src.raw


def test_every_store_client_listener_is_on_the_configured_host(
    master: EmbeddedMaster, tmp_path: Path
) -> None:
    """The segment owner (child), the reading client (this process) and the master: every
    listening socket on loopback, each offender named; the two Mooncake listeners exist (the
    listing sees them) and refuse connections on the host's other addresses; transfers between
    the two processes still work over the pinned listeners."""
    before = listening(os.getpid())
    owner = Owner(master, "pin", tmp_path / "owner.log")
    try:
        reader = MooncakeBackend(master.address, global_segment_size=0, local_buffer_size=8 << 20)
        try:
            _round_trip(reader)
            owned = listening(owner.proc.pid)
            mine = listening(os.getpid()) - before
        finally:
            reader.close()
        names = components(owner.log())
        print("\nsegment owner listens on:", sorted(owned), names)
        print("reading client listens on:", sorted(mine))
        assert sorted(names.values()) == ["P2P handshake", "TCP transport (data)"], owner.log()[
            -3000:
        ]
        assert {port for _, port in owned} == set(names), (
            f"listing {owned} misses or adds to {names}"
        )
        assert offenders(owned, names) == [], "segment owner reachable from other hosts"
        assert len(mine) == 2 and offenders(mine, {}) == [], f"reading client: {sorted(mine)}"
        assert owner.pinned is True
        at_master = listening(master.pid)
        assert {master.rpc_port, master.metrics_port} <= {port for _, port in at_master}, at_master
        assert (
            offenders(
                at_master, {master.rpc_port: "master RPC", master.metrics_port: "master metrics"}
            )
            == []
        )
        for ip in non_loopback_addresses():
            for port in names:
                assert not reachable(ip, port), f"{names[port]} port {port} answers on {ip}"
    finally:
        owner.stop()


def test_without_the_pin_mooncake_listens_on_all_interfaces(
    master: EmbeddedMaster, tmp_path: Path
) -> None:
    """Control, and the fact the pin exists for: Mooncake 0.3.13 alone binds its handshake to
    0.0.0.0 (findAvailableTcpPort, transfer_metadata_plugin.cpp) and its data listener to [::]
    (TcpContext, tcp_transport_session_impl.h), whatever local_hostname says. If this fails
    because Mooncake now binds the host itself, the interposer in mooncake_backend can go."""
    owner = Owner(master, "nopin", tmp_path / "owner.log")
    try:
        owned = listening(owner.proc.pid)
        names = components(owner.log())
    finally:
        owner.stop()
    assert owner.pinned is False
    assert sorted((names[port], ip) for ip, port in owned) == [
        ("P2P handshake", "0.0.0.0"),
        ("TCP transport (data)", "::"),
    ]


@pytest.mark.parametrize(
    ("local_hostname", "host", "v4", "v6"),
    [
        ("127.0.0.1", "127.0.0.1", "127.0.0.1", "::ffff:127.0.0.1"),
        ("127.0.0.1:13555", "127.0.0.1", "127.0.0.1", "::ffff:127.0.0.1"),
        ("10.1.2.3", "10.1.2.3", "10.1.2.3", "::ffff:10.1.2.3"),
        ("[::1]:13555", "::1", "127.0.0.1", "::1"),
        ("fd00::7", "fd00::7", "127.0.0.1", "fd00::7"),
        ("localhost", "localhost", "127.0.0.1", "::ffff:127.0.0.1"),
    ],
)
def test_the_address_each_wildcard_bind_becomes(
    local_hostname: str, host: str, v4: str, v6: str
) -> None:
    """IPv4 wildcard -> the host's IPv4 address; IPv6 wildcard -> the IPv4-mapped host (still dual
    stack, so the IPv4 connections peers make are accepted), or the host itself when it is IPv6."""
    assert _host_of(local_hostname) == host
    got4, got6 = _listen_addresses(host)
    assert (socket.inet_ntop(socket.AF_INET, got4), socket.inet_ntop(socket.AF_INET6, got6)) == (
        v4,
        v6,
    )


def test_a_read_only_got_page_is_written_and_left_read_only() -> None:
    """Builds linked with full RELRO keep the GOT read-only: the slot write must unprotect the
    page, write, and restore it (this Mooncake build's slots are writable, so this path is
    exercised here on an anonymous read-only page)."""
    import mmap

    from hybridkv.store.mooncake_backend import _write_slot

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    page = libc.mmap(None, mmap.PAGESIZE, 1, 0x22, -1, 0)  # PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS
    assert page not in (None, ctypes.c_void_p(-1).value)

    def perms() -> str:
        for line in Path("/proc/self/maps").read_text().splitlines():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= page < hi:
                return line.split()[1][:3]
        raise AssertionError("page not mapped")

    try:
        assert perms() == "r--"
        _write_slot(page + 16, 0x1122334455667788)
        assert ctypes.c_uint64.from_address(page + 16).value == 0x1122334455667788
        assert perms() == "r--"
    finally:
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap(page, mmap.PAGESIZE)


def test_a_name_that_resolves_to_loopback_here_is_warned_about(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Debian-style hosts files map the machine's own name to 127.0.1.1: listeners would bind
    loopback while remote peers reach the name at the real address. Resolution is faked (named
    so): which names resolve where depends on the machine's hosts file."""
    import hybridkv.store.mooncake_backend as mb

    real = socket.getaddrinfo
    fake = {"node7": "127.0.1.1", "node8": "10.9.8.7"}

    def getaddrinfo(host: str, *a: object, **k: object) -> list:
        if host in fake:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (fake[host], 0))]
        return real(host, *a, **k)

    monkeypatch.setattr(mb.socket, "getaddrinfo", getaddrinfo)
    # A handler on the module's logger itself: vLLM's logging config may stop "vllm.*"
    # propagating to the root logger, where caplog listens.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    mb.logger.logger.addHandler(handler)
    try:
        assert _listen_addresses("node8")[0] == socket.inet_aton("10.9.8.7")
        assert records == []
        assert _listen_addresses("node7")[0] == socket.inet_aton("127.0.1.1")
    finally:
        mb.logger.logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "hybridkv: local_hostname 'node7' resolves to 127.0.1.1 here, so Mooncake's listeners bind loopback "
        "and peers on other hosts cannot reach them; set local_hostname to the IP address peers use"
    ]
