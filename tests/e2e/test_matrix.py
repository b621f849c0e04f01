"""The deployment matrix on the real CPU engine, with and without a speculative drafter.

Per variant, one pair of real vLLM CPU engines, each with hybridkv's P/D + store
MultiConnector (the prefill's [HybridPDConnector, HybridStoreConnector], the decode's
[HybridStoreConnector, HybridPDConnector]: tests/e2e/test_pd_store_multiconnector.py), one real
mooncake_master. Variants: gemma4 (sliding + two full-attention groups at different block
sizes) with an EAGLE head whose layer forms a third full-attention group (``eagle-gemma4``),
and gemma4 without it. Three sessions of three agentic turns run against each pair, one per
deployment:

* ``store``: requests to the decode engine alone (no hand-over); its local prefix cache is
  reset before each turn, so the hit must come back from the store.
* ``pd``: prefill leg, then the prefill's store objects of that prompt removed from the
  master, the decode's cache reset: the hand-over must come over NIXL.
* ``pd+store``: prefill leg, its saves landed, the decode's cache reset: the store child
  serves (it is queried first): without a drafter the whole hand-over, with one the EAGLE
  checkpoint a scheduler block below it.

Per turn: prompt, the decode engine's own hit by source from vLLM's
``prompt_tokens_cached_by_source`` (host = store load, p2p = NIXL READ, device = local),
the expected hit (vLLM's ``get_mamba_prefill_checkpoint_position``, with the EAGLE block drop
when the drafter is on), and greedy output equal to a recompute under a fresh ``cache_salt``.
After each P/D leg every prefill block is free again within a quarter of the lease (the lease
ended, the saves acknowledged), learned at the prefill's next step.
The mode is ``block`` / ``block + drafter``; ``partial`` is the same as ``block`` on gemma4:
vLLM 0.32 applies ``--prefix-match-unit`` to Mamba-align groups only.

The Mamba hybrid with a drafter cannot run on this engine: vLLM 0.32's align-mode pre-copy
before each step with speculative decoding (``mamba_utils.run_fused_precopy``) is a Triton
kernel, and the CPU build has no Triton. That cell is a strict xfail that boots the engine
and checks the cause; tests/unit/test_matrix_scheduler.py covers those cells with vLLM's
real scheduler on both sides.
"""

from __future__ import annotations

import math
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from hybridkv.cli.harness.llm_engine import (
    MODEL_CACHE,
    Session,
    compare,
    engine_output_to,
    generate,
    kv_cache_layout,
    make_llm,
    reset_local_cache,
    store_transfer_config,
    tiny_model,
)
from hybridkv.cli.harness.tiny_models import write_tiny_model
from hybridkv.store.embedded_master import EmbeddedMaster
from tests.docs_tables import observe
from tests.e2e.test_pd_store_multiconnector import (
    LEASE_S,
    _decode,
    _drop_saved_objects,
    _key_lines,
    _prefill,
    _shutdown,
    _snapshot,
    _source,
    _wait_saves_settled,
    decode_config,
    prefill_config,
)

NUM_SPECULATIVE_TOKENS = 2
TABLE = "matrix-e2e"
FIRST, GROWTH = 1600, 600  # the scheduler block is 512: every turn after the first hits


def _drafter(kind: str) -> dict:
    path = str(write_tiny_model(kind, MODEL_CACHE / f"{kind}-s0"))
    return {"method": "eagle", "model": path, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}


def _row(turn: int, prompt: list[int], expected: int, delta: dict, got, ref) -> dict:
    verdict = compare(got, ref)
    return dict(
        turn=turn,
        prompt=len(prompt),
        cached=int(delta["host"] + delta["p2p"] + delta["device"]),
        expected=expected,
        source=_source(delta),
        store=int(delta["host"]),
        peer=int(delta["p2p"]),
        matches_recompute=verdict.matches,
        why=verdict.why,
        ref_cached=ref.num_cached_tokens,
        answer=got.token_ids,
    )


def _print(title: str, rows: list[dict]) -> None:
    print(f"\n{title}\n  turn  prompt  cached  expected  source  store  peer  matches_recompute")
    for r in rows:
        print(
            f"  {r['turn']:<5} {r['prompt']:<7} {r['cached']:<7} {r['expected']:<9} {r['source']:<7} "
            f"{r['store']:<6} {r['peer']:<5} {r['matches_recompute']}"
        )


def _store_session(decode, align: int, drop: bool) -> list[dict]:
    """The store deployment: the decode engine alone, its cache reset before every turn. The
    hit is the previous prompt's checkpoint (one scheduler block lower with the EAGLE drop)."""
    session, rows, prev = Session(seed=43, first_tokens=FIRST, growth_tokens=GROWTH), [], 0
    for turn in range(1, 4):
        expected = get_mamba_prefill_checkpoint_position(prev, align, drop) if prev else 0
        reset_local_cache(decode)
        before = _snapshot(decode)
        got = generate(decode, session.prompt)
        delta = {k: v - before[k] for k, v in _snapshot(decode).items()}
        ref = generate(decode, session.prompt, cache_salt=f"matrix-store-{uuid.uuid4()}")
        rows.append(_row(turn, session.prompt, expected, delta, got, ref))
        print(f"  store turn {turn}: {rows[-1]}", flush=True)
        prev = len(session.prompt)
        session.extend(got.token_ids)
    return rows


def _release_seconds(prefill) -> float | None:
    """Seconds until the prefill's blocks are all free (its lease ended, its saves
    acknowledged: vLLM refuses a prefix-cache reset while any block is held); None when still
    held at a quarter of the lease.

    The connector holds a lease's blocks itself, so an idle prefill does not step and learns
    that decode ended the lease at its next step (connector/pd_lease_pins.py). A one-token
    request of another prompt is that step, as the next user request would be. Polling the
    reset alone, with nothing to run, finds the blocks held however long it polls (a lease's
    expiry, too, is learned at a step)."""
    t0 = time.monotonic()
    while not prefill.reset_prefix_cache():
        if time.monotonic() - t0 > LEASE_S / 4:
            return None
        generate(prefill, [7, 8, 9], max_tokens=1, cache_salt=f"step-{uuid.uuid4()}")
        time.sleep(0.05)
    return round(time.monotonic() - t0, 1)


def _pd_session(
    prefill, decode, key_log: Path, master_address: str, store_serves: bool, seed: int, align: int
) -> list[dict]:
    """P/D (the prefill's objects of each prompt removed before the decode leg) or
    P/D + store (its saves landed first): the decode engine's cache reset every turn."""
    session, rows = Session(seed=seed, first_tokens=FIRST, growth_tokens=GROWTH), []
    for turn in range(1, 4):
        seen = len(_key_lines(key_log))
        params = _prefill(prefill, session.prompt)
        assert params and params["do_remote_prefill"], params
        # The hand-over decode reads: the last scheduler-block boundary before the final token
        # (the prefill computes one token more with a sliding window: remote_num_tokens T + 1).
        handover = (len(session.prompt) - 1) // align * align
        assert int(params["remote_num_tokens"]) in (handover, handover + 1), params
        landed = _wait_saves_settled(key_log, seen)
        if not store_serves:
            _drop_saved_objects(master_address, key_log, seen, landed - seen)
        reset_local_cache(decode)
        before = _snapshot(decode)
        got, out_params = _decode(decode, session.prompt, params)
        assert out_params is None
        delta = {k: v - before[k] for k, v in _snapshot(decode).items()}
        ref = generate(decode, session.prompt, cache_salt=f"matrix-pd-{uuid.uuid4()}")
        rows.append(_row(turn, session.prompt, handover, delta, got, ref))
        rows[-1]["release_s"] = _release_seconds(prefill)
        print(f"  {'pd+store' if store_serves else 'pd'} turn {turn}: {rows[-1]}", flush=True)
        session.extend(got.token_ids)
    return rows


# variant -> (tiny model, drafter kind or None, extra engine args on both engines).
VARIANTS: dict[str, tuple[str, str | None, dict]] = {
    "gemma4-drafter": ("gemma4", "eagle-gemma4", {}),
    "gemma4": ("gemma4", None, {}),
}
RELEASES: dict[
    str, list
] = {}  # "variant deployment" -> seconds until the prefill's blocks were free


def _every_deployment(variant: str, monkeypatch, tmp_path: Path) -> None:  # noqa: ANN001
    """One prefill + decode pair of ``variant``, the three deployments as sessions against it."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(kv_cache_layout)
    kind, drafter, engine_args = VARIANTS[variant]
    t0 = time.monotonic()
    model = tiny_model(kind)
    spec = _drafter(drafter) if drafter else None
    with EmbeddedMaster(default_kv_lease_ttl_ms=2_000) as master:
        key_log = Path(tempfile.mkdtemp(prefix="hkv-matrix-keys-")) / "prefill_keys.log"
        with engine_output_to(tmp_path / "engines.log"):
            prefill = make_llm(
                model,
                prefill_config(master.address, str(key_log)),
                speculative_config=spec,
                **engine_args,
            )
            decode = make_llm(
                model,
                decode_config(master.address),
                speculative_config=spec,
                disable_log_stats=False,
                **engine_args,
            )
        booted = time.monotonic() - t0
        try:
            layout = decode.collective_rpc(kv_cache_layout)[0]
            groups = layout["groups"]
            print(
                f"\ngroups: {[(g['spec'], g['block_size'], g['head_size']) for g in groups]}, "
                f"scheduler block {layout['scheduler_block_size']}"
            )
            drop = layout["eagle_block_drop"]
            assert drop == bool(drafter), layout
            if drafter:
                # Sliding + two target full-attention block sizes + the drafter's own group.
                full = [g for g in groups if g["spec"] == "FullAttentionSpec"]
                assert len(full) == 3 and len({g["block_size"] for g in full}) == 3, groups
            align = layout["scheduler_block_size"]
            assert align == math.lcm(*(g["block_size"] for g in groups))
            results = {
                "store": _store_session(decode, align, drop),
                "pd+store": _pd_session(
                    prefill, decode, key_log, master.address, True, seed=41, align=align
                ),
                "pd": _pd_session(
                    prefill, decode, key_log, master.address, False, seed=42, align=align
                ),
            }
        finally:
            _shutdown(prefill, decode)
            del prefill, decode
    elapsed = time.monotonic() - t0
    RELEASES.update(
        {
            f"{variant} {d}": [r.get("release_s") for r in rows]
            for d, rows in results.items()
            if d != "store"
        }
    )
    mode = "block + drafter" if drafter else "block"
    for deployment, rows in results.items():
        _print(
            f"{variant}, {deployment}, {mode} (scheduler block {align}, boot {booted:.0f} s, "
            f"module {elapsed:.0f} s; prefill blocks free after "
            f"{RELEASES.get(f'{variant} {deployment}')} s)",
            rows,
        )
    for deployment, rows in results.items():
        for r in rows:
            assert r["matches_recompute"], (deployment, r["turn"], r["why"])
            assert r["ref_cached"] == 0, "the recompute under a fresh cache_salt must not hit"
            if deployment == "store":
                assert r["cached"] == r["expected"] and r["source"] == (
                    "store" if r["turn"] > 1 else "none"
                ), r
            elif deployment == "pd":
                assert (r["cached"], r["source"]) == (r["expected"], "peer"), r
            else:
                # MultiConnector loads from the first child that offers tokens, the store. With
                # the drafter its hit is the EAGLE checkpoint, one scheduler block below the
                # hand-over (the peer holds the whole hand-over; when that is 0 the peer
                # serves); without it the store's checkpoint is the hand-over itself.
                store_hit = r["expected"] - align if drop else r["expected"]
                assert (r["cached"], r["source"]) == (
                    (store_hit, "store") if store_hit else (r["expected"], "peer")
                ), r
        assert rows[1]["cached"] > 0 and rows[2]["cached"] > rows[1]["cached"], rows
        observe(
            TABLE,
            f"{kind}-{deployment}-block" + ("-drafter" if drafter else ""),
            {
                "turns": ", ".join(f"{r['cached']}/{r['prompt']} ({r['source']})" for r in rows),
                "result": "pass",
            },
        )


def test_gemma4_with_drafter_in_every_deployment(monkeypatch, tmp_path):  # noqa: ANN001
    _every_deployment("gemma4-drafter", monkeypatch, tmp_path)


def test_gemma4_in_every_deployment(monkeypatch, tmp_path):  # noqa: ANN001
    _every_deployment("gemma4", monkeypatch, tmp_path)


def test_every_deployments_prefill_frees_its_blocks_after_the_read():
    """Reads the release times the deployment tests above recorded."""
    assert RELEASES, "no deployment test ran"
    for deployment, secs in RELEASES.items():
        assert all(s is not None and s < LEASE_S / 4 for s in secs), (deployment, secs)


class TritonOnlyPrecopy(RuntimeError):
    """vLLM's Mamba align-mode pre-copy with speculative decoding is a Triton kernel."""


@pytest.mark.xfail(
    strict=True,
    raises=TritonOnlyPrecopy,
    reason=(
        "vLLM 0.32's CPU engine cannot run a drafter on a Mamba hybrid with prefix caching: the "
        "align-mode pre-copy before each step (mamba_utils.run_fused_precopy) is a Triton kernel "
        "(TypeError: 'function' object is not subscriptable without Triton); covered by "
        "tests/unit/test_matrix_scheduler.py with vLLM's real scheduler"
    ),
)
def test_qwen3next_with_drafter_runs_on_the_cpu_engine(tmp_path):
    model = tiny_model("qwen3next")
    log = tmp_path / "engine.log"
    with EmbeddedMaster(default_kv_lease_ttl_ms=2_000) as master:
        with engine_output_to(log):
            llm = make_llm(
                model,
                store_transfer_config(
                    {"master_address": master.address, "namespace": "matrix-qwen3next-eagle"}
                ),
                block_size=256,
                speculative_config=_drafter("eagle-qwen3next"),
            )
        try:
            generate(llm, Session(seed=44).prompt, max_tokens=4)
        except Exception as e:  # noqa: BLE001 - the cause is read from the worker's log
            text = log.read_text(errors="replace")
            if "'function' object is not subscriptable" in text and "precopy" in text:
                raise TritonOnlyPrecopy(
                    f"{type(e).__name__}: the worker's Triton-only pre-copy"
                ) from e
            raise
        finally:
            _shutdown(llm)
