"""A prefill engine idle apart from unread leases does not step in a tight loop, and still
learns a release within the pacing bound.

Real parts: vLLM's ``Scheduler`` with HybridPDConnector loaded as EngineCore builds it
(tests/unit/pd_real_scheduler.py), driven the way ``EngineCore.run_busy_loop`` drives it:
step while ``has_requests()``, 1 ms sleep after a step that ran no model. The workers'
replies are written by the test (no forward pass); a decode's release arrives as the
workers report it, in ``finished_sending``.
"""

from __future__ import annotations

import time

from tests.unit.harness import Geometry, fa
from tests.unit.pd_real_scheduler import model_dir, pd_request, pd_scheduler, prefill_leg, worker_reply  # noqa: F401

from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.connector.pd_idle import MAX_PAUSE_S

BLOCK = 16
HOLD_S = 1.0


def _engine_steps(sched, until: float, finished_sending: set[str] | None = None) -> int:  # noqa: ANN001
    """EngineCore's loop until ``until`` or no work; returns the steps run."""
    steps = 0
    while time.monotonic() < until and sched.has_requests():
        out = sched.schedule()
        sched.update_from_output(out, worker_reply(out, finished_sending=finished_sending))
        steps += 1
        if not out.total_num_scheduled_tokens:
            time.sleep(0.001)  # EngineCore._process_engine_step after a step without a model run
    return steps


def test_an_unread_lease_does_not_spin_the_engine_and_its_release_is_learned(model_dir, tmp_path):  # noqa: F811
    geo = Geometry([fa(BLOCK)], hash_block_size=BLOCK, num_blocks=64, max_model_len=4096)
    sched = pd_scheduler(model_dir, "kv_producer", geo, str(write_secret_file(tmp_path / "s")), max_num_seqs=4)
    prompt = list(range(1, 3 * BLOCK + 2))
    prefill_leg(sched, pd_request("p1", prompt, {"do_remote_decode": True}, BLOCK))
    assert sched.has_requests()  # the finished request waits for its lease: vLLM keeps stepping
    steps = _engine_steps(sched, time.monotonic() + HOLD_S)
    assert sched.has_requests()
    # Before: ~1 step per ms (hundreds per second, each a collective RPC on a real engine).
    assert steps <= 40, f"{steps} empty steps in {HOLD_S} s with one unread lease"
    released_at = time.monotonic()  # the decode's release reaches the worker now
    _engine_steps(sched, released_at + 5.0, finished_sending={"p1"})
    learned = time.monotonic() - released_at
    assert not sched.has_requests()
    assert learned <= MAX_PAUSE_S + 0.15, f"the release was learned after {learned:.3f} s"
