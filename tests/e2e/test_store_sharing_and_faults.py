"""Cross-instance reuse, the registered connector name, metrics, and store faults.

Faults are real: a SIGKILLed ``mooncake_master``, and a store node (the process
holding the segment the objects live in) SIGKILLed between a lookup and the
load, so the master still answers "present" while the bytes are gone. In every
case the request must complete with output equal to a recompute, in bounded time.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from hybridkv.cli.harness.llm_engine import (
    Completion,
    Session,
    completion_from,
    failure_causes,
    generate,
    greedy_params,
    make_llm,
    matches,
    metric,
    reset_local_cache,
    store_transfer_config,
    timed_generate,
    tiny_model,
)
from hybridkv.store.embedded_master import EmbeddedMaster
from tests.freeze import freeze

ALIGN = 128  # gemma3 tiny model: scheduler block
TIMEOUT_S = 2.0  # timeout_s of the fault tests' stores
LOOKUP_TIMEOUT_S = 1.0  # lookup_timeout_s (the existence query)
# A faulted request may pay one lookup and one load/save timeout; 2 x timeout_s bounds
# both (lookup_timeout_s < timeout_s), plus a small constant for bf16 CPU jitter.
SLACK_S = 1.5


def fault_bound(base_s: float) -> float:
    """Longest a faulted turn may take: the same turn with a healthy store + 2 timeouts."""
    return base_s + 2 * TIMEOUT_S + SLACK_S


def test_second_instance_hits_what_the_first_saved_and_name_resolves_without_module_path():
    """A saves zero-copy; B (registered name, staged data path) loads A's objects, saves the
    next turn through its staging buffers, and A loads those: the two paths' objects are
    interchangeable byte for byte."""
    with EmbeddedMaster(default_kv_lease_ttl_ms=2_000) as master:
        model = tiny_model("gemma3")
        extra = {"master_address": master.address, "namespace": "sharing"}
        a = make_llm(model, store_transfer_config(extra))
        # B uses the name registered by hybridkv's vLLM plugin entry point, no module path.
        b = make_llm(
            model,
            store_transfer_config({**extra, "staging": "always"}, module_path=False),
            disable_log_stats=False,
        )
        session = Session(seed=11)
        first = generate(a, session.prompt)
        prev_len = len(session.prompt)
        session.extend(first.token_ids)
        reset_local_cache(a)  # waits until A's saves are acknowledged
        got = generate(b, session.prompt)
        ref = generate(b, session.prompt, cache_salt="sharing-recompute")
        expected = get_mamba_prefill_checkpoint_position(prev_len, ALIGN, False)
        print(
            f"\ninstance B: prompt {len(session.prompt)} cached {got.num_cached_tokens} expected {expected}"
        )
        assert first.num_cached_tokens == 0
        assert got.num_cached_tokens == expected
        assert matches(got, ref)
        assert ref.num_cached_tokens == 0
        assert metric(b, "vllm:hybridkv_store_loaded_bytes") > 0
        assert (
            metric(b, "vllm:hybridkv_store_hit_tokens") == expected
        )  # all from the store, none local
        for kind in ("lookup", "load"):
            hist = [
                m
                for m in b.get_metrics()
                if m.name == f"vllm:hybridkv_store_{kind}_latency_seconds"
            ]
            assert hist and sum(m.count for m in hist) >= 1, f"no {kind} latency histogram"

        prev_len = len(session.prompt)
        session.extend(got.token_ids)
        reset_local_cache(b)  # B's staged saves acknowledged
        back = generate(a, session.prompt)
        back_ref = generate(a, session.prompt, cache_salt="sharing-recompute-a")
        expected = get_mamba_prefill_checkpoint_position(prev_len, ALIGN, False)
        print(
            f"instance A: prompt {len(session.prompt)} cached {back.num_cached_tokens} expected {expected}"
        )
        assert back.num_cached_tokens == expected
        assert matches(back, back_ref)
        del a, b


def test_master_killed_mid_session_degrades_to_recompute_without_hanging():
    """Each turn after the kill costs at most the same turn with a healthy store plus
    2 x timeout_s (+ a small constant), and the lookup-error counter shows the lookup
    failed and was treated as a miss (not, say, a load that happened to time out)."""
    master = EmbeddedMaster(default_kv_lease_ttl_ms=2_000)
    llm = make_llm(
        tiny_model("gemma3"),
        store_transfer_config(
            {
                "master_address": master.address,
                "namespace": "killed-master",
                "timeout_s": TIMEOUT_S,
                "lookup_timeout_s": LOOKUP_TIMEOUT_S,
            }
        ),
        disable_log_stats=False,
    )
    session = Session(seed=12)
    first = generate(llm, session.prompt)
    assert first.num_cached_tokens == 0
    session.extend(first.token_ids)
    # Baseline: this prompt with a healthy store and nothing to hit (a fresh salt).
    _, base_s = timed_generate(llm, session.prompt, cache_salt="killed-master-baseline")
    reset_local_cache(llm)
    master.kill()
    for turn in range(2):
        errors_before = metric(llm, "vllm:hybridkv_store_lookup_errors")
        got, elapsed = timed_generate(llm, session.prompt)
        errors = metric(llm, "vllm:hybridkv_store_lookup_errors") - errors_before
        ref = generate(llm, session.prompt, cache_salt=f"killed-master-{turn}")
        print(
            f"\nmaster dead, turn {turn + 2}: cached {got.num_cached_tokens}, {elapsed:.1f}s "
            f"(healthy {base_s:.1f}s, bound {fault_bound(base_s):.1f}s), lookup errors +{errors:g}, "
            f"causes {failure_causes(llm)}"
        )
        assert matches(got, ref)
        assert got.num_cached_tokens == 0
        assert errors >= 1, "the lookup did not fail: this turn did not take the dead-store path"
        assert elapsed <= fault_bound(base_s), (
            "a dead store must cost at most the configured timeouts"
        )
        session.extend(got.token_ids)
        reset_local_cache(llm)
    del llm


_HOLDER = """
import sys, time
from hybridkv.store.mooncake_backend import MooncakeBackend
b = MooncakeBackend(sys.argv[1], global_segment_size=512 << 20)
print("ready", flush=True)
time.sleep(3600)
"""


def test_bad_config_fails_at_startup_naming_the_key(capfd):
    """A typo in the config line stops the engine at startup (unit tests cover every key)."""
    with pytest.raises(Exception):  # noqa: B017 - vLLM wraps the engine core's startup error
        make_llm(tiny_model("gemma3"), store_transfer_config({"master_adress": "127.0.0.1:1"}))
    out, err = capfd.readouterr()
    assert "unknown key(s) ['master_adress']" in out + err


def _generate_many(
    llm, prompts: list[list[int]], max_tokens: int = 8, top_k: bool = True
) -> list[Completion]:
    """All prompts in one batch (they are scheduled together, chunked and maybe preempted).

    ``top_k=False``: no top-5 logprobs (the long first turn, never compared: with top-5 on
    its 300-token answers the store's saves timed out and turn 2 hit 0 in 2 of 2 runs here,
    1024 each without; left to the lead)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = (
        greedy_params(max_tokens)
        if top_k
        else SamplingParams(
            temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True
        )
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [completion_from(o) for o in outs]


def test_chunked_prefill_and_preemption_under_a_small_cache():
    """Several long requests at once in a KV cache too small for them: vLLM chunks their
    prefills and preempts some (their blocks are freed while saves are in flight, which
    the connector's pins must survive). The next turn must still hit the store and match."""
    llm = make_llm(
        tiny_model("gemma3"),
        store_transfer_config({"namespace": "preempt"}),
        max_num_batched_tokens=256,
        num_gpu_blocks_override=36,
        max_num_seqs=4,
        max_model_len=2048,
        disable_log_stats=False,
    )
    sessions = [Session(seed=100 + i, first_tokens=1100, growth_tokens=300) for i in range(4)]
    # Answers of 150 tokens: each running request grows from 9 to 10 blocks (1100 -> 1250
    # tokens) and the pool runs out.
    first = _generate_many(llm, [s.prompt for s in sessions], max_tokens=150, top_k=False)
    preemptions = metric(llm, "vllm:num_preemptions")
    for s, c in zip(sessions, first):
        s.extend(c.token_ids)
    reset_local_cache(llm)
    second = _generate_many(llm, [s.prompt for s in sessions])
    print(f"\npreemptions {preemptions}, cached on turn 2: {[c.num_cached_tokens for c in second]}")
    assert preemptions >= 1, "the cache was meant to be too small for all requests at once"
    assert all(c.num_cached_tokens >= 1024 for c in second)
    for i, (s, got) in enumerate(zip(sessions, second)):
        ref = generate(llm, s.prompt, cache_salt=f"preempt-{i}")
        assert matches(got, ref), (
            f"request {i} (cached {got.num_cached_tokens}) differs from recompute"
        )
    del llm


def _stuck_calls(worker) -> int:  # noqa: ANN001 - runs in the engine's worker
    """Store calls the worker's backend abandoned after their timeout that have not returned."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker._client.stuck_calls


@pytest.fixture(scope="module")
def holder_store():  # noqa: ANN201
    """A master, a store node (``_HOLDER``: every object lands in its segment) and a gemma3
    engine that stores nothing itself, with the fault tests' timeouts: one engine boot for the
    hung-node test and then the lost-objects test (last: it kills the node). Each uses its
    own session seed, so neither hits the other's objects."""
    with (
        pytest.MonkeyPatch.context() as mp,
        EmbeddedMaster(default_kv_lease_ttl_ms=2_000) as master,
    ):
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(_stuck_calls)
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, master.address], stdout=subprocess.PIPE
        )
        try:
            assert holder.stdout.readline().strip() == b"ready"
            # global_segment_size 0: this engine stores nothing itself, every object lands in
            # the holder.
            llm = make_llm(
                tiny_model("gemma3"),
                store_transfer_config(
                    {
                        "master_address": master.address,
                        "namespace": "holder",
                        "global_segment_size": 0,
                        "timeout_s": TIMEOUT_S,
                        "lookup_timeout_s": LOOKUP_TIMEOUT_S,
                    }
                ),
                disable_log_stats=False,
            )
            yield master, holder, llm
            del llm
        finally:
            if holder.poll() is None:
                holder.kill()


def test_store_node_hung_during_a_load_recomputes_and_never_writes_into_reused_blocks(
    holder_store,
):  # noqa: ANN001
    """The node holding the objects stops answering (SIGSTOP) while a load reads from it.

    The read times out and the request recomputes at once; the abandoned read is
    still pending inside Mooncake and completes when the node resumes. Its target
    blocks must stay pinned until then: before that fix, a late read landed in
    blocks the recompute had been given and the output differed from recompute.

    So after the node resumes and the late read has landed, the SAME prompt is sent
    again without a salt and without emptying the local cache: it must reuse the
    recompute's blocks from the local prefix cache (exact hit) and still equal the
    recompute; a different prompt (given whatever blocks are free) must match too.
    """
    _master, holder, llm = holder_store
    session = Session(seed=14)
    session.extend(generate(llm, session.prompt).token_ids)
    _, base_s = timed_generate(llm, session.prompt, cache_salt="hung-baseline")
    reset_local_cache(llm)
    freeze(holder.pid)
    try:
        failed_before = metric(llm, "vllm:hybridkv_store_failed_loads")
        got, elapsed = timed_generate(llm, session.prompt)
        failed = metric(llm, "vllm:hybridkv_store_failed_loads") - failed_before
        causes = failure_causes(llm)
        ref = generate(llm, session.prompt, cache_salt="hung-recompute")
        stuck = sum(llm.collective_rpc(_stuck_calls))  # the abandoned read, still pending
    finally:
        holder.send_signal(signal.SIGCONT)
    # Let the abandoned read finish into its pinned blocks: its store call has returned when
    # the worker's backend counts no stuck call (bounded as before, 2 x timeout_s).
    resumed = time.monotonic()
    while any(llm.collective_rpc(_stuck_calls)) and time.monotonic() < resumed + 2 * TIMEOUT_S:
        time.sleep(0.1)
    landed_s = time.monotonic() - resumed
    again = generate(llm, session.prompt)  # same prompt, no salt: the local prefix cache
    other_prompt = Session(seed=15).prompt
    other = generate(llm, other_prompt, cache_salt="hung-other")
    other_ref = generate(llm, other_prompt, cache_salt="hung-other-2")
    local_hit = (len(session.prompt) - 1) // ALIGN * ALIGN
    print(
        f"\nnode hung: cached {got.num_cached_tokens}, {elapsed:.1f}s (healthy {base_s:.1f}s, "
        f"bound {fault_bound(base_s):.1f}s), failed loads +{failed:g}, causes {causes}; "
        f"{stuck} pending read(s) landed {landed_s:.1f}s after resume; resend after resume: cached "
        f"{again.num_cached_tokens} (local hit {local_hit})"
    )
    assert matches(got, ref)
    assert failed == 1, "the load did not fail: this turn did not take the hung-node path"
    assert causes.get("load_hkv_call_timeout", 0) >= 1, causes
    assert stuck >= 1, "no abandoned read was pending when the node resumed"
    assert elapsed <= fault_bound(base_s)
    assert again.num_cached_tokens == local_hit, "the resend did not reuse the recompute's blocks"
    assert matches(again, ref), "a late read landed in blocks the local prefix cache reuses"
    assert matches(other, other_ref)


def test_objects_lost_between_lookup_and_load_recompute(holder_store):  # noqa: ANN001
    """The node holding the objects dies; the master still lists them (about 10 s).
    (Runs after the hung-node test on the same engine and node: it kills the node.)"""
    _master, holder, llm = holder_store
    session = Session(seed=13)
    session.extend(generate(llm, session.prompt).token_ids)
    _, base_s = timed_generate(llm, session.prompt, cache_salt="lost-baseline")
    reset_local_cache(llm)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    hits_before = metric(llm, "vllm:hybridkv_store_lookup_hits")
    failed_before = metric(llm, "vllm:hybridkv_store_failed_loads")
    got, elapsed = timed_generate(llm, session.prompt)
    ref = generate(llm, session.prompt, cache_salt="lost-recompute")
    failed = metric(llm, "vllm:hybridkv_store_failed_loads") - failed_before
    print(
        f"\nobjects lost: cached {got.num_cached_tokens}, {elapsed:.1f}s (healthy {base_s:.1f}s, "
        f"bound {fault_bound(base_s):.1f}s), failed loads +{failed:g}, "
        f"causes {failure_causes(llm)}"
    )
    assert matches(got, ref)
    # The lookup still found the objects (the master lists them) and a load was
    # attempted and failed: one failed load. A hit counts only when its load
    # succeeded (hits are counted once per request decision), so none.
    assert metric(llm, "vllm:hybridkv_store_lookup_hits") - hits_before == 0
    assert failed == 1
    assert elapsed <= fault_bound(base_s), "lost objects must cost at most the configured timeouts"


def _session_dense_keys(key_log, seen: int) -> list[str]:
    """Keys of the dense group (most objects) written since line ``seen`` of the key log."""
    by_group: dict[str, list[str]] = {}
    for line in key_log.read_text().splitlines()[seen:]:
        key, gid, _ = line.split()
        by_group.setdefault(gid, []).append(key)
    return max(by_group.values(), key=len)


def test_corrupt_short_and_misplaced_objects_are_detected_and_recompute(tmp_path):
    """A store that answers with the wrong bytes: every object carries a CRC trailer.

    Three faults, each on a fresh session: a payload with flipped bytes (right size,
    old trailer), a truncated object, and another block's valid object stored under
    this key. Each must be refused (failure counted by cause) and the turn must
    equal a recompute; without the trailer the first and third load silently.
    """
    from hybridkv.store.mooncake_backend import MooncakeBackend

    key_log = tmp_path / "keys.log"
    with EmbeddedMaster(default_kv_lease_ttl_ms=2_000) as master:
        llm = make_llm(
            tiny_model("gemma3"),
            store_transfer_config(
                {
                    "master_address": master.address,
                    "namespace": "corrupt",
                    "key_log_path": str(key_log),
                }
            ),
            disable_log_stats=False,
        )

        def flip(data: bytes, other: bytes) -> bytes:
            mid = len(data) // 2
            return data[:mid] + bytes(b ^ 0x5A for b in data[mid : mid + 64]) + data[mid + 64 :]

        # fault -> the failure cause it must be counted under (Mooncake itself refuses a
        # read whose buffers do not match the object's size: TRANSFER_FAIL).
        faults = {
            "flipped payload": (flip, "load_corrupt_object"),
            "truncated": (lambda data, other: data[: len(data) // 2], "load_transfer_fail"),
            "another key's object": (lambda data, other: other, "load_corrupt_object"),
        }
        with MooncakeBackend(master.address, global_segment_size=0) as client:
            for i, (name, (fault, cause)) in enumerate(faults.items()):
                reset_local_cache(llm)  # waits until earlier saves are acknowledged
                seen = len(key_log.read_text().splitlines()) if key_log.exists() else 0
                session = Session(seed=40 + i)
                session.extend(generate(llm, session.prompt).token_ids)
                reset_local_cache(llm)
                keys = _session_dense_keys(key_log, seen)
                victim, other = keys[1], keys[2]
                assert (
                    client.replace_bytes(
                        victim, fault(client.get_bytes(victim), client.get_bytes(other))
                    )
                    == 0
                )
                failed_before = metric(llm, "vllm:hybridkv_store_failed_loads")
                cause_before = metric(llm, "vllm:hybridkv_store_failures", cause=cause)
                got = generate(llm, session.prompt)
                ref = generate(llm, session.prompt, cache_salt=f"corrupt-recompute-{i}")
                failed = metric(llm, "vllm:hybridkv_store_failed_loads") - failed_before
                counted = metric(llm, "vllm:hybridkv_store_failures", cause=cause) - cause_before
                print(
                    f"\n{name}: cached {got.num_cached_tokens}, failed loads +{failed}, {cause} +{counted}"
                )
                assert failed == 1 and counted >= 1, f"{name}: not refused"
                assert matches(got, ref), f"{name}: output differs from recompute"
        del llm
