"""Writers of one tiny model take turns: a second writer waits for the first's lock.

Why: scripts/test.sh runs the unit lane beside the e2e lane, and on a clean machine both
build the same tiny model (~/.cache/hybridkv/models) in their first seconds. Without a lock
the writers share ``model.safetensors.tmp`` and the second ``os.replace`` finds it already
moved and fails with "FileNotFoundError" (8 spawned writers released by one barrier hit
it only some of the time). That race is too rare to be the test; this test holds the
lock as another writer would and checks that a writer neither writes nor returns meanwhile,
then completes once the lock is released (without the lock it returns at once: fails).
"""

from __future__ import annotations

import fcntl
import threading

from hybridkv.cli.harness.tiny_models import write_tiny_model


def test_a_writer_waits_for_the_lock_holder_then_writes_a_complete_model(tmp_path):
    out = tmp_path / "gemma3-s3"
    done = threading.Event()
    with open(tmp_path / ".gemma3-s3.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process is writing this model
        writer = threading.Thread(
            target=lambda: (write_tiny_model("gemma3", out, seed=3), done.set()), daemon=True
        )
        writer.start()
        assert not done.wait(3.0), "a writer went ahead while another held the model's lock"
        assert not (out / "model.safetensors").exists()
    writer.join(60)
    assert done.is_set()
    assert (out / "model.safetensors").stat().st_size > 0 and not list(out.glob("*.tmp"))
    assert write_tiny_model("gemma3", out, seed=3) == out  # current: returned without the lock
