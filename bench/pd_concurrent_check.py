"""Reproducer: P/D hand-overs of concurrent sessions against a salted recompute (sliding-window hand-over).

    flock /tmp/hybridkv-engine.lock .venv/bin/python bench/pd_concurrent_check.py [--sessions 16] [--samples 60]

P/D only (cli/pd_stack.py's PDStack with its default HybridPDConnector configs: no store),
tiny gemma3, 256 KV blocks per instance. ``--sessions`` agentic sessions (the demo's seeded
Trajectory, 2 trajectories x 6 turns each) run at once through ``hybridkv proxy``; when all
are done, ``--samples`` served turns (seeded pick) are re-sent to the decode server alone
under a fresh ``cache_salt`` and compared with the demo's rule (agentic_demo.compare).
Exit status 1 when any sampled turn differs.

What it checks: concurrency only makes long prompts likely; the hazard is prompt length.
vLLM frees a prefill's sliding-window blocks outside the window of its LAST prompt token
before handing the block table over; decode resumes at the last block boundary before that token and needs the window before
the boundary. For N % 128 in {0, 127} that block is null in the hand-over unless the
connector asks for it (connector/pd_scheduler.py prefill_tokens / missing_blocks); without
that, decode reads around it and later turns inherit the bad KV from decode's prefix cache.
``--sessions 1 --first-slot 1 --blocks 2048`` reaches such a prompt length with one session.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import re
import sys
import tempfile
import threading
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from hybridkv.cli.agentic_demo import DEFAULT_LOGPROB_TOL, Client, Trajectory, compare
    from hybridkv.cli.harness.tiny_models import write_tiny_model
    from hybridkv.cli.pd_stack import PDStack

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--first-slot", type=int, default=0)
    args = p.parse_args(argv)
    model = str(
        write_tiny_model(
            "gemma3",
            pathlib.Path.home() / ".cache" / "hybridkv" / "tiny-models" / "gemma3-seed0",
            seed=0,
        )
    )
    work = pathlib.Path(tempfile.mkdtemp(prefix="hybridkv-pdcheck-"))
    extra = [
        "--seed",
        "0",
        "--max-num-batched-tokens",
        "512",
        "--max-num-seqs",
        "8",
        "--num-gpu-blocks-override",
        str(args.blocks),
    ]
    served: list[tuple] = []
    lock = threading.Lock()
    with PDStack(model, max_model_len=2048, extra_args=extra, log_dir=work) as stack:
        decode = Client(stack.decode.url, timeout_s=120)
        name = decode.model_card()[0]

        def session(slot: int) -> None:
            front = Client(stack.url, timeout_s=120)
            for gen in range(2):
                traj = Trajectory(1000 * slot + gen, 600, 120)
                prompt = answer = ""
                for turn in range(6):
                    prompt = traj.prompt(turn, prompt, answer)
                    c = front.complete(name, prompt, 16)
                    answer = c.text
                    with lock:
                        served.append((slot, gen, turn, prompt, c))

        threads = [
            threading.Thread(target=session, args=(args.first_slot + i,))
            for i in range(args.sessions)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        picked = random.Random(0).sample(served, min(args.samples, len(served)))
        bad = 0
        for slot, gen, turn, prompt, c in picked:
            ref = decode.complete(name, prompt, 16, cache_salt=f"pdcheck-{uuid.uuid4().hex}")
            cmp = compare(c, ref, DEFAULT_LOGPROB_TOL)
            if not cmp.matches or ref.cached_tokens:
                bad += 1
                print(
                    f"differs: session {slot} trajectory {gen} turn {turn} prompt {c.prompt_tokens} "
                    f"(prefill cached {c.cached_tokens}): {cmp.why}"
                )
        reads = len(re.findall(r"P/D: read \d+ blocks", (work / "decode.log").read_text()))
    print(
        f"{args.sessions} sessions, {len(served)} turns, {reads} P/D READs: {bad} of {len(picked)} sampled "
        "turns differ from a salted recompute"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
