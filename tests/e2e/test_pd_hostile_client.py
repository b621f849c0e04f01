"""A hostile API client against a real P/D pair (``PDStack``: prefill, decode, proxy servers).

Without the trust boundary one POST of ``remote_num_tokens: "abc"`` to the decode
server kills its engine, and well-formed forged parameters make it connect to any
host:port and READ any prefill block into its cache. Here every attack goes over
HTTP as a client would send it, and after each one the decode server must still be
healthy and answer a normal request exactly as a recompute does. Forged parameters
point the decode side at a socket this test listens on, which must see no connection
(the control: the same socket with correctly signed parameters is connected to).
"""

from __future__ import annotations

import collections
import math
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from hybridkv.cli.harness.llm_engine import (
    LOOPBACK,
    TOP_LOGPROBS,
    Completion,
    Session,
    listeners,
    matches,
    tiny_model,
)
from hybridkv.cli.pd_stack import PDStack
from hybridkv.connector.pd_auth import PURPOSE_PARAMS, DeploymentKey, load_key
from hybridkv.connector.pd_handshake import (
    AgentInfoRequest,
    HandshakeError,
    release_blocks,
    request_agent_info,
)
from hybridkv.connector.pd_params import RemotePrefill, covered_hashes, issue_remote_prefill

pytestmark = pytest.mark.e2e

HASH_BLOCK = 128  # the tiny gemma3's block size (both groups), so also vLLM's hash block


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with PDStack(tiny_model("gemma3"), log_dir=tmp_path_factory.mktemp("pd-hostile")) as s:
        assert s.secret_file is not None, "PDStack must generate the pair's secret"
        import requests

        _MODEL[:] = [requests.get(s.decode.url + "/v1/models", timeout=30).json()["data"][0]["id"]]
        yield s


@pytest.fixture(scope="module")
def http():
    import requests

    return requests.Session()


def _post(
    http,
    url: str,
    prompt: list[int],
    params=None,
    n: int = 1,
    salt: str | None = None,
    max_tokens: int = 8,
    top: int = 1,
):  # noqa: ANN001, ANN202
    body = {
        "model": _MODEL[0],
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "n": n,
        "logprobs": top,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    if n > 1:  # vLLM refuses n > 1 with temperature 0; top_k 1 is greedy all the same
        body.update(temperature=1.0, top_k=1)
    if params is not None:
        body["kv_transfer_params"] = params
    if salt is not None:
        body["cache_salt"] = salt
    return http.post(url + "/v1/completions", json=body, timeout=300)


_MODEL: list[str] = []  # the served model's id (the proxy has no /v1/models)


def _completions(r) -> list[Completion]:  # noqa: ANN001
    assert r.status_code == 200, r.text
    out = []
    for c in r.json()["choices"]:
        lp = c["logprobs"]
        tops = [
            {int(t.split(":")[1]): v for t, v in (top or {}).items()}
            for top in lp.get("top_logprobs") or []
        ]
        out.append(
            Completion(
                [int(t.split(":")[1]) for t in lp["tokens"]],
                list(lp["token_logprobs"]),
                0,
                tops if len(tops) == len(lp["tokens"]) else [],
            )
        )
    return out


def _recompute(http, stack: PDStack, prompt: list[int], top: int = 1) -> Completion:  # noqa: ANN001
    return _completions(
        _post(http, stack.decode.url, prompt, salt=f"recompute-{uuid.uuid4()}", top=top)
    )[0]


def _prefill_params(http, stack: PDStack, prompt: list[int]) -> dict:  # noqa: ANN001
    r = _post(http, stack.prefill.url, prompt, params={"do_remote_decode": True}, max_tokens=1)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params and params["remote_mac"], params
    return params


def _release(stack: PDStack, params: dict) -> None:
    """End a lease this test took and will not hand to decode (the prefill frees its blocks now,
    not after lease_s: the hostile-client run below counts every lease)."""
    key = load_key(str(stack.secret_file), False)
    release_blocks(
        f"{params['remote_host']}:{params['remote_port']}", [params["remote_request_id"]], 10.0, key
    )


def _log(stack: PDStack) -> str:
    return Path(stack.decode.log_path).read_text(errors="replace")


def _assert_healthy_and_exact(
    http, stack: PDStack, prompt: list[int], got: Completion | None = None
) -> None:  # noqa: ANN001
    """The decode server still serves, and what it serves equals a recompute."""
    assert http.get(stack.decode.url + "/health", timeout=30).status_code == 200
    ref = _recompute(http, stack, prompt)
    normal = _completions(_post(http, stack.decode.url, prompt))[0]
    assert matches(normal, ref), "a normal request after the attack differs from a recompute"
    if got is not None:
        assert matches(got, ref), "the attacked request's own output differs from a recompute"


class Listener:
    """A TCP socket the forged parameters point at; counts who connects."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture()
def listener():
    sock = Listener()
    yield sock
    sock.close()


def _block_hashes(prompt: list[int]) -> list[bytes]:
    """vLLM's own block hashes of ``prompt`` (sha256, the default), as the servers compute them."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    req = Request(
        "x",
        list(prompt),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(HASH_BLOCK, sha256),
    )
    return list(req.block_hashes)


def _resign(params: dict, key: DeploymentKey, for_prompt: list[int], **changes) -> dict:
    """``params`` with ``changes`` applied, signed with ``key`` for ``for_prompt``."""
    p = RemotePrefill(
        engine_id=params["remote_engine_id"],
        request_id=params["remote_request_id"],
        host=changes.get("host", params["remote_host"]),
        port=changes.get("port", params["remote_port"]),
        block_ids=tuple(tuple(g) for g in params["remote_block_ids"]),
        num_tokens=params["remote_num_tokens"],
        lease_id=params["remote_lease_id"],
    )
    return issue_remote_prefill(p, key, _block_hashes(for_prompt), HASH_BLOCK)


def _malformed(valid: dict) -> dict[str, dict]:
    groups = valid["remote_block_ids"]
    return {
        "num_tokens_abc": valid | {"remote_num_tokens": "abc"},
        "port_x": valid | {"remote_port": "x"},
        "block_ids_5": valid | {"remote_block_ids": 5},
        "negative_ids": valid | {"remote_block_ids": [[-1] * len(g) for g in groups]},
        "huge_ids": valid | {"remote_block_ids": [[2**62] * len(g) for g in groups]},
        "wrong_group_count": valid | {"remote_block_ids": groups + [[1]]},
        "too_many_blocks": valid | {"remote_block_ids": [list(range(1, 200)) for _ in groups]},
        "huge_num_tokens": valid | {"remote_num_tokens": 10**18},
        "flag_not_bool": valid | {"do_remote_prefill": "yes"},
        "internal_marker": valid | {"_hkv_read": True, "remote_port": 0},
    }


def test_malformed_params_to_decode_keep_it_healthy_and_exact(stack, http):
    session = Session(seed=31)
    prompt = session.prompt
    valid = _prefill_params(http, stack, prompt)
    for name, params in _malformed(valid).items():
        r = _post(http, stack.decode.url, prompt, params=params)
        assert r.status_code == 200, (name, r.status_code, r.text[:300])
        _assert_healthy_and_exact(http, stack, prompt, _completions(r)[0])
    _release(stack, valid)
    log = _log(stack)
    for field in (
        "remote_num_tokens",
        "remote_port",
        "remote_block_ids",
        "remote_block_ids[0]",
        "do_remote_prefill",
    ):
        assert f"kv_transfer_params.{field} " in log, f"no log line names {field}"
    assert "EngineDeadError" not in log and "crashed" not in log


def test_do_remote_decode_to_a_decode_only_server_is_refused(stack, http):
    prompt = Session(seed=32).prompt
    r = _post(http, stack.decode.url, prompt, params={"do_remote_decode": True})
    assert r.status_code == 200, r.text
    assert not r.json().get("kv_transfer_params"), "a decode-only instance issued a lease"
    _assert_healthy_and_exact(http, stack, prompt, _completions(r)[0])
    assert (
        "kv_transfer_params.do_remote_decode is true on an instance that is not a prefill instance"
        in _log(stack)
    )


def test_forged_params_make_no_connection(stack, http, listener):
    key = load_key(str(stack.secret_file), False)
    a, b = Session(seed=33).prompt, Session(seed=34).prompt
    real_b = _prefill_params(http, stack, b)
    # my hashes are the servers' (else the controls below would prove nothing)
    hashes = covered_hashes(_block_hashes(b), real_b["remote_num_tokens"], HASH_BLOCK)
    fields = RemotePrefill(
        real_b["remote_engine_id"],
        real_b["remote_request_id"],
        real_b["remote_host"],
        real_b["remote_port"],
        tuple(tuple(g) for g in real_b["remote_block_ids"]),
        real_b["remote_num_tokens"],
        real_b["remote_lease_id"],
    ).signed_fields(hashes)
    assert key.verify(real_b["remote_mac"], PURPOSE_PARAMS, *fields)
    forged = {
        # (rank 0's port in both places, as a forger would: a mismatch alone is refused earlier)
        "address_changed": real_b | {"remote_port": listener.port, "remote_ports": [listener.port]},
        "other_secret": _resign(
            real_b, DeploymentKey(b"not-the-secret-0123456789"), b, port=listener.port
        ),
        "signed_for_other_prompt": _resign(real_b, key, a, port=listener.port),
        "no_mac": {
            k: v
            for k, v in (
                real_b | {"remote_port": listener.port, "remote_ports": [listener.port]}
            ).items()
            if k != "remote_mac"
        },
    }
    for name, params in forged.items():
        r = _post(http, stack.decode.url, b, params=params)
        assert r.status_code == 200, (name, r.text[:300])
        _assert_healthy_and_exact(http, stack, b, _completions(r)[0])
        time.sleep(0.3)
        assert listener.connections == 0, f"{name}: decode connected to the forged address"
    assert _log(stack).count("kv_transfer_params.remote_mac does not verify") >= len(forged) - 1
    # The control: correctly signed for this prompt, the same address IS connected to
    # (the handshake then fails and the request recomputes).
    r = _post(http, stack.decode.url, b, params=_resign(real_b, key, b, port=listener.port))
    deadline = time.monotonic() + 10
    while listener.connections == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert listener.connections > 0, (
        "the listener's count has no power: a signed set was not connected either"
    )
    _assert_healthy_and_exact(http, stack, b, _completions(r)[0])
    _release(stack, real_b)


def test_forged_side_channel_calls_are_refused_and_the_lease_survives(stack, http):
    prompt = Session(seed=35).prompt
    params = _prefill_params(http, stack, prompt)
    address = f"{params['remote_host']}:{params['remote_port']}"
    for key in (None, DeploymentKey(b"not-the-secret-0123456789")):
        with pytest.raises(HandshakeError, match="UNAUTHENTICATED"):
            release_blocks(address, [params["remote_request_id"]], 5.0, key)
        with pytest.raises(HandshakeError, match="UNAUTHENTICATED"):
            request_agent_info(address, AgentInfoRequest("attacker", 0, None), 5.0, key)
    before = _log(stack)
    got = _completions(_post(http, stack.decode.url, prompt, params=params))[0]
    new = _log(stack)[len(before) :]
    assert "discarded, recomputing" not in new and "lease on its blocks" not in new, new[-2000:]
    _assert_healthy_and_exact(http, stack, prompt, got)


def test_replayed_params_are_not_read_twice(stack, http):
    """The same lease sent twice (a proxy retry, a replay): the second needs a READ (the
    decode cache was dropped); whatever it copies, the prefill side refuses its claim
    (released already), so it recomputes."""
    prompt = Session(seed=36).prompt
    params = _prefill_params(http, stack, prompt)
    first = _completions(_post(http, stack.decode.url, prompt, params=params))[0]
    for _ in range(50):
        if (
            http.post(stack.decode.url + "/reset_prefix_cache", timeout=30)
            .json()
            .get("success", True)
        ):
            break
        time.sleep(0.1)
    before = _log(stack)
    second = _completions(_post(http, stack.decode.url, prompt, params=params))[0]
    new = _log(stack)[len(before) :]
    assert "discarded, recomputing" in new, new[-2000:]
    ref = _recompute(http, stack, prompt)
    assert matches(first, ref) and matches(second, ref)


def test_n2_through_the_proxy_equals_recompute(stack, http):
    """n = 2 is two hand-overs (the proxy splits it, each sample with its own lease and
    READ); both samples equal a recompute."""
    prompt = Session(seed=37).prompt
    r = _post(http, stack.url, prompt, n=2)
    got = _completions(r)
    assert len(got) == 2
    ref = _recompute(http, stack, prompt)
    assert all(matches(c, ref) for c in got)
    _assert_healthy_and_exact(http, stack, prompt)


def test_block_count_bound_matches_the_servers_layout(stack, http):
    """The 'too_many_blocks' case above is refused by the per-group bound, not by luck:
    the prefill side's own lists are within it (positional, cdiv(prompt, block))."""
    prompt = Session(seed=38).prompt
    params = _prefill_params(http, stack, prompt)
    assert [len(g) for g in params["remote_block_ids"]] == [math.ceil(len(prompt) / HASH_BLOCK)] * 2
    _release(stack, params)


def test_every_socket_the_pd_stack_listens_on_is_loopback(stack, http):
    """Trust boundary: on a single-host pair nothing the stack opens may be reachable from
    another host -- the proxy, both API servers, the engines, their workers (gRPC handshake,
    NIXL/UCX) -- after a real P/D request has set up every channel (handshake, READ, claim,
    release). Lists the sockets of every process of the stack, children included."""
    import psutil

    prompt = Session(seed=38).prompt
    got = _completions(_post(http, stack.url, prompt))[
        0
    ]  # through the proxy: prefill -> decode READ
    _assert_healthy_and_exact(http, stack, prompt, got)
    roots = [stack._proxy.pid, stack.prefill.proc.pid, stack.decode.proc.pid]
    pids = set(roots)
    for pid in roots:
        pids |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
    found = listeners(pids)
    print("\nlisteners of the P/D stack:", *found, sep="\n  ")
    assert len(found) >= 4, (
        f"expected at least proxy + 2 API servers + a handshake listener, got {found}"
    )
    ports = {port for *_, port in found}
    for url in (stack.url, stack.prefill.url, stack.decode.url):
        assert int(url.rsplit(":", 1)[1]) in ports, (
            f"{url} not among the listed sockets: the listing misses some"
        )
    exposed = [x for x in found if x[2] not in LOOPBACK]
    assert not exposed, f"sockets reachable from other hosts: {exposed}"
    # Control: the listing sees an all-interfaces listener (this process's own).
    import os

    with socket.socket() as wide:
        wide.bind(("0.0.0.0", 0))
        wide.listen()
        assert [
            x
            for x in listeners({os.getpid()})
            if x[2] == "0.0.0.0" and x[3] == wide.getsockname()[1]
        ]


# --------------------------------------------------------------------------- hostile-client run

HOSTILE_S = float(os.environ.get("HYBRIDKV_HOSTILE_S", "20"))  # the issue's full run: 60
LEGIT_SESSIONS = 4
LEASE_S = 60.0  # the P/D connector's default lease_s (the stack sets none)


def _counter_sum(text: str, name: str) -> float:
    """Sum of ``name`` over its label sets in Prometheus text (0 when absent)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _pd_counters(http, url: str) -> dict[str, float]:  # noqa: ANN001
    """The P/D counters on ``url``/metrics, after one small request there: the workers' stats
    reach /metrics with an engine step, and an idle engine takes none (a lease that ended in
    its last step would stay uncounted)."""
    r = http.post(
        url + "/v1/completions",
        timeout=120,
        json={"model": _MODEL[0], "prompt": [5, 6, 7], "max_tokens": 1},
    )
    assert r.status_code == 200, r.text
    time.sleep(0.5)
    text = http.get(url + "/metrics", timeout=30).text
    names = ("reads", "failed_reads", "leases", "leases_released", "leases_expired")
    return {n: _counter_sum(text, f"vllm:hybridkv_pd_{n}_total") for n in names}


class _Recorder:
    """Wraps the side channel's channel cache: every call this process makes is recorded as it
    goes on the wire (method path, body bytes, metadata with the MAC): what an attacker who
    captured a peer's traffic holds."""

    def __init__(self, channels) -> None:  # noqa: ANN001 - pd_handshake._Channels
        self._channels = channels
        self.sent: list[tuple[str, bytes, tuple]] = []

    def get(self, address: str, connect_timeout_s: float = 20.0):  # noqa: ANN201
        channel, sent = self._channels.get(address, connect_timeout_s), self.sent

        class _Channel:
            def unary_unary(self, path: str, **kw):  # noqa: ANN003, ANN202
                call = channel.unary_unary(path, **kw)

                class _Call:
                    def with_call(self, body: bytes, timeout: float, metadata: tuple):  # noqa: ANN202
                        sent.append((path, body, tuple(metadata)))
                        return call.with_call(body, timeout=timeout, metadata=metadata)

                return _Call()

        return _Channel()

    def drop(self, address: str, channel) -> None:  # noqa: ANN001
        pass


def _raw_call(address: str, path: str, body: bytes, metadata: tuple, timeout_s: float = 5.0) -> str:
    """Send ``body`` with ``metadata`` as is; the answer's status code name ("OK" if answered)."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(
                path, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )(body, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            return e.code().name
    return "OK"


def _capture(address: str, key: DeploymentKey) -> list[tuple[str, bytes, tuple]]:
    """One signed GetAgentInfo and one signed ClaimLease (of an id no lease has), as sent."""
    from hybridkv.connector import pd_handshake as hs

    recorder, real = _Recorder(hs._channels), hs._channels
    hs._channels = recorder
    try:
        try:
            request_agent_info(address, AgentInfoRequest("captured-peer", 0, None), 10.0, key)
        except HandshakeError:
            pass  # refused or not: what matters is the call on the wire
        try:
            hs._call(
                address,
                hs.CLAIM_METHOD,
                {"request_id": "captured-unknown", "lease_id": "x", "reader": 0, "readers": 1},
                10.0,
                key,
            )
        except Exception:  # noqa: BLE001 - any answer; the capture is the call
            pass
    finally:
        hs._channels = real
    assert {p.rsplit("/", 1)[1] for p, _, _ in recorder.sent} == {hs.METHOD, hs.CLAIM_METHOD}, (
        recorder.sent
    )
    return recorder.sent


def _attacker(
    stop: threading.Event,
    address: str,
    key: DeploymentKey,
    captured: list,
    proxy_url: str,
    tally: dict[str, list],
) -> None:
    """Until ``stop``: replays the captured side-channel calls, floods claims for unknown ids
    (unsigned, and signed with fresh nonces as a slow peer's would be), and sends the proxy
    batched prompts and 1009-character request ids."""
    import random

    import requests

    from hybridkv.connector import pd_handshake as hs

    rng, http = random.Random(99), requests.Session()
    k = 0
    while not stop.is_set():
        k += 1
        for path, body, metadata in captured:
            tally["replay"].append(_raw_call(address, path, body, metadata))
        for i in range(8):
            signed = key if i % 2 else None
            try:
                hs._call(
                    address,
                    hs.CLAIM_METHOD,
                    {"request_id": f"flood-{k}-{i}", "lease_id": "x", "reader": 0, "readers": 1},
                    5.0,
                    signed,
                )
                tally["flood"].append("OK")
            except Exception as e:  # noqa: BLE001 - the answer's kind is what is tallied
                tally["flood"].append(
                    type(e).__name__ + ":" + str(getattr(e, "code", lambda: "")())
                )
        if k % 3 == 1:
            batch = [[rng.randrange(3, 500) for _ in range(300)] for _ in range(3)]
            r = http.post(
                proxy_url + "/v1/completions",
                timeout=300,
                json={"model": _MODEL[0], "prompt": batch, "max_tokens": 2, "temperature": 0.0},
            )
            tally["batch"].append(r.status_code)
        elif k % 3 == 2:
            prompt = [rng.randrange(3, 500) for _ in range(300)]
            r = http.post(
                proxy_url + "/v1/completions",
                timeout=300,
                json={
                    "model": _MODEL[0],
                    "prompt": prompt,
                    "max_tokens": 2,
                    "temperature": 0.0,
                    "request_id": "r" * 1009,
                },
            )
            tally["long_id"].append(r.status_code)


def test_a_hostile_client_does_not_turn_pd_off_for_legitimate_sessions(stack, http):
    """4 legitimate agentic sessions through the proxy while an attacker replays captured
    side-channel calls, floods lease claims for unknown ids, and sends batched prompts and
    1009-character request ids, for HYBRIDKV_HOSTILE_S seconds: every legitimate turn equals
    a recompute (fresh cache_salt), at least 90 % of the run's hand-overs are READ (decode's
    vllm:hybridkv_pd_reads_total against the proxy's hybridkv_proxy_hand_overs_total), every
    lease of the run is released (none waits out lease_s: a batch forwarded whole or a client's
    long id leaves one to expire), so the lease budget is back to 0, no replay is answered, and
    every server still serves."""
    import requests

    key = load_key(str(stack.secret_file), False)
    warm = Session(seed=40, first_tokens=300, growth_tokens=200).prompt
    params = _prefill_params(http, stack, warm)
    address = f"{params['remote_host']}:{params['remote_port']}"
    _completions(_post(http, stack.decode.url, warm, params=params))  # read: its lease ends
    captured = _capture(address, key)
    proxy_before = _counter_sum(
        http.get(stack.url + "/metrics", timeout=30).text, "hybridkv_proxy_hand_overs_total"
    )
    decode_before, prefill_before = (
        _pd_counters(http, stack.decode.url),
        _pd_counters(http, stack.prefill.url),
    )
    prefill_log_before = len(Path(stack.prefill.log_path).read_text(errors="replace"))
    decode_log_before = len(_log(stack))
    causes_before = _failure_causes(http, stack.decode.url)

    stop = threading.Event()
    turns: list[tuple[list[int], Completion]] = []
    errors: list[str] = []

    def legit(seed: int) -> None:
        s, own = Session(seed=seed, first_tokens=300, growth_tokens=200), requests.Session()
        while not stop.is_set():
            try:
                got = _completions(_post(own, stack.url, s.prompt, top=TOP_LOGPROBS))[0]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"session {seed}: {e!r}")
                return
            turns.append((list(s.prompt), got))
            s.extend(got.token_ids)
            if len(s.prompt) > 3000:  # within max_model_len
                s = Session(seed=seed + 100, first_tokens=300, growth_tokens=200)

    tally: dict[str, list] = {"replay": [], "flood": [], "batch": [], "long_id": []}
    threads = [threading.Thread(target=legit, args=(50 + i,)) for i in range(LEGIT_SESSIONS)]
    threads.append(
        threading.Thread(target=_attacker, args=(stop, address, key, captured, stack.url, tally))
    )
    for t in threads:
        t.start()
    time.sleep(HOSTILE_S)
    stop.set()
    stopped = time.monotonic()
    for t in threads:
        t.join(300)
    ended = time.monotonic()
    print(f"\nthreads done {ended - stopped:.1f} s after the stop")
    print(
        f"hostile run: {len(turns)} legitimate turns, replays {dict(_counts(tally['replay']))}, "
        f"claims {dict(_counts(tally['flood']))}, batches {tally['batch']}, long ids {tally['long_id']}"
    )
    assert not errors, errors
    assert len(turns) >= LEGIT_SESSIONS and tally["batch"] and tally["long_id"]
    assert set(tally["batch"]) == set(tally["long_id"]) == {200}
    assert "OK" not in tally["replay"], "a replayed side-channel call was answered"

    # Every lease ends (the budget is back to 0), waited for up to lease_s; none of the run's
    # leases expires (at most those held before it began may).
    while True:
        pre = _pd_counters(http, stack.prefill.url)
        held = _held(pre)
        if held == 0 or time.monotonic() > ended + LEASE_S + 15:
            break
        time.sleep(1)
    assert held == 0, (
        f"{held} leases still held {time.monotonic() - ended:.0f} s after the run: {pre}"
    )
    expired = pre["leases_expired"] - prefill_before["leases_expired"]
    assert expired <= _held(prefill_before), (
        f"{expired:.0f} leases expired, {_held(prefill_before):.0f} were held before the run: some of the run's "
        "leases were never released (they waited out lease_s)"
    )
    print(
        f"leases {pre['leases'] - prefill_before['leases']:.0f}, all released "
        f"{time.monotonic() - ended:.1f} s after the attack stopped"
    )
    assert (
        "unread leases hold"
        not in Path(stack.prefill.log_path).read_text(errors="replace")[prefill_log_before:]
    )

    hand_overs = (
        _counter_sum(
            http.get(stack.url + "/metrics", timeout=30).text, "hybridkv_proxy_hand_overs_total"
        )
        - proxy_before
    )
    deadline = time.monotonic() + 15  # the workers' stats reach /metrics with a later engine step
    while True:
        dec = _pd_counters(http, stack.decode.url)
        reads = dec["reads"] - decode_before["reads"]
        if reads >= 0.9 * hand_overs or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(
        f"hand-overs {hand_overs:.0f}, READ {reads:.0f}, "
        f"failed reads {dec['failed_reads'] - decode_before['failed_reads']:.0f}"
    )
    causes = {
        c: n - causes_before.get(c, 0)
        for c, n in _failure_causes(http, stack.decode.url).items()
        if n != causes_before.get(c, 0)
    }
    print(f"failed reads by cause: {causes}")
    warnings = [
        line
        for line in _log(stack)[decode_log_before:].splitlines()
        if "hybridkv" in line and "WARN" in line
    ]
    print("decode's last warnings:", *warnings[-6:], sep="\n  ")
    assert reads >= 0.9 * hand_overs, (
        f"only {reads:.0f} of {hand_overs:.0f} hand-overs were READ; failed by cause "
        f"{causes}; decode's warnings:\n" + "\n".join(warnings[-12:])
    )

    start = time.monotonic()
    for prompt, got in turns:
        ref = _recompute(
            http, stack, prompt, top=TOP_LOGPROBS
        )  # top-k: a greedy near-tie is told apart
        assert matches(got, ref), f"a legitimate turn differs from a recompute: {got} vs {ref}"
    print(f"{len(turns)} recomputes {time.monotonic() - start:.1f} s")
    for url in (stack.url, stack.prefill.url, stack.decode.url):
        assert http.get(url + "/health", timeout=30).status_code == 200, url
    assert (
        stack._proxy.poll() is None
        and stack.prefill.proc.poll() is None
        and stack.decode.proc.poll() is None
    )
    for log in (stack.prefill.log_path, stack.decode.log_path):
        assert "EngineDeadError" not in Path(log).read_text(errors="replace")


def _failure_causes(http, url: str) -> dict[str, float]:  # noqa: ANN001
    out: dict[str, float] = {}
    for line in http.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:hybridkv_pd_failures_total{") and 'cause="' in line:
            cause = line.split('cause="', 1)[1].split('"', 1)[0]
            out[cause] = out.get(cause, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _held(counters: dict[str, float]) -> float:
    """Leases the prefill holds now (each ends released or expired, once)."""
    return counters["leases"] - counters["leases_released"] - counters["leases_expired"]


def _counts(items: list) -> collections.Counter:

    return collections.Counter(items)
