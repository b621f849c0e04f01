"""The store's own processes and threads start outside the engine's CPU pinning."""

from __future__ import annotations

import os
import threading

from hybridkv.cli.pd_stack import split_cpus
from hybridkv.store.cpu_affinity import parse_cpu_list, unpinned, usable_cpus
from hybridkv.store.embedded_master import EmbeddedMaster


def test_parse_cpu_list_reads_the_kernel_format():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}


def _pinned_to_first_cpu(body):
    """Run ``body`` on a fresh thread pinned to one CPU, like a vLLM CPU worker's thread.

    On a runner with one usable CPU "pinned" and "every CPU" are the same set and these
    tests could not fail, so they refuse to run there instead of passing vacuously.
    """
    cpus = usable_cpus()
    assert len(cpus) >= 2, f"this runner has {len(cpus)} usable CPU(s): the affinity tests need 2+"
    result: dict = {}

    def run() -> None:
        os.sched_setaffinity(0, {min(usable_cpus())})
        try:
            result["value"] = body()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test thread
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_embedded_master_started_from_a_pinned_thread_may_use_every_cpu():
    """In CI the master inherited the worker's single core and stopped answering for a
    minute (lookups timed out, saves failed). It must get every usable CPU."""

    def start_master():
        master = EmbeddedMaster()
        try:
            return os.sched_getaffinity(master.pid), os.sched_getaffinity(0)
        finally:
            master.stop()

    master_cpus, caller_cpus_after = _pinned_to_first_cpu(start_master)
    assert master_cpus == usable_cpus() and len(master_cpus) >= 2
    assert caller_cpus_after == {min(usable_cpus())}, "the caller's own pinning must be restored"


def test_threads_created_inside_unpinned_are_free_and_the_caller_stays_pinned():
    def probe():
        seen = {}
        with unpinned():
            t = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getaffinity(0)))
            t.start()
            t.join()
        return seen["child"], os.sched_getaffinity(0)

    child, caller = _pinned_to_first_cpu(probe)
    assert child == usable_cpus() and child != caller
    assert caller == {min(usable_cpus())}


def test_split_cpus_gives_prefill_and_decode_disjoint_halves():
    assert split_cpus({0, 1}) == ("0", "1")
    assert split_cpus(set(range(16))) == ("0-7", "8-15")
    assert split_cpus({0, 2, 3, 4, 9, 10}) == ("0,2-3", "4,9-10")
    assert split_cpus({3}) is None
