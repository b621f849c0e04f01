"""The soak's CI variant: bench/soak.py's own code, few sessions, short phases, targets asserted.

Everything is real (vLLM OpenAI server on the CPU engine, HybridStoreConnector, an external
``mooncake_master`` and a second store node the soak owns); the faults are the soak's: master
SIGSTOPped, objects corrupted in place with another block's real object, the store node
SIGKILLed, master SIGKILLed and restarted on its port. What is asserted is what the issue's
targets fix exactly (no performance timing): 0 failed requests in every phase (the policy is
recompute), every sampled turn equal to a salted recompute, the misplaced objects refused by
the trailer check, store loads back within ``soak.recovery_bound_s`` of the new master and a
non-zero hit rate after that, nothing left after shutdown.

How each check was shown to fail: ``soak_problems`` over this configuration with
``SoakConfig.plant`` (bench/soak.py ``--plant``), 2026-12-01. no-restart + sealed-corruption +
policy-fail in one run: "store loads back after None s", "hit rate after recovery None"
(no-restart); "none of 8 corrupted objects was refused" and 3 of 9 sampled turns differ from
recompute in corrupt and in after-corrupt (sealed-corruption: misplaced KV re-sealed under the
victim's key loads and changes the answers); 4 + 24 failed requests in after-corrupt /
after-node-kill (policy-fail: failed loads fail the request). leak-master alone: "left after
shutdown: processes [master, its watchdog], dirs [its temp dir]", every other check met.
"""

from __future__ import annotations


import pytest

from bench.soak import SoakConfig, pd_counts_agree, run_soak

pytestmark = pytest.mark.e2e

# About 2 min on the shared 2-core machine (engine start ~30 s, 4 x 12 s + 12 s warm-up,
# SIGSTOP 6 s, kill gap 3 s, the sampled recomputes and the shutdown).
# 32 local blocks (the full run: 64 for 16 sessions), so the store, not the local cache, serves.
CI = SoakConfig(sessions=5, phase_s=12.0, stop_s=6.0, turns=4, cycle=2, num_gpu_blocks=32, samples=3)


# How the P/D checks were shown to fail (soak_problems over CI_PD with SoakConfig.plant,
# 2026-12-01): policy-fail + leak-prefill in one run -> "prefill-kill: 28 of 1032 requests
# failed" (the burst's decode legs answered 500: their READs cut by the kill fail the request),
# "1 of 3 burst turns compared with a recompute", "left after shutdown: processes [4 pids of
# the prefill]"; no-prefill-restart alone -> only "P/D READs resumed after None s of the
# restarted prefill (bound 22.9 s)"; "differ from recompute" failed without a plant until the bug below was fixed.
# The P/D + store variant (bench/soak.py --pd): prefill and decode behind the hybridkv proxy,
# each MultiConnector(HybridPDConnector + HybridStoreConnector) on one mooncake_master; one store
# fault (master SIGSTOPped 6 s) and the prefill SIGKILLed while the decode holds hand-overs it
# has not read, then restarted. 170-203 s on this box (two engine boots, the prefill's re-boot
# 62-73 s under the sessions' load, 2 x 12 s + the after-restart phase >= its bound, the
# sampled recomputes). Its "= recompute" check found a P/D bug (turns with
# disjoint top-5: a prefill's sliding-window block the decode needed was freed before the
# hand-over when N % 128 was 0 or 127; fixed in 232955c/6f84790, bench/pd_concurrent_check.py:
# 16 sessions 6 of 60 differ before, 0 of 60 after). The store fault here is the SIGSTOP.
# In CI since 2026-12-01 (it was opt-in: two failures in stop 14's clean-clone run). Robust on 2
# cores through: (1) the kill is tied to evidence, not a fixed 0.05 s: the prefill is frozen
# (SIGSTOP) the moment the burst's decode legs are posted, so no READ of it can complete, and
# SIGKILLed once decode's p2p admissions counter shows READs issued (a READ cut, in CI's
# failing run, had finished 0.9 s after posting, before the late kill); (2) the phase after
# the restart lasts at least pd_recovery_bound_s; (3) think time between a session's turns
# (2 s: agents read answers and run tools) lowers the decode-only load while the prefill is
# down; (4) the restarted prefill no longer dies of SIGILL on its first request (a store hit
# of all but the last token: its first forward ran vLLM's AMX attention before oneDNN had
# asked Linux for the AMX tile state; HybridPDConnector's workers now ask, allow_amx). Before
# (4) 2 of 2 runs here failed "READs resumed after None s" with the prefill's engine dead
# (worker exit -4, SIGILL) right after it was healthy; stop 14's "135 s restart" then no READs fits it too.
# After: 4 of 4 in a row passed under the engine lock, 170 / 203 / 192 / 152 s (2026-12-01, helper-30):
# each time 3 of 3 burst READs in flight at the kill (prefill frozen 0.36-0.73 s, 2688-3200 P/D
# tokens admitted meanwhile), READs back 3.0-4.9 s after the restart, 0 failures. Plants
# policy-fail + kill-before-read + no-prefill-restart in one run: "prefill-kill: 4 of 6 requests
# failed", "after-prefill-kill: 4 of 56", "no READ was issued while the prefill was frozen (0.0 in
# 0.48 s)", "no hand-over was cut by the kill", "0 of 3 burst turns compared", "P/D READs resumed
# after None s".
CI_PD = SoakConfig(sessions=4, phase_s=12.0, stop_s=6.0, turns=4, cycle=2, num_gpu_blocks=64, samples=2,
                   pd=True, faults=["stop", "prefill-kill"], think_s=2.0)


def timed_phases(doc: dict) -> tuple[str, ...]:
    """The phases that must have run requests: warm and each fault's after-phase."""
    names = [r["phase"] for r in doc["phases"]]
    return tuple(n for n in names if n == "warm" or n.startswith("after-"))


def soak_problems(doc: dict) -> list[str]:
    """Every target the run missed, as one line each (empty: all met). A store-only run with
    every fault checks what it always did; a run with fewer faults checks each fault it ran;
    a --pd run also the prefill kill: a hand-over in flight at the kill, P/D READs landing
    again within ``pd_recovery_bound_s`` of the restarted prefill, its burst compared."""
    problems = []
    rows = {r["phase"]: r for r in doc["phases"]}
    for name, r in rows.items():
        if r["failures"] != 0:
            problems.append(f"{name}: {r['failures']} of {r['requests']} requests failed "
                            f"(e.g. {doc['failure_examples'][:1]})")
        if r["differ"] != 0:
            bad = [c["why"] for c in doc["recompute_checks"] if c["phase"] == name and not c["matches"]]
            problems.append(f"{name}: {r['differ']} of {r['sampled']} sampled turns differ from recompute: {bad}")
    timed = timed_phases(doc)
    for name in timed:
        if rows[name]["requests"] == 0:
            problems.append(f"{name}: no requests ran")
    sampled = sum(r["sampled"] for r in rows.values())
    if sampled < len(timed):
        problems.append(f"only {sampled} turns compared with a recompute")
    if "corrupt" in rows:
        if doc["corruption"].get("planted", 0) == 0:
            problems.append(f"nothing corrupted: {doc['corruption']}")
        refused = sum(rows[p]["corrupt_refused"] or 0 for p in ("corrupt", "after-corrupt", "node-kill",
                                                                 "after-node-kill", "kill", "after-kill",
                                                                 "prefill-kill", "after-prefill-kill") if p in rows)
        if refused == 0:
            problems.append(f"none of {doc['corruption'].get('planted')} corrupted objects was refused")
    if "kill" in rows:
        back, bound = doc["store_loads_back_after_s"], doc["recovery_bound_s"]
        if back is None or back > bound:
            problems.append(f"store loads back after {back} s of the new master (bound {bound:.1f} s)")
        hit = doc["hit_rate_after_recovery"]
        if not hit:
            problems.append(f"hit rate after recovery {hit}")
    if doc["config"].get("pd"):
        if not rows["warm"].get("p2p_tokens"):
            problems.append(f"warm: the decode read no tokens from its peer ({rows['warm'].get('p2p_tokens')})")
        # /metrics tells what the decode's log tells, through every fault: reads = provenance
        # lines, failed reads = pd_worker's per-job failure lines, and the causes sum to them.
        burst = doc.get("burst") or {}
        m, log = burst.get("decode_pd_metrics") or {}, burst.get("decode_reads_total") or {}
        if not pd_counts_agree(log, m):
            problems.append(f"decode /metrics vllm:hybridkv_pd_* {m} disagree with its log {log}")
    if "prefill-kill" in rows:
        burst = doc.get("burst") or {}
        if not burst.get("reads_issued_at_kill"):
            problems.append(f"no READ was issued while the prefill was frozen before its kill (decode's p2p "
                            f"admissions grew by {burst.get('reads_issued_at_kill')} in {burst.get('frozen_s')} s)")
        if not burst.get("in_flight_at_kill"):
            problems.append(f"no hand-over was cut by the kill: {burst.get('requests')}")
        burst_checks = [c for c in doc["recompute_checks"] if c.get("burst")]
        if len(burst_checks) != burst.get("handed_over"):
            problems.append(f"{len(burst_checks)} of {burst.get('handed_over')} burst turns compared with a recompute")
        back, bound = doc.get("pd_reads_back_after_s"), doc["pd_recovery_bound_s"]
        if back is None or back > bound:
            problems.append(f"P/D READs resumed after {back} s of the restarted prefill (bound {bound:.1f} s)")
    if doc.get("servers_exited"):
        problems.append(f"servers exited on their own before shutdown (return codes): {doc['servers_exited']}")
    if doc["left_processes"] or doc["left_dirs"]:
        problems.append(f"left after shutdown: processes {doc['left_processes']}, dirs {doc['left_dirs']}")
    return problems


def test_soak_ci_variant(tmp_path):
    doc = run_soak(CI, tmp_path, keep_log=True)
    print(f"\nsoak CI variant ({doc['wall_s']:.0f} s); server log {tmp_path / 'soak.vllm.log'}")
    assert soak_problems(doc) == []


def test_soak_pd_ci_variant(tmp_path):
    doc = run_soak(CI_PD, tmp_path, keep_log=True)
    b = doc["burst"]
    print(f"\nP/D soak CI variant ({doc['wall_s']:.0f} s); logs {tmp_path}/soak_pd.*.log; "
          f"burst {b.get('in_flight_at_kill')} of {b.get('handed_over')} in flight at the kill; "
          f"READs back {doc['pd_reads_back_after_s']} s (bound {doc['pd_recovery_bound_s']:.1f} s)")
    assert soak_problems(doc) == []
