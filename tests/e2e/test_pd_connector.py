"""HybridPDConnector end to end: two real vLLM CPU engines, real NIXL (UCX) and gRPC.

The prefill engine runs each prompt with ``max_tokens=1`` and
``do_remote_decode``; its answer's ``kv_transfer_params`` go with the same prompt
to the decode engine, which pulls the blocks with NIXL READs and generates. The
decode engine keeps its own prefix cache, so from turn 2 it reads only the blocks
it does not hold. Every turn must equal a recompute on the decode engine under a
fresh ``cache_salt`` (the comparison's power is shown by the store tests'
planted-fault controls, which use the same check).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

import pytest

from hybridkv.cli.harness.llm_engine import (
    LogTail,
    Session,
    engine_output_to,
    generate,
    make_llm,
    matches,
    metric,
    shutdown,
    tiny_model,
)
from hybridkv.cli.harness.llm_engine import pd_decode as _decode
from hybridkv.cli.harness.llm_engine import pd_prefill as _prefill
from hybridkv.connector.pd_auth import write_secret_file
from tests.docs_tables import observe
from tests.freeze import freeze

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")  # see pd_worker: IB module crashes CPU hosts at exit

# case -> (tiny model, prefill engine args, decode engine args). Partial mode
# (--prefix-match-unit 64) on both instances: the prefill resumes from its own sub-block
# hits, whose block copies vLLM 0.32 makes only in part (connector/block_copies.py; the
# connector redoes them). vLLM 0.32 applies the unit to Mamba-align groups only, so on
# gemma3 it would change nothing.
CASES = {
    "gemma3": ("gemma3", {}, {}),
    "qwen3next": ("qwen3next", {"block_size": 256}, {"block_size": 256}),
    "qwen3next-partial": (
        "qwen3next",
        {"block_size": 256, "prefix_match_unit": 64},
        {"block_size": 256, "prefix_match_unit": 64},
    ),
}


# The pair's deployment secret (signs kv_transfer_params and the side channel), fresh per run.
SECRET_FILE = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-pd-e2e-")) / "secret"))


def pd_config(role: str, module_path: bool = True, **extra) -> dict:
    cfg = {
        "kv_connector": "HybridPDConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
    }
    if module_path:
        cfg["kv_connector_module_path"] = "hybridkv.connector"
    cfg["kv_connector_extra_config"] = {"auth_secret_file": SECRET_FILE, **extra}
    return cfg


def _external_hits(llm) -> float:
    return metric(llm, "vllm:external_prefix_cache_hits")


_READ_LINE = re.compile(
    r"hybridkv P/D: read (\d+) blocks \((\d+) bytes\) for (\S+) from (\S+) at (\S+) "
    r"\(per group \[([\d, ]*)\]\)"
)
_FAILED_LINE = re.compile(
    r"hybridkv P/D: (READ for \S+ .*failed or was refused|read of \S+ .*(failed|discarded))"
)


def _assert_provenance(log: str, want_groups: list[int], object_bytes: list[int]) -> str:
    """The decode worker's own proof that ONE request's KV arrived over NIXL: no failed or
    refused READ, exactly one read line, blocks per group and bytes as expected. Returns its
    request id. (vLLM's external-hit counter cannot prove it: it counts offered tokens.)"""
    failed = [line for line in log.splitlines() if _FAILED_LINE.search(line)]
    assert not failed, f"a READ failed or was refused: {failed}"
    reads = _READ_LINE.findall(log)
    assert len(reads) == 1, f"expected one P/D read line, got {reads}"
    blocks, nbytes, req, _engine, _addr, groups = reads[0]
    per_group = [int(x) for x in groups.split(",")] if groups.strip() else []
    assert per_group == want_groups, f"blocks read per group {per_group}, expected {want_groups}"
    assert int(blocks) == sum(want_groups)
    assert int(nbytes) == sum(n * b for n, b in zip(want_groups, object_bytes, strict=True))
    return req


def _geometry(worker) -> list[tuple[int, int, bool]]:  # noqa: ANN001 - runs in the decode worker
    """Per KV-cache group: (block size, bytes of one block over this worker's layers, is Mamba)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group()._worker
    out = []
    for group, g in zip(
        w._kv_cache_config.kv_cache_groups, w._transport.layout.groups, strict=True
    ):
        spec = group.kv_cache_spec
        out.append(
            (
                int(spec.block_size),
                0 if g is None else g.object_bytes,
                "Mamba" in type(spec).__name__,
            )
        )
    return out


def _expected_blocks(
    geometry, remote_block_ids: list[list[int]], local_hit: int, handover: int
) -> list[int]:
    """What decode must read: per attention group the prefill side's non-null blocks of the
    tokens [decode's own hit, hand-over); per Mamba group the one state block at the hand-over."""
    want = []
    for (bs, _, mamba), remote in zip(geometry, remote_block_ids, strict=True):
        if mamba:
            want.append(1 if handover > local_hit else 0)
        else:
            want.append(
                sum(
                    1
                    for i, b in enumerate(remote)
                    if b and i * bs >= local_hit and (i + 1) * bs <= handover
                )
            )
    return want


def _three_turns(kind: str, prefill, decode, read_log) -> None:  # noqa: ANN001
    """Three agentic turns through the pair; ``read_log()`` returns decode's log lines
    written since its last call."""
    geometry = decode.collective_rpc(_geometry)[0]
    align = math.lcm(*(bs for bs, _, _ in geometry))
    session = Session(seed=21)
    rows = []
    for turn in range(1, 4):
        params = _prefill(prefill, session.prompt)
        assert params and params["do_remote_prefill"] and params["remote_block_ids"], params
        before, local_before = _external_hits(decode), metric(decode, "vllm:prefix_cache_hits")
        read_log()  # this turn's decode log only
        got = _decode(decode, session.prompt, params)
        log = read_log()
        pulled = _external_hits(decode) - before
        local_hit = int(metric(decode, "vllm:prefix_cache_hits") - local_before)
        handover = (len(session.prompt) - 1) // align * align
        want = _expected_blocks(geometry, params["remote_block_ids"], local_hit, handover)
        print(log[-3000:] if "hybridkv P/D: read" not in log else "", end="")
        req = _assert_provenance(log, want, [b for _, b, _ in geometry])
        ref = generate(decode, session.prompt, cache_salt=f"pd-recompute-{kind}-{turn}")
        rows.append(
            (
                turn,
                len(session.prompt),
                handover,
                local_hit,
                int(pulled),
                want,
                req,
                matches(got, ref),
            )
        )
        session.extend(got.token_ids)
    print(
        f"\nP/D {kind}: turn, prompt, hand-over, decode's own hit, tokens pulled, blocks read per group, "
        "request, matches_recompute"
    )
    for r in rows:
        print("  ", *r)
    prev = 0
    for turn, prompt, handover, local_hit, pulled, want, _req, ok in rows:
        assert ok, f"turn {turn} differs from recompute"
        assert pulled == handover - local_hit > 0, (
            f"turn {turn}: pulled {pulled} != hand-over - own hits"
        )
        assert sum(want) > 0
        if turn == 1:
            assert local_hit == 0, "turn 1: decode holds nothing of this session"
        else:  # the previous prompt's last scheduler-block boundary is decode's own hit at least
            assert local_hit >= (prev - 1) // align * align
        prev = prompt
    cells = {
        f"turn {t}": f"{local_hit} + {pulled} of {prompt}"
        for t, prompt, _, local_hit, pulled, *_ in rows
    }
    observe("pd-e2e", kind, {**cells, "matches recompute": "all"})


@pytest.mark.parametrize("kind", [k for k in CASES if k != "gemma3"])  # gemma3: TestGemma3Pair
def test_pd_three_turns_match_recompute(kind, monkeypatch, capfd):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(_geometry)
    model_kind, prefill_args, decode_args = CASES[kind]
    model = tiny_model(model_kind)
    prefill = make_llm(model, pd_config("kv_producer"), **prefill_args)
    decode = make_llm(model, pd_config("kv_consumer"), disable_log_stats=False, **decode_args)
    _three_turns(kind, prefill, decode, lambda: "".join(capfd.readouterr()))
    del prefill, decode


def _corrupt_blocks(worker, group: int, block_ids: list[int], seed: int) -> int:  # noqa: ANN001 - runs in a vLLM worker
    """Overwrite blocks of one KV-cache group in this (prefill) worker's memory with noise.

    The planted fault for P/D: decode then READs wrong bytes that no layer of the
    connector can tell from right ones, so only the comparison with a recompute can."""
    import ctypes
    import random

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    layout = get_kv_transfer_group()._worker._transport.layout.groups[group]
    addrs, sizes = layout.regions(block_ids)
    rng = random.Random(seed)
    written = 0
    for block_addrs, block_sizes in zip(addrs, sizes):
        for addr, size in zip(block_addrs, block_sizes):
            noise = bytes(rng.getrandbits(8) for _ in range(size))
            ctypes.memmove(addr, noise, size)
            written += size
    return written


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _start_prefill(model: str):  # noqa: ANN202
    """A prefill engine and the pids of its processes (engine core, worker: NIXL agent, handshake server)."""
    before = _children()
    llm = make_llm(model, pd_config("kv_producer"))
    return llm, _children() - before


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def doomed_prefill():  # noqa: ANN201
    """One gemma3 prefill engine over ``UCX_TLS=tcp`` for the two tests that SIGKILL their
    prefill instance (one boot for both): the killed-during-the-read test (first: it freezes
    and kills it) and the policy-fail test, whose prefill leg runs here at boot (seed 26), so
    it has its ``kv_transfer_params`` from an instance that is dead when its decode sees them
    (it sends the SIGKILL itself too). Yields (engine, its pids, those params)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_TLS", "tcp")
        prefill, pids = _start_prefill(tiny_model("gemma3"))
    yield prefill, pids, _prefill(prefill, Session(seed=26).prompt)
    shutdown(prefill)


def test_prefill_instance_killed_during_the_read_decode_recomputes(
    monkeypatch, capfd, doomed_prefill
):  # noqa: ANN001
    """The prefill instance dies while decode's READ is in flight.

    Over ``UCX_TLS=tcp`` (as between hosts) a READ needs the target's progress
    thread, so freezing the prefill processes (SIGSTOP) after turn 1's handshake
    holds turn 2's READ open; they are then killed (SIGKILL) with the READ posted
    and unanswered. (On one host UCX's default ``cma`` copies in one syscall, too
    fast to interrupt.) Decode must report the failed load and recompute: output
    equal to a recompute, well within ``read_timeout_s``, never on partial KV."""
    import signal as _signal
    import threading
    import time

    monkeypatch.setenv("UCX_TLS", "tcp")
    model = tiny_model("gemma3")
    prefill, prefill_pids, _ = doomed_prefill
    decode = make_llm(model, pd_config("kv_consumer", read_timeout_s=20), disable_log_stats=False)
    session = Session(seed=25)
    params = _prefill(prefill, session.prompt)  # turn 1: handshake + first READ over tcp
    hits = _external_hits(decode)
    first = _decode(decode, session.prompt, params)
    assert _external_hits(decode) > hits, "turn 1 must be read from the prefill side"
    session.extend(first.token_ids)

    params = _prefill(prefill, session.prompt)
    freeze(*prefill_pids)
    result: dict = {}

    def run_decode(llm) -> None:  # noqa: ANN001
        result["got"] = _decode(llm, session.prompt, params)

    worker = threading.Thread(target=run_decode, args=(decode,), daemon=True)
    worker.start()
    worker.join(
        4.0
    )  # the decode READ is posted within a step or two, then waits on the frozen peer
    frozen_alive = worker.is_alive()
    t_kill = time.monotonic()
    _signal_all(prefill_pids, _signal.SIGKILL)
    worker.join(60.0)
    elapsed = time.monotonic() - t_kill
    assert not worker.is_alive(), "decode hung after the prefill instance died"
    got = result["got"]
    ref = generate(decode, session.prompt, cache_salt="pd-killed-mid-read-recompute")
    out, err = capfd.readouterr()
    log = out + err
    print(
        f"\nprefill killed during the READ: decode done {elapsed:.1f}s after the kill; "
        f"matches recompute: {matches(got, ref)}"
    )
    assert frozen_alive, (
        "decode finished while the prefill side was frozen: the READ was not in flight"
    )
    said = [
        line
        for line in log.splitlines()
        if "hybridkv" in line and ("read of" in line or "lease" in line)
    ]
    print("\n".join(said))
    assert any("read of" in line and "failed" in line for line in said), (
        "the failed READ must be reported"
    )
    assert matches(got, ref), "decode produced output from a READ the prefill side died during"
    assert elapsed < 20, "decode waited past its read timeout"
    del decode


def test_with_policy_fail_a_failed_read_fails_only_that_request(capfd, doomed_prefill):  # noqa: ANN001
    """``kv_load_failure_policy=fail``: the request whose READ failed (prefill killed)
    ends with finish_reason 'error' and no tokens, never output computed on partial KV,
    and the decode engine goes on serving."""
    import signal as _signal

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = tiny_model("gemma3")
    _prefill_llm, prefill_pids, params = doomed_prefill  # params: seed 26's prefill leg
    decode_cfg = pd_config("kv_consumer") | {"kv_load_failure_policy": "fail"}
    decode = make_llm(model, decode_cfg, disable_log_stats=False)
    session = Session(seed=26)
    _signal_all(prefill_pids, _signal.SIGKILL)
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        detokenize=False,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params},
    )
    out = decode.generate([TokensPrompt(prompt_token_ids=session.prompt)], sp, use_tqdm=False)[0]
    log = "".join(capfd.readouterr())
    print(
        f"\npolicy fail: finish_reason={out.outputs[0].finish_reason!r}, tokens={len(out.outputs[0].token_ids)}"
    )
    assert out.outputs[0].finish_reason == "error" and not out.outputs[0].token_ids
    # (killed before any handshake: the handshake is what fails, and says where and why)
    assert "handshake with 127.0.0.1" in log and "unreachable" in log, (
        "the failed load must be reported"
    )
    after = generate(
        decode, session.prompt, cache_salt="pd-fail-policy-next"
    )  # the engine still serves
    assert len(after.token_ids) == 8
    del decode


class TestGemma3Pair:
    """The gemma3 cases on one prefill and one decode engine, started once for the class
    (before: a pair per test, 2 engine boots each). Each test uses its own session seed,
    so no test's prompt shares a block with another's: what one test leaves in an
    engine's prefix cache (the planted test's corrupted blocks included) cannot serve
    another. Tests that need an engine configured otherwise start their own beside it.
    The shared engines' output goes to a file (engine_output_to), read with LogTail."""

    @pytest.fixture(scope="class")
    def pair(self, tmp_path_factory):  # noqa: ANN001, ANN201
        log = tmp_path_factory.mktemp("pd-gemma3") / "engines.log"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(callable)
            model = tiny_model("gemma3")
            with engine_output_to(log):
                prefill = make_llm(model, pd_config("kv_producer"))
                # The decode side resolves the connector by the name hybridkv registers (no module path).
                decode = make_llm(
                    model, pd_config("kv_consumer", module_path=False), disable_log_stats=False
                )
            yield model, prefill, decode, LogTail(log)
            shutdown(prefill, decode)

    @pytest.fixture(scope="class")
    def spare_prefill(self, pair):  # noqa: ANN001, ANN201
        """A second prefill engine with a 2 s lease, shared by the expired-lease test (first)
        and the killed-before-the-read test (last: it kills it). One boot for both (a boot
        is ~20-30 s of the suite)."""
        model = pair[0]
        before = _children()
        prefill = make_llm(model, pd_config("kv_producer", lease_s=2))
        yield prefill, _children() - before
        shutdown(prefill)

    def test_three_turns_match_recompute(self, pair):  # noqa: ANN001
        _model, prefill, decode, log = pair
        _three_turns("gemma3", prefill, decode, lambda: log.new())

    def test_planted_fault_in_the_prefill_blocks_is_caught_by_the_recompute_check(self, pair):  # noqa: ANN001
        """The control for the P/D comparisons: one full-attention block corrupted on the
        prefill side after the prefill and before the READ must make decode's output differ
        from a recompute (else 'matches recompute' would prove nothing)."""
        _model, prefill, decode, _log = pair
        session = Session(seed=24)
        params = _prefill(prefill, session.prompt)
        dense = 1  # gemma3: group 0 sliding window, group 1 full attention
        victim = [b for b in params["remote_block_ids"][dense] if b][:2]
        assert victim, params
        written = prefill.collective_rpc(_corrupt_blocks, args=(dense, victim, 7))[0]
        before = _external_hits(decode)
        got = _decode(decode, session.prompt, params)
        pulled = _external_hits(decode) - before
        ref = generate(decode, session.prompt, cache_salt="pd-planted-recompute")
        print(
            f"\nP/D planted fault: {written} bytes of blocks {victim} overwritten, pulled {pulled:.0f}, "
            f"matches recompute: {matches(got, ref)}"
        )
        assert pulled > 0, "the corrupted blocks must actually have been read"
        assert not matches(got, ref), (
            "a corrupted block read over NIXL went unnoticed by the comparison"
        )

    def test_layout_mismatch_is_refused_and_decode_recomputes(self, pair, capfd):  # noqa: ANN001
        """Prefill at --block-size 128, decode at 256: refused, naming the field; no wrong KV is read.
        (Decode's parameter check sees twice the blocks a 256-token layout can have and refuses
        before any connection; the handshake's own check is unit-tested in test_pd_transport.)"""
        model, prefill, _decode_128, _log = pair
        decode = make_llm(
            model, pd_config("kv_consumer"), block_size=256
        )  # started here: capfd sees it
        session = Session(seed=22)
        params = _prefill(prefill, session.prompt)
        got = _decode(decode, session.prompt, params)
        ref = generate(decode, session.prompt, cache_salt="pd-mismatch-recompute")
        out, err = capfd.readouterr()
        assert matches(got, ref)
        assert "block_size=256" in out + err and "--block-size" in out + err, (
            "the refusal must name the field and fix"
        )
        shutdown(decode)

    def test_expired_lease_is_not_read_and_decode_recomputes(self, pair, spare_prefill):  # noqa: ANN001
        """Prefill keeps a finished request's blocks for lease_s only; afterwards it may hand
        them to other requests. A decode request arriving later must not READ them (it would
        copy whatever KV lives there now): it recomputes, and says why."""
        import time

        _model, _prefill_shared, decode, log = pair
        prefill, _pids = spare_prefill  # lease_s=2
        session = Session(seed=27)
        params = _prefill(prefill, session.prompt)
        assert (
            len(params["remote_lease_id"]) == 32 and "remote_lease_expires_at" not in params
        )  # no wall clock
        time.sleep(2.5)
        log.new(0)
        got = _decode(decode, session.prompt, params)
        said = log.new()
        ref = generate(decode, session.prompt, cache_salt="pd-expired-recompute")
        print(f"\nexpired lease: cached {got.num_cached_tokens}")
        # (vLLM counts the offered tokens as external hits at scheduling, read or not: the
        # refusal is visible in the worker's log, and the output must equal a recompute.)
        assert "lease on its blocks has expired" in said, (
            "blocks were read after the prefill side's lease expired"
        )
        assert matches(got, ref)
        # Control for the provenance check of the turn test: this READ was refused (the lease
        # ended before decode's claim), so the check must fail here, though the output matches.
        with pytest.raises(AssertionError, match="a READ failed or was refused"):
            _assert_provenance(said, [0, 0], [0, 0])
        assert not _READ_LINE.search(said), "a refused READ printed the provenance line"

    def test_prefill_instance_killed_before_the_read_decode_recomputes(self, pair, spare_prefill):  # noqa: ANN001
        import signal as _signal
        import time

        _model, _prefill_shared, decode, _log = pair
        prefill, prefill_pids = (
            spare_prefill  # killed here: this test runs after the expired-lease one
        )
        session = Session(seed=23)
        params = _prefill(prefill, session.prompt)
        _signal_all(prefill_pids, _signal.SIGKILL)
        t0 = time.monotonic()
        got = _decode(decode, session.prompt, params)
        elapsed = time.monotonic() - t0
        ref = generate(decode, session.prompt, cache_salt="pd-killed-recompute")
        print(
            f"\nprefill killed: decode finished in {elapsed:.1f}s, cached {got.num_cached_tokens}"
        )
        assert matches(got, ref)
        assert elapsed < 30
