#!/usr/bin/env python3
"""Plant deliberate, plausible bugs one at a time and check the unit suite turns red.

Why: a green suite says little unless each check can fail on the bug it is meant to
catch. Each mutation below is a one-line change a real edit could make (an off-by-one,
max for min, a one-block shift). For each: a fresh copy of the committed tree
(``git archive HEAD``, never the live working tree, which is not touched) with the one
change applied, then the unit tests that should notice, run against THAT copy (a shim
package on PYTHONPATH maps ``hybridkv.*`` to the copy's folders ahead of the editable
install). A mutation that stays green is a hole in the suite. The unmutated copy runs
each test set first: a red baseline would make the result meaningless.

Not in CI (minutes of CPU); run by hand::

    .venv/bin/python scripts/mutation_check.py            # every mutation
    .venv/bin/python scripts/mutation_check.py M3 M5      # some
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"store": "store", "connector": "connector", "cli": "cli"}  # hybridkv.<name> -> folder


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, in words
    path: str  # file, relative to the repository root
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation(
        "M1",
        "mirror: sparse groups also taken as held by the local dense prefix",
        "store/mirror.py",
        "if local is not None and gid in self._dense_ids:",
        "if local is not None:",
        ("tests/unit/test_mirror_matches_manager.py",),
    ),
    Mutation(
        "M2",
        "mirror: probing past the local dense prefix skips one block",
        "store/mirror.py",
        "first_end_unit = (local_dense_tokens // unit // step_units + 1) * step_units",
        "first_end_unit = (local_dense_tokens // unit // step_units + 2) * step_units",
        ("tests/unit/test_mirror_matches_manager.py",),
    ),
    Mutation(
        "M3",
        "save mask: Mamba checkpoint alignment off by one block",
        "store/mirror.py",
        "m and ((start_block + i + 1) * group.block_size) % align == 0",
        "m and ((start_block + i) * group.block_size) % align == 0",
        ("tests/unit/test_save_mask.py",),
    ),
    Mutation(
        "M4",
        "save mask: replay boundaries computed without the EAGLE drop",
        "store/mirror.py",
        "use_eagle=bool(vllm_compat.eagle_drop_group_ids(self._coordinator)),",
        "use_eagle=False,",
        ("tests/unit/test_save_mask.py",),
    ),
    Mutation(
        "M5",
        "dense reference: report the MAX of the dense hits (vLLM's bug) instead of the min",
        "connector/dense_reference.py",
        "reported = min(dense_hits)",
        "reported = max(dense_hits)",
        ("tests/unit/test_dense_reference.py", "tests/unit/test_truncation_drift.py"),
    ),
    Mutation(
        "M6",
        "dense reference: eviction guard also fires on a sparse hit EQUAL to the deepest dense",
        "connector/dense_reference.py",
        "if any(h > deepest_dense for h in sparse_hits):",
        "if any(h >= deepest_dense for h in sparse_hits):",
        ("tests/unit/test_dense_reference.py",),
    ),
    Mutation(
        "M7",
        "block layout: manager block b addressed one block further (b + 1)",
        "connector/block_layout.py",
        "addrs = self.bases[None, :] + ids[:, None] * self.strides[None, :]",
        "addrs = self.bases[None, :] + (ids[:, None] + 1) * self.strides[None, :]",
        (
            "tests/unit/test_store_connector_parts.py",
            "tests/unit/test_block_staging.py",
            "tests/unit/test_pd_transport.py",
        ),
    ),
    Mutation(
        "M8",
        "P/D plan: the READ takes the peer's blocks shifted by one",
        "connector/pd_transport.py",
        "r_addr = rg.region_addrs(r_ids)",
        "r_addr = rg.region_addrs([i + 1 for i in r_ids])",
        ("tests/unit/test_pd_transport.py",),
    ),
    Mutation(
        "M9",
        "object trailer: checksum not seeded with the key (right payload under another key passes)",
        "store/object_trailer.py",
        "return xxhash.xxh3_64_intdigest(payload, seed=key_seed(key))",
        "return xxhash.xxh3_64_intdigest(payload)",
        ("tests/unit/test_object_trailer.py",),
    ),
]


def _snapshot(dest: Path) -> None:
    """The committed tree (HEAD) into ``dest``, plus the shim package."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    shim = dest / ".mutshim" / "hybridkv"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('"""hybridkv mapped onto a mutation copy."""\n')
    for name, folder in PACKAGES.items():
        (shim / name).symlink_to(dest / folder, target_is_directory=True)


def _run_tests(copy: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[str, float, str]:
    env = dict(
        os.environ,
        PYTHONPATH=f"{copy / '.mutshim'}{os.pathsep}{copy}",
        HYPOTHESIS_STORAGE_DIRECTORY=str(copy / ".hypothesis"),
    )
    check = (
        "import hybridkv.store.mirror as m, sys; "
        f"sys.exit(0 if m.__file__.startswith({str(copy)!r}) else 3)"
    )
    if subprocess.run([sys.executable, "-c", check], cwd=copy, env=env).returncode != 0:
        raise SystemExit(f"the shim did not take: hybridkv still imports from outside {copy}")
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0, ""
    failed = [ln for ln in p.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    last = p.stdout.strip().splitlines()[-1:] or [""]
    verdict = (
        "green" if p.returncode == 0 else ("red" if p.returncode == 1 else f"rc={p.returncode}")
    )
    return verdict, time.monotonic() - t0, (failed or last)[0][:120]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    work = Path(tempfile.mkdtemp(prefix="hybridkv-mut-"))
    rows, caught = [], 0
    try:
        base = work / "baseline"
        _snapshot(base)
        baselines: dict[tuple[str, ...], str] = {}
        for m in chosen:
            if m.tests not in baselines:
                verdict, secs, why = _run_tests(base, m.tests, args.timeout_s)
                baselines[m.tests] = verdict
                print(
                    f"baseline {' '.join(m.tests)}: {verdict} ({secs:.0f}s) {why if verdict != 'green' else ''}",
                    flush=True,
                )
        for m in chosen:
            if baselines[m.tests] != "green":
                rows.append((m, "skipped (baseline not green)", 0.0, ""))
                continue
            copy = work / m.name
            _snapshot(copy)
            target = copy / m.path
            text = target.read_text()
            if text.count(m.old) != 1:
                rows.append(
                    (
                        m,
                        f"NOT APPLIED ({text.count(m.old)} matches: the code moved, update it)",
                        0.0,
                        "",
                    )
                )
                print(f"{m.name}: {rows[-1][1]}", flush=True)
                continue
            target.write_text(text.replace(m.old, m.new))
            verdict, secs, why = _run_tests(copy, m.tests, args.timeout_s)
            caught += verdict == "red"
            rows.append((m, "CAUGHT" if verdict == "red" else f"SURVIVED ({verdict})", secs, why))
            print(f"{m.name}: {rows[-1][1]} in {secs:.0f}s  {why}", flush=True)
            if not args.keep:
                shutil.rmtree(copy, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| mutation | bug | tests | result | time |\n|---|---|---|---|---|")
    for m, result, secs, why in rows:
        tests = ", ".join(Path(t).name for t in m.tests)
        print(
            f"| {m.name} | {m.what} | {tests} | {result}{': ' + why if why else ''} | {secs:.0f}s |"
        )
    print(f"\n{caught}/{len(chosen)} mutations caught")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    raise SystemExit(main())
