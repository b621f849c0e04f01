"""P/D + offload in ONE MultiConnector config: two real vLLM CPU engines, one real mooncake_master.

Prefill engine: MultiConnector [HybridPDConnector, HybridStoreConnector] (order does not
matter there: prefill requests carry ``do_remote_decode``, so the P/D child never loads;
the store child loads a prefix the store holds and saves what prefill computes).
Decode engine: MultiConnector [HybridStoreConnector, HybridPDConnector]. MultiConnector
queries every child and loads from the FIRST one offering tokens (vLLM 0.32
``get_num_new_matched_tokens``), so the store serves the prefix whenever it holds one and
the prefill peer is the fallback. The child not chosen gets
``update_state_after_alloc(request, blocks, 0)``; for the P/D child that sends prefill a
"not reading, release" notification (no read), so prefill frees the request's blocks at
once instead of holding them (and stepping) for ``lease_s``.

3 turns, each prompt = previous prompt + answer + 500 new tokens; the decode engine's
local prefix cache is reset before each turn, so every hit comes from the store or the
peer. Each turn must equal a recompute on the decode engine under a fresh ``cache_salt``.
Before each decode leg the test waits until the prefill's store saves of that prompt have
landed (its key log stops growing; checked afterwards: no object was logged between the
decode leg and the prefill's release), so the store holds the whole hand-over and must
supply exactly it, the peer nothing (the P/D child's release notification path). Without
that wait the split depended on a race (in one run the store won all three turns).
A 4th request is the store-miss fallback: a fresh prompt whose objects (saved by the
prefill's store child, listed in its key log) are removed from the master before the decode
leg, so the decode's store lookup finds nothing and the KV must come from the peer. (Not by
salting the decode leg alone: prefill's MAC covers the prompt's block hashes, cache_salt
included, so decode rightly refuses params issued for an unsalted prompt.)

After each decode the prefill engine's prefix cache is reset: vLLM refuses while any block
is held, so success within seconds shows the P/D lease was released (by the read's
notification, or the release notification when the store was chosen; with the release
disabled this reset timed out) and the prefill's store saves landed. It also makes the
prefill engine load its next prompt's prefix from the store (its P/D child then is the one
queried and not chosen). The "cached" column is the decode engine's own hit from
``vllm:prompt_tokens_cached_by_source`` (host = store, p2p = peer): a decode request's
``num_cached_tokens`` is the prefill side's hit (vLLM copies ``remote_prefill_cached_tokens``).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from hybridkv.cli.harness.llm_engine import (
    Completion,
    Session,
    compare,
    completion_from,
    generate,
    greedy_params,
    make_llm,
    metric,
    reset_local_cache,
    tiny_model,
)
from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.store.embedded_master import EmbeddedMaster

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")  # see pd_worker: IB module crashes CPU hosts at exit

ALIGN = 128  # gemma3 tiny model: scheduler block (SW 128 + FA 128)
NAMESPACE = "pd-store-multi"
LEASE_S = 60.0  # prefill's P/D lease; a release must come long before it
# The store children's call bound, above the 5 s default: at TP2 on 2 shared cores (4
# workers, 2 engine cores) the prefill's first puts can take over 5 s with both engines idle,
# and then nothing is saved and the test's wait for the saves fails ("prefill logged 0
# objects", put_from_parts timeouts in the prefill workers' log). What this test checks is
# which child serves and that the output is right; a put's latency is the soak's and bench's
# business.
STORE_TIMEOUT_S = 15.0
SAVES_WAIT_S = 2 * STORE_TIMEOUT_S  # < LEASE_S: the decode leg still finds the lease
# vLLM's scheduler adds remote_prefill_cached_tokens to any do_remote_prefill answer.
PD_PARAM_KEYS = {
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
    "remote_prefill_cached_tokens",
    "remote_ports",
    "remote_block_sizes",
}
# The pair's deployment secret (signs kv_transfer_params and the side channel), fresh per run.
SECRET_FILE = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-multi-e2e-")) / "secret"))


def _store_child(master_address: str, key_log: str = "") -> dict:
    # The policy is repeated on the child: MultiConnector's scheduler uses the parent's, but
    # each child gets its own KVTransferConfig (default "fail") and the store child warns on it.
    extra = {
        "master_address": master_address,
        "namespace": NAMESPACE,
        "global_segment_size": "256MiB",
        "timeout_s": STORE_TIMEOUT_S,
    }
    if key_log:
        extra["key_log_path"] = key_log  # every object it saved, once the save succeeded
    return {
        "kv_connector": "HybridStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def prefill_config(master_address: str, key_log: str = "") -> dict:
    """Prefill instance (children with module paths: both resolution routes get covered)."""
    pd = {
        "kv_connector": "HybridPDConnector",
        "kv_role": "kv_producer",
        "kv_connector_module_path": "hybridkv.connector",
        "kv_connector_extra_config": {"lease_s": LEASE_S, "auth_secret_file": SECRET_FILE},
    }
    store = {
        **_store_child(master_address, key_log),
        "kv_connector_module_path": "hybridkv.connector",
    }
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [pd, store]},
    }


def decode_config(master_address: str) -> dict:
    """Decode instance: store first (its hit wins), peer second (children by registered name)."""
    # The child's own policy too (its KVTransferConfig defaults to "fail"): a refused set
    # then offers nothing (recompute) instead of an offer that fails as a load.
    pd = {
        "kv_connector": "HybridPDConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"auth_secret_file": SECRET_FILE},
    }
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [_store_child(master_address), pd]},
    }


def _prefill(llm, prompt: list[int]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        detokenize=False,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}},
    )
    return llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[
        0
    ].kv_transfer_params


def _decode(
    llm, prompt: list[int], params: dict, max_tokens: int = 8, cache_salt: str | None = None
) -> tuple[Completion, dict | None]:
    from vllm.inputs import TokensPrompt

    p = TokensPrompt(prompt_token_ids=prompt)
    if cache_salt is not None:
        p["cache_salt"] = cache_salt
    sp = greedy_params(max_tokens)
    sp.extra_args = {"kv_transfer_params": dict(params)}
    out = llm.generate([p], sp, use_tqdm=False)[0]
    return completion_from(out), out.kv_transfer_params


def _snapshot(llm) -> dict[str, float]:
    return {
        "device": metric(llm, "vllm:prompt_tokens_cached_by_source", source="device"),
        "host": metric(llm, "vllm:prompt_tokens_cached_by_source", source="host"),
        "p2p": metric(llm, "vllm:prompt_tokens_cached_by_source", source="p2p"),
        "store_bytes": metric(llm, "vllm:hybridkv_store_loaded_bytes"),
        "store_lookups": metric(llm, "vllm:hybridkv_store_lookups"),
    }


def _source(delta: dict[str, float]) -> str:
    names = [
        s for s, k in (("store", "host"), ("peer", "p2p"), ("local", "device")) if delta[k] > 0
    ]
    return "+".join(names) or "none"


def _shutdown(*llms) -> None:
    """Stop the engines (in parallel) while the master still runs: their store clients talk to it at exit."""
    import threading

    def stop(llm) -> None:  # noqa: ANN001
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the engine may already be gone
            pass

    threads = [threading.Thread(target=stop, args=(llm,)) for llm in llms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _release_seconds(prefill) -> float:
    """Time until prefill's blocks are all free: its request's P/D lease released and its
    store saves acknowledged (vLLM refuses a prefix-cache reset while any block is held).

    An idle prefill does not step (the connector holds a lease's blocks itself, so vLLM has
    nothing to run): it learns that decode released the lease at its next step. A one-token
    request of another prompt is that step, as the next user request would be."""
    t0 = time.monotonic()
    deadline = t0 + LEASE_S / 2
    while not prefill.reset_prefix_cache():
        assert time.monotonic() < deadline, (
            "prefill's blocks still held at half the lease: release lost?"
        )
        generate(prefill, [7, 8, 9], max_tokens=1, cache_salt=f"step-{uuid.uuid4()}")
        time.sleep(0.05)
    return time.monotonic() - t0


def _key_lines(key_log: Path) -> list[str]:
    return key_log.read_text().splitlines() if key_log.exists() else []


def _drop_saved_objects(master_address: str, key_log: Path, seen: int, expect: int) -> int:
    """Remove from the master every object the prefill saved after key-log line ``seen``,
    once ``expect`` of them have landed (a later save would make the decode's lookup hit,
    which the exact store/peer split then fails). Returns how many were removed."""
    from hybridkv.store.mooncake_backend import MooncakeBackend

    deadline = time.monotonic() + SAVES_WAIT_S
    while len(_key_lines(key_log)) - seen < expect:
        assert time.monotonic() < deadline, (
            f"prefill saved {len(_key_lines(key_log)) - seen} of {expect} objects"
        )
        time.sleep(0.1)
    keys = [line.split()[0] for line in _key_lines(key_log)[seen:]]
    with MooncakeBackend(master_address, global_segment_size=0) as client:
        assert [client.remove(k, force=True) for k in keys] == [0] * len(keys), "remove refused"
        assert client.exists(keys) == [False] * len(keys), (
            "objects still listed after their removal"
        )
    return len(keys)


def _wait_saves_settled(key_log: Path, seen: int, quiet_s: float = 1.0) -> int:
    """Lines the key log holds once at least one new object is logged after line ``seen`` and
    none for ``quiet_s`` (the prefill request has finished: its save jobs are all submitted)."""
    deadline = time.monotonic() + SAVES_WAIT_S
    n, since = len(_key_lines(key_log)), time.monotonic()
    while n <= seen or time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"prefill logged {n - seen} objects and kept on saving"
        time.sleep(0.1)
        if (m := len(_key_lines(key_log))) != n:
            n, since = m, time.monotonic()
    return n


def _turn(
    prefill, decode, label, prompt: list[int], expected: int, key_log: Path, before_decode=None
) -> dict:  # noqa: ANN001
    seen = len(_key_lines(key_log))
    params = _prefill(prefill, prompt)
    # The children's kv_transfer_params merged without a clash (MultiConnector raises on one):
    # the store child adds nothing, the P/D child its hand-over.
    assert params and set(params) == PD_PARAM_KEYS, params
    assert len(params["remote_block_ids"]) == 2, (
        "two KV cache groups (SW + FA): the hybrid allocator is on"
    )
    if before_decode is not None:
        dropped, logged_at_decode = before_decode(seen), None
    else:
        dropped, logged_at_decode = 0, _wait_saves_settled(key_log, seen)
    reset_local_cache(decode)
    before = _snapshot(decode)
    got, out_params = _decode(decode, prompt, params)
    delta = {k: v - before[k] for k, v in _snapshot(decode).items()}
    ref = generate(decode, prompt, cache_salt=f"multi-recompute-{uuid.uuid4()}")
    verdict = compare(got, ref)
    return dict(
        turn=label,
        prompt=len(prompt),
        expected=expected,
        answer=got.token_ids,
        handover=int(params["remote_num_tokens"]),
        # The decode engine's own hit, by tier. (RequestOutput.num_cached_tokens on a
        # decode request is the PREFILL side's hit: vLLM copies remote_prefill_cached_tokens.)
        cached=int(delta["host"] + delta["p2p"] + delta["device"]),
        source=_source(delta),
        store_tokens=int(delta["host"]),
        peer_tokens=int(delta["p2p"]),
        store_bytes=int(delta["store_bytes"]),
        store_lookups=int(delta["store_lookups"]),
        prefill_cached=got.num_cached_tokens,
        matches=verdict.matches,
        why=verdict.why,
        ref_cached=ref.num_cached_tokens,
        out_params=out_params,
        dropped=dropped,
        release_s=_release_seconds(prefill),
        logged_at_decode=logged_at_decode,
        logged_at_release=len(_key_lines(key_log)),
    )


def _engine(model: str, cfg: dict, tp: int, **kw):  # noqa: ANN202
    """One engine; at TP2 each rank on its own core (as tests/e2e/test_store_tp.py)."""
    from hybridkv.store.cpu_affinity import usable_cpus

    mp = pytest.MonkeyPatch()
    if tp > 1:
        cpus = sorted(usable_cpus())
        if len(cpus) < 2:
            pytest.fail(f"TP2 needs two usable CPUs (one per rank), this runner has {cpus}")
        # Not one core per rank here (as test_store_tp does): with both instances' ranks pinned,
        # the prefill's Mooncake puts took 13 s (timed out at 5 s: nothing saved, 2 runs of 2);
        # unpinned, every save landed.
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        return make_llm(model, cfg, tensor_parallel_size=tp, **kw)
    finally:
        mp.undo()  # the engine's processes have their environment already


@pytest.mark.parametrize("tp", [1, 2])
def test_pd_and_store_in_one_multiconnector_three_turns(tp):
    t_start = time.monotonic()
    model = tiny_model("gemma3")
    with EmbeddedMaster(default_kv_lease_ttl_ms=2_000) as master:
        key_log = Path(tempfile.mkdtemp(prefix="hkv-multi-keys-")) / "prefill_keys.log"
        prefill = _engine(model, prefill_config(master.address, str(key_log)), tp)
        decode = _engine(model, decode_config(master.address), tp, disable_log_stats=False)
        try:
            booted = (
                time.monotonic() - t_start
            )  # engine boots dominate the runtime (20-70 s each here)
            # The hybrid allocator stays on: MultiConnector keeps it on only if every child
            # subclasses SupportsHMA, and both hybridkv connectors do.
            for llm in (prefill, decode):
                assert (
                    llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
                    is False
                )

            session = Session(seed=31)
            rows = []
            turn1_objects = 0
            for turn in range(1, 4):
                # The hand-over, from first principles: the last block boundary before the final token.
                expected = (len(session.prompt) - 1) // ALIGN * ALIGN
                rows.append(_turn(prefill, decode, turn, session.prompt, expected, key_log))
                if turn == 1:  # the release above waited for prefill's saves: all are logged
                    turn1_objects = len(_key_lines(key_log))
                session.extend(rows[-1]["answer"])
            # Store-miss fallback: a fresh prompt of turn 1's length (so as many objects as
            # turn 1 saved), its objects removed from the master before the decode leg.
            miss = Session(seed=32).prompt
            assert len(miss) == rows[0]["prompt"] and turn1_objects > 0, (len(miss), turn1_objects)
            rows.append(
                _turn(
                    prefill,
                    decode,
                    "miss",
                    miss,
                    (len(miss) - 1) // ALIGN * ALIGN,
                    key_log,
                    before_decode=lambda seen: _drop_saved_objects(
                        master.address, key_log, seen, turn1_objects
                    ),
                )
            )
        finally:
            _shutdown(prefill, decode)
            del prefill, decode
    elapsed = time.monotonic() - t_start

    print(
        f"\nP/D + store in one MultiConnector (gemma3, TP{tp} -> TP{tp}; decode cache reset before each turn; "
        f"boot {booted:.0f}s, total {elapsed:.0f}s)"
    )
    print(
        "  turn  prompt  decode_cached  expected  source  store_tok  peer_tok  store_bytes  prefill_cached  "
        "matches  prefill_free_s"
    )
    for r in rows:
        print(
            f"  {r['turn']!s:<5} {r['prompt']:<7} {r['cached']:<14} {r['expected']:<9} {r['source']:<7} "
            f"{r['store_tokens']:<10} {r['peer_tokens']:<9} {r['store_bytes']:<12} {r['prefill_cached']:<15} "
            f"{r['matches']!s:<8} {r['release_s']:.2f}"
        )

    for r in rows:
        # The row itself in the message: CI prints only the tail of a failure.
        assert r["matches"], (
            f"turn {r['turn']} differs from recompute ({r['why']}); source {r['source']}, "
            f"store/peer tokens {r['store_tokens']}/{r['peer_tokens']} of {r['expected']}"
        )
        assert r["ref_cached"] == 0, "the recompute under a fresh cache_salt must not hit"
        assert r["out_params"] is None, "a decode request hands nothing on"
        assert 0 < r["cached"] <= r["prompt"] - 1
        assert r["source"] in ("store", "peer"), (
            r
        )  # exactly one child loaded; nothing local (reset)
        assert r["store_lookups"] >= 1, "the store child is always queried"
        # Prefill's blocks freed by the P/D child's read notification or, when the store was
        # chosen, its release notification: never by lease expiry.
        assert r["release_s"] < LEASE_S / 4, (
            f"turn {r['turn']}: prefill held its blocks {r['release_s']:.1f}s"
        )
        assert r["handover"] == r["expected"], r
    for r in rows[0:3]:
        # Exactly the hand-over, from one child.
        assert r["store_tokens"] + r["peer_tokens"] == r["expected"], r
        if tp == 1:
            # The decode leg's lookup ran after every save of this prompt (none logged after
            # it), so the store holds the whole hand-over. (At TP2 a put can take seconds on 2
            # shared cores and land after the 1 s quiet window -- 31 of 36 objects logged at the
            # decode leg, once -- and which child serves is not asserted there.)
            assert r["logged_at_decode"] == r["logged_at_release"], r
            assert r["source"] == "store", (
                f"turn {r['turn']}: the store holds the whole hand-over, it must win"
            )
            assert (r["store_tokens"], r["peer_tokens"]) == (r["expected"], 0), r
            assert r["store_bytes"] > 0
    # (At TP2 on a 2-core runner -- 4 workers, 2 engine cores, NIXL + Mooncake threads -- the
    # store child's loads can miss their object lease (LEASE_EXPIRED) and the peer serves the
    # turn instead: measured store 1 of 3 turns. Which child wins is then timing; the output,
    # the exact hand-over and the single source are not, and are asserted above.)
    miss = rows[3]
    assert miss["dropped"] == turn1_objects, miss
    # The miss (its objects removed): all of it from the peer's hand-over.
    assert miss["source"] == "peer" and miss["store_bytes"] == 0, miss
    assert (miss["store_tokens"], miss["peer_tokens"]) == (0, miss["handover"]), miss
