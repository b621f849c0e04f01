"""Hostile ``kv_transfer_params`` through the REAL scheduler side of HybridPDConnector.

The connector is built as vLLM builds it (``VllmConfig`` + ``KVTransferConfig``, scheduler
role) and bound to a real ``KVCacheManager``; each example walks vLLM's scheduler order
(on_new_request -> get_num_new_matched_tokens -> allocate_slots ->
update_state_after_alloc -> build_connector_meta -> request_finished). Before
``pd_params``, a string in ``remote_num_tokens`` raised here, inside ``schedule()``,
and killed the engine; forged well-formed values made decode read wherever they said.
The property: no exception escapes, and a set is acted on (tokens offered, a READ
job built) iff it is exactly what the prefill side signed for THIS prompt.
"""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from hybridkv.cli.harness.kv_manager import Geometry, fa, make_request, sw
from hybridkv.connector.pd_auth import PURPOSE_PARAMS, load_key, write_secret_file
from hybridkv.connector.pd_connector import HybridPDConnector
from hybridkv.connector.pd_metadata import PDHandshakeMetadata, PDWorkerMetadata
from hybridkv.connector.pd_params import (
    LocalLayout,
    PromptView,
    Refused,
    RemotePrefill,
    covered_hashes,
    issue_remote_prefill,
    parse_kv_transfer_params,
)
from hybridkv.connector.store_config import ConfigError
from tests.unit.strategies import PROPERTY

# Three groups, two block sizes (scheduler block 32, hash block 16), like gemma4's.
GEO = Geometry([sw(16, 48), fa(16), fa(32, heads=2)], hash_block_size=16, num_blocks=300)
HOST, PORT = "127.0.0.1", 45678
# The deployment secret of these tests (a fresh one per run, as PDStack makes).
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-pd-params-")) / "secret"))


def _step_output() -> SimpleNamespace:
    """The fields of a SchedulerOutput the P/D connector reads when it builds a step's metadata
    (a step that runs tokens, so no idle pacing applies)."""
    return SimpleNamespace(
        kv_cache_block_copies=(), total_num_scheduled_tokens=1, finished_req_ids=set()
    )


def _connector(role: str, secret_file: str | None, policy: str = "recompute", geo: Geometry = GEO):
    extra: dict[str, Any] = (
        {"auth_secret_file": secret_file} if secret_file else {"allow_unauthenticated": True}
    )
    cfg = VllmConfig()
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="HybridPDConnector",
        kv_role=role,
        kv_load_failure_policy=policy,
        kv_connector_extra_config=extra,
    )
    conn = HybridPDConnector(cfg, KVConnectorRole.SCHEDULER, geo.kv_cache_config())
    manager = geo.manager()
    conn.bind_kv_cache_manager(manager)
    return conn, manager


@pytest.fixture(scope="module")
def secret_file() -> str:
    return SECRET


@pytest.fixture(scope="module")
def decode(secret_file):
    return _connector("kv_consumer", secret_file)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def _signed(
    secret_file: str | None, tokens: list[int], seed: int = 0, geo: Geometry = GEO
) -> dict[str, Any]:
    """What a prefill instance issues for ``tokens``: positional block ids of every group,
    distinct (one shared pool), signed over the prompt's block hashes."""
    req = make_request(geo, tokens)
    n = len(tokens)
    rng = random.Random(seed)
    ids = rng.sample(range(1, geo.num_blocks), sum(math.ceil(n / s.block_size) for s in geo.specs))
    groups, at = [], 0
    for s in geo.specs:
        k = math.ceil(n / s.block_size)
        groups.append(ids[at : at + k])
        at += k
    num_tokens = min(n, len(req.block_hashes) * geo.hash_block_size)
    p = RemotePrefill(
        "prefill-engine",
        "cmpl-prefill-1",
        HOST,
        PORT,
        tuple(tuple(g) for g in groups),
        num_tokens,
        "ab" * 16,
    )
    key = load_key(secret_file, False) if secret_file else None
    return issue_remote_prefill(p, key, req.block_hashes, geo.hash_block_size)


def _drive(conn, manager, tokens: list[int], raw: Any) -> tuple[int, list]:
    """One request through the scheduler hooks in vLLM's order; (tokens offered, READ jobs)."""
    req = make_request(GEO, tokens)
    req.kv_transfer_params = raw
    conn.on_new_request(req)
    computed, n_local = manager.get_computed_blocks(req)[:2]
    n_ext, is_async = conn.get_num_new_matched_tokens(req, n_local)
    n_new = 0 if is_async else req.num_tokens - n_local - n_ext
    blocks = manager.allocate_slots(
        req,
        n_new,
        num_new_computed_tokens=n_local,
        new_computed_blocks=computed,
        num_external_computed_tokens=n_ext,
        delay_cache_blocks=is_async,
    )
    assert blocks is not None, "pool too small for the test prompt"
    conn.update_state_after_alloc(
        req, manager.get_blocks(req.request_id) if n_ext else blocks, n_ext
    )
    meta = conn.build_connector_meta(_step_output())
    # The worker's answer (reads over) unpins; then the request finishes and frees.
    conn.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=PDWorkerMetadata({req.request_id: 1}))
    )
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    conn.request_finished_all_groups(req, tuple([] for _ in GEO.specs))
    manager.free(req)
    assert manager.reset_prefix_cache(), (
        "a block stayed in use (a pin the connector never released?)"
    )
    return n_ext, meta.reads


def _handover(n: int) -> int:
    return (n - 1) // 32 * 32


HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(
        ["abc", "x", "", "1e9", "127.0.0.1; rm -rf /", "a" * 2000, "0" * 32, "ab" * 32]
    ),
    st.lists(st.integers(-5, 10**6), max_size=6),
    st.lists(st.lists(st.integers(-3, 400), max_size=40), max_size=5),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
FIELDS = [
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_num_tokens",
    "remote_lease_id",
    "remote_mac",
    "remote_ports",
]


@st.composite
def hostile_params(draw):
    """A valid signed set with 1-3 fields replaced or dropped, one group's ids nudged,
    an unknown key added, or the whole value replaced."""
    n = draw(st.integers(1, 300))
    valid = _signed(SECRET, _prompt(n, 1), seed=draw(st.integers(0, 5)))
    raw: Any = dict(valid)
    how = draw(st.sampled_from(["fields", "fields", "nudge", "extra", "whole"]))
    if how == "fields":
        for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
            if draw(st.booleans()):
                raw[name] = draw(HOSTILE)
            else:
                raw.pop(name, None)
    elif how == "nudge" and any(valid["remote_block_ids"]):
        g = draw(st.sampled_from([i for i, ids in enumerate(valid["remote_block_ids"]) if ids]))
        ids = list(valid["remote_block_ids"][g])
        ids[draw(st.integers(0, len(ids) - 1))] = draw(
            st.sampled_from([0, -1, 299, 300, 10**18, ids[0]])
        )
        raw["remote_block_ids"] = [list(x) for x in valid["remote_block_ids"]]
        raw["remote_block_ids"][g] = ids
    elif how == "extra":
        raw[
            draw(
                st.sampled_from(
                    ["_hkv_read", "_hkv_truncated", "remote_prefill_cached_tokens", "x"]
                )
            )
        ] = draw(HOSTILE)
    else:
        raw = draw(HOSTILE)
    return n, valid, raw


def _acted_on(valid: dict, raw: Any) -> bool:
    """The one set that must be accepted: every field decode acts on is what was signed."""
    if not isinstance(raw, dict) or raw.get("do_remote_prefill") is not True:
        return False
    if raw.get("do_remote_decode") is not None and raw.get("do_remote_decode") is not False:
        return False  # (0 == False in Python, but JSON 0 is not a flag: refused)
    raw = dict(raw)
    if "remote_ports" not in raw and "remote_port" in raw:
        raw["remote_ports"] = [raw["remote_port"]]  # absent: one rank at remote_port
    return all(
        raw.get(k, object()) == valid[k]
        and type(raw.get(k)) is type(valid[k])
        and (k != "remote_ports" or all(type(x) is int for x in raw[k]))
        for k in FIELDS
        if k not in ("do_remote_prefill", "do_remote_decode")
    )


@pytest.fixture(scope="module")
def unauthenticated():
    return _connector("kv_consumer", None)


def test_valid_signed_params_are_read_exactly(decode, secret_file):
    conn, manager = decode
    tokens = _prompt(200, 2)
    params = _signed(secret_file, tokens)
    n_ext, reads = _drive(conn, manager, tokens, params)
    assert n_ext == _handover(200) == 192
    assert len(reads) == 1
    job = reads[0]
    assert (
        job.remote_host,
        job.remote_port,
        job.remote_engine_id,
        job.remote_req_id,
        job.lease_id,
    ) == (HOST, PORT, "prefill-engine", "cmpl-prefill-1", "ab" * 16)
    # dense groups pair by position over the 192 tokens read: sw(16,48) only its live window
    # tail is allocated, fa(16) all 12 blocks, fa(32) all 6
    assert job.local_block_ids[1] and len(job.remote_block_ids[1]) == 12 == len(
        job.local_block_ids[1]
    )
    assert job.remote_block_ids[1] == params["remote_block_ids"][1][:12]
    assert job.remote_block_ids[2] == params["remote_block_ids"][2][:6]
    assert job.refused is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("remote_num_tokens", "abc"),
        ("remote_port", "x"),
        ("remote_block_ids", 5),
        ("remote_port", 0),
        ("remote_port", 70000),
        ("remote_num_tokens", -1),
        ("remote_num_tokens", 10**12),
        ("remote_host", "a b"),
        ("remote_block_ids", [[1], [2]]),
        ("remote_block_ids", [[-1], [], []]),
        ("remote_block_ids", [[10**9], [], []]),
        ("remote_block_ids", [list(range(1, 30)), [], []]),
        ("remote_block_ids", [[7], [7], []]),
        ("remote_lease_id", 5),
        ("do_remote_prefill", "yes"),
        ("remote_mac", "0" * 64),
        ("remote_mac", None),
        ("remote_engine_id", "other-engine"),
        ("remote_port", PORT + 1),
        ("remote_host", "10.0.0.9"),
    ],
)
def test_each_malformed_or_altered_field_is_refused_and_named(
    decode, secret_file, field, value, vllm_caplog
):
    caplog = vllm_caplog
    conn, manager = decode
    tokens = _prompt(200, 3)
    params = _signed(secret_file, tokens) | {field: value}
    n_ext, reads = _drive(conn, manager, tokens, params)
    assert (n_ext, reads) == (0, [])
    named = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert named and all(
        f"kv_transfer_params.{field}" in m or "kv_transfer_params.remote_mac" in m for m in named
    ), named


def test_params_signed_for_another_prompt_are_refused(decode, secret_file):
    """Replay: a set the prefill side really issued, sent with a different prompt."""
    conn, manager = decode
    a, b = _prompt(200, 4), _prompt(200, 5)
    assert _drive(conn, manager, b, _signed(secret_file, a)) == (0, [])
    # ...the same prompt with one token changed inside the covered prefix
    c = list(a)
    c[5] += 1
    assert _drive(conn, manager, c, _signed(secret_file, a)) == (0, [])
    # the control: the same set with its own prompt is read
    assert _drive(conn, manager, a, _signed(secret_file, a))[0] == 192


def test_params_signed_with_another_secret_are_refused(decode, tmp_path):
    conn, manager = decode
    other = str(write_secret_file(tmp_path / "other"))
    tokens = _prompt(200, 6)
    assert _drive(conn, manager, tokens, _signed(other, tokens)) == (0, [])


def test_do_remote_decode_on_a_decode_only_instance_is_refused(decode):
    conn, _ = decode
    req = make_request(GEO, _prompt(100, 7))
    req.kv_transfer_params = {"do_remote_decode": True}
    conn.on_new_request(req)
    assert isinstance(conn._scheduler.params(req), Refused)
    assert conn._scheduler.params(req).field == "do_remote_decode"
    assert req.num_prompt_tokens == 100  # not truncated, no lease at finish
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    conn.set_xfer_handshake_metadata({0: PDHandshakeMetadata(HOST, PORT, 0)})
    assert conn.request_finished_all_groups(req, ([1], [2], [3])) == (False, None)


def test_remote_prefill_on_a_prefill_only_instance_is_refused(secret_file):
    conn, manager = _connector("kv_producer", secret_file)
    tokens = _prompt(200, 8)
    assert _drive(conn, manager, tokens, _signed(secret_file, tokens)) == (0, [])


def test_with_policy_fail_a_refused_set_fails_its_request(secret_file):
    """kv_load_failure_policy=fail: tokens are offered and the load is refused, so vLLM
    ends the request with an error (the worker reports the refused job as failed)."""
    conn, manager = _connector("kv_consumer", secret_file, policy="fail")
    tokens = _prompt(200, 9)
    n_ext, reads = _drive(
        conn, manager, tokens, _signed(secret_file, tokens) | {"remote_port": "x"}
    )
    assert n_ext == 192 and len(reads) == 1
    assert reads[0].refused and "kv_transfer_params.remote_port" in reads[0].refused
    assert reads[0].remote_host == "" and reads[0].remote_block_ids == []


def test_issued_params_round_trip_through_a_real_prefill_scheduler(secret_file, decode):
    """The prefill scheduler's own request_finished output is accepted by decode for the
    same prompt (the signed fields are listed once, for both sides)."""
    prefill, pmanager = _connector("kv_producer", secret_file)
    prefill.set_xfer_handshake_metadata({0: PDHandshakeMetadata(HOST, PORT, 0)})
    tokens = _prompt(200, 10)
    req = make_request(GEO, tokens)
    req.kv_transfer_params = {"do_remote_decode": True}
    prefill.on_new_request(req)
    blocks = pmanager.allocate_slots(req, 200)
    req.num_computed_tokens = 200
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = prefill.request_finished_all_groups(req, blocks.get_block_ids())
    # The connector holds the lease's blocks itself (pd_lease_pins): vLLM frees the request now.
    assert delay is False and params["remote_mac"] and len(params["remote_lease_id"]) == 32
    meta = prefill.build_connector_meta(_step_output())
    assert [(x.req_id, x.lease_id, x.ttl_s) for x in meta.leases] == [
        (req.request_id, params["remote_lease_id"], 60.0)
    ]
    conn, manager = decode
    n_ext, reads = _drive(conn, manager, tokens, params)
    assert n_ext == 192 and reads[0].remote_req_id == req.request_id
    assert _drive(conn, manager, _prompt(200, 11), params) == (0, [])


@PROPERTY
@given(hostile_params())
def test_fuzz_no_exception_and_only_the_signed_set_is_acted_on(decode, case):
    conn, manager = decode
    n, valid, raw = case
    tokens = _prompt(n, 1)
    n_ext, reads = _drive(conn, manager, tokens, raw)
    if _acted_on(valid, raw) and _handover(n) > 0:
        assert n_ext == _handover(n) and len(reads) == 1 and reads[0].remote_port == PORT
    else:
        assert (n_ext, [r for r in reads if not r.release_only]) == (0, [])


@PROPERTY
@given(hostile_params())
def test_fuzz_unauthenticated_still_never_raises_and_types_hold(unauthenticated, case):
    conn, manager = unauthenticated
    n, _, raw = case
    n_ext, reads = _drive(conn, manager, _prompt(n, 1), raw)
    for job in reads:
        assert isinstance(job.remote_port, int) and 1 <= job.remote_port <= 65535
        assert all(
            isinstance(b, int) and 0 < b < GEO.num_blocks for g in job.remote_block_ids for b in g
        )
    assert n_ext <= _handover(n) if n_ext else True


def test_without_secret_or_explicit_choice_the_connector_refuses_to_start(monkeypatch):
    monkeypatch.delenv("HYBRIDKV_AUTH_SECRET", raising=False)
    monkeypatch.delenv("HYBRIDKV_AUTH_SECRET_FILE", raising=False)
    cfg = VllmConfig()
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="HybridPDConnector", kv_role="kv_consumer"
    )
    with pytest.raises(ConfigError, match="auth_secret_file.*allow_unauthenticated"):
        HybridPDConnector(cfg, KVConnectorRole.SCHEDULER, GEO.kv_cache_config())


def test_secret_file_rules(tmp_path, monkeypatch):
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 16"):
        load_key(str(short), False)
    loose = write_secret_file(tmp_path / "loose")
    loose.chmod(0o666)
    with pytest.raises(ConfigError, match="writable by group or others"):
        load_key(str(loose), False)
    monkeypatch.setenv("HYBRIDKV_AUTH_SECRET", "env-secret-0123456789abcdef")
    assert load_key(None, False).secret == b"env-secret-0123456789abcdef"


def test_parse_is_total_on_the_local_layout_bounds():
    """Direct unit of the bounds: the prompt's block count per group and the pool size."""
    local = LocalLayout(False, True, (16, 32), 10, 16)
    prompt = PromptView(50, [b"h1", b"h2"])  # (a real 50-token prompt has 3 hashes)
    base = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 1,
        "remote_num_tokens": 32,
        "remote_lease_id": "0" * 32,
    }
    ok = parse_kv_transfer_params(
        base | {"remote_block_ids": [[1, 2, 3, 0], [4, 5]]}, prompt, local, None
    )
    assert isinstance(ok, RemotePrefill) and ok.block_ids == ((1, 2, 3, 0), (4, 5))
    for ids, field in [
        ([[1, 2, 3, 4, 6], [5]], "remote_block_ids[0]"),
        ([[1], [2, 3, 4]], "remote_block_ids[1]"),
        ([[10], []], "remote_block_ids[0]"),
    ]:
        r = parse_kv_transfer_params(base | {"remote_block_ids": ids}, prompt, local, None)
        assert isinstance(r, Refused) and r.field == field, (ids, r)
    r = parse_kv_transfer_params(
        base | {"remote_block_ids": [[], []], "remote_num_tokens": 48}, prompt, local, None
    )
    assert isinstance(r, Refused) and r.field == "remote_num_tokens"  # 48 tokens, 2 hashes of 16
    assert covered_hashes([b"a", b"b"], 33, 16) == [b"a", b"b"]
    assert PURPOSE_PARAMS.startswith("hybridkv-pd-params")


def test_block_sizes_that_differ_from_this_instances_are_refused_naming_them(secret_file):
    """A prefill whose KV cache groups chose other block sizes (vLLM aligns a Mamba state's page
    per TP size and speculative config) is refused naming the block sizes, before the MAC (whose
    hashes were taken at the prefill's block size) fails and names the secret."""
    key = load_key(secret_file, False)
    local = LocalLayout(False, True, (1920, 1920), 64, 1920)
    prompt = PromptView(4000, [bytes([i]) * 32 for i in range(2)])
    p = RemotePrefill("e", "r", "h", 1, ((1, 2), (3, 4)), 3840, "0" * 32, (1,))
    same = issue_remote_prefill(p, key, prompt.block_hashes, 1920, (1920, 1920))
    assert same["remote_block_sizes"] == [1920, 1920]
    assert parse_kv_transfer_params(same, prompt, local, key) == p
    other = issue_remote_prefill(p, key, prompt.block_hashes, 1920, (1024, 1024))
    r = parse_kv_transfer_params(other, prompt, local, key)
    assert r == Refused(
        "remote_block_sizes",
        "is [1024, 1024]: the prefill's KV cache groups have block_size=1024, this instance's "
        "block_size=1920",
        "serve prefill and decode with the same block sizes: the same model, --block-size, "
        "speculative config and, where vLLM aligns blocks to a Mamba state's page, TP size",
    )
    for bad in ("1920", [1920, True], [1920.0, 1920], list(range(65))):
        r = parse_kv_transfer_params(same | {"remote_block_sizes": bad}, prompt, local, key)
        assert isinstance(r, Refused) and r.field == "remote_block_sizes", (bad, r)
    # Optional and unsigned: a set without it is judged by its MAC as before.
    assert (
        parse_kv_transfer_params(
            {k: v for k, v in same.items() if k != "remote_block_sizes"}, prompt, local, key
        )
        == p
    )
