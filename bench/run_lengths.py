"""Run lengths of block ids in real CPU-engine P/D hand-overs and store batches, and what coalesces.

    .venv/bin/python bench/run_lengths.py collect --log /tmp/runs.jsonl -- <command ...>
    .venv/bin/python bench/run_lengths.py summarize /tmp/runs.jsonl [...] [--json bench/results/run_lengths.json]

``collect`` runs the command (an e2e test, bench/agentic_replay.py) with a ``sitecustomize`` on
PYTHONPATH that every Python process of it (engines, workers) imports at start. It changes no
behaviour: it wraps ``PDTransport.read_blocks`` (decode's READ: per group the prefill's and
decode's block ids, the (block, region) pairs and the coalesced descriptors actually posted) and
``StoreWorker._move`` (per store batch: group, block ids, load or save, and the parts per object
of ``GroupLayout.regions`` vs ``object_regions``), appending one JSON line per call to ``--log``.

``summarize`` reports, per source: the distribution of runs of consecutive ids on each side (in
the order vLLM hands them over) and of runs consecutive on BOTH sides (what a descriptor can
span), descriptors per hand-over before and after coalescing, and the fraction of bytes that
travel in a descriptor spanning more than one (block, region) pair.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SITECUSTOMIZE = r"""
import json, os, sys, importlib.abc, importlib.machinery
_LOG = os.environ.get("HYBRIDKV_RUNLOG")

def _write(rec):
    try:
        rec["pid"] = os.getpid()
        with open(_LOG, "a") as f:
            f.write(json.dumps(rec) + "\n")
    except Exception:
        pass

def _patch_pd(mod):
    import numpy as np
    orig = mod.PDTransport.read_blocks
    def read_blocks(self, peer, remote_block_ids, local_block_ids, notif=b"", slices=None):
        h = orig(self, peer, remote_block_ids, local_block_ids, notif, slices)
        try:
            peer_groups = self._peers[peer][0]
            loc, rem = mod.read_descriptors(self.layout.groups, peer_groups, remote_block_ids, local_block_ids,
                                            slices=slices)
            cl, _ = mod.coalesced(loc, rem)
            sizes = cl[:, 1].astype(np.int64) if len(cl) else np.zeros(0, np.int64)
            starts = np.sort(loc[:, 0].astype(np.int64)) if len(loc) else np.zeros(0, np.int64)
            # pairs per posted descriptor: how many original rows start inside it
            if len(cl):
                c0 = cl[:, 0].astype(np.int64)
                pairs = np.searchsorted(starts, c0 + sizes, "left") - np.searchsorted(starts, c0, "left")
            else:
                pairs = np.zeros(0, np.int64)
            _write({"kind": "pd_read", "remote": [list(map(int, g)) for g in remote_block_ids],
                    "local": [list(map(int, g)) for g in local_block_ids], "regions": int(len(loc)),
                    "descs": int(h.num_descs), "bytes": int(sizes.sum()),
                    "merged_bytes": int(sizes[pairs > 1].sum()), "desc_sizes": sizes.tolist()})
        except Exception as e:
            _write({"kind": "error", "where": "pd", "error": repr(e)})
        return h
    mod.PDTransport.read_blocks = read_blocks

def _patch_store(mod):
    orig = mod.StoreWorker._move
    def _move(self, blocks, load, deadline=None, snapshot=False):
        try:
            groups = {}
            for g, b in zip(blocks.group_ids, blocks.block_ids):
                groups.setdefault(int(g), []).append(int(b))
            parts, merged = 0, 0
            for g, ids in groups.items():
                lay = self._layout.groups[g] if self._layout is not None else None
                if lay is not None:
                    parts += sum(len(r) for r in lay.regions(ids)[1])
                    merged += sum(len(r) for r in lay.object_regions(ids)[1])
            _write({"kind": "store_load" if load else "store_save", "groups": {str(k): v for k, v in groups.items()},
                    "parts": parts, "object_parts": merged, "staged": self._staging is not None})
        except Exception as e:
            _write({"kind": "error", "where": "store", "error": repr(e)})
        return orig(self, blocks, load, deadline, snapshot)
    mod.StoreWorker._move = _move

_TARGETS = {"hybridkv.connector.pd_transport": _patch_pd, "hybridkv.connector.store_worker": _patch_store}

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        def patched(module, _exec=exec_module, _name=name):
            _exec(module)
            try:
                _TARGETS[_name](module)
            except Exception as e:
                _write({"kind": "error", "where": "patch", "error": repr(e)})
        loader.exec_module = patched
        return spec

if _LOG:
    sys.meta_path.insert(0, _Finder())
"""


def collect(log: Path, command: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="hkv-runlog-") as d:
        Path(d, "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = dict(os.environ)
        env["PYTHONPATH"] = d + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["HYBRIDKV_RUNLOG"] = str(log)
        return subprocess.call(command, env=env, cwd=ROOT)


def runs(ids: list[int]) -> list[int]:
    from hybridkv.connector.block_layout import run_lengths

    return run_lengths(ids)


def joint_runs(remote: list[int], local: list[int]) -> list[int]:
    """Runs of pairs one apart the same way on BOTH sides (in hand-over order)."""
    from hybridkv.connector.block_layout import run_lengths

    return run_lengths(remote, local)


def _dist(xs: list[int]) -> dict:
    if not xs:
        return {"runs": 0}
    c = collections.Counter(xs)
    blocks = sum(xs)
    srt = sorted(xs)
    return {
        "runs": len(xs),
        "blocks": blocks,
        "mean_run": round(blocks / len(xs), 2),
        "median_run": srt[len(srt) // 2],
        "max_run": srt[-1],
        "blocks_in_runs_ge2": round(sum(x for x in xs if x > 1) / blocks, 3),
        "hist": {str(k): c[k] for k in sorted(c)},
    }


def summarize(paths: list[Path]) -> dict:
    out: dict = {}
    for p in paths:
        recs = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        src = p.stem
        pd = [r for r in recs if r["kind"] == "pd_read"]
        res: dict = {"records": len(recs), "errors": [r for r in recs if r["kind"] == "error"][:3]}
        if pd:
            rr, lr, jr, ur = [], [], [], []
            for r in pd:
                for rem, loc in zip(r["remote"], r["local"]):
                    if rem:
                        rr += runs(rem)
                        lr += runs(loc)
                        jr += joint_runs(rem, loc)
                # groups overlay one allocation and share the block pool: block b of one group
                # and b+1 of another can be neighbours in memory, so pairs of all groups, by local id
                pairs = sorted(
                    (l_, r_)
                    for rem, loc in zip(r["remote"], r["local"])
                    for r_, l_ in zip(rem, loc)
                )
                if pairs:
                    ur += joint_runs([p[1] for p in pairs], [p[0] for p in pairs])
            res["pd"] = {
                "handovers": len(pd),
                "blocks": sum(len(g) for r in pd for g in r["remote"]),
                "remote_runs": _dist(rr),
                "local_runs": _dist(lr),
                "joint_runs": _dist(jr),
                "joint_runs_all_groups": _dist(ur),
                "regions": sum(r["regions"] for r in pd),
                "descs": sum(r["descs"] for r in pd),
                "bytes": sum(r["bytes"] for r in pd),
                "bytes_coalesced_fraction": round(
                    sum(r["merged_bytes"] for r in pd) / max(1, sum(r["bytes"] for r in pd)), 3
                ),
                "per_handover": [[r["regions"], r["descs"]] for r in pd],
            }
        for kind in ("store_save", "store_load"):
            st = [r for r in recs if r["kind"] == kind]
            if not st:
                continue
            br = []
            for r in st:
                for ids in r["groups"].values():
                    br += runs(ids)
            res[kind] = {
                "batches": len(st),
                "blocks": sum(len(v) for r in st for v in r["groups"].values()),
                "runs_in_batch_order": _dist(br),
                "sorted_runs": _dist(
                    [x for r in st for v in r["groups"].values() for x in runs(sorted(v))]
                ),
                "parts": sum(r["parts"] for r in st),
                "object_parts": sum(r["object_parts"] for r in st),
                "staged": sorted({r["staged"] for r in st}),
            }
        out[src] = res
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--log", type=Path, required=True)
    c.add_argument("command", nargs=argparse.REMAINDER)
    s = sub.add_parser("summarize")
    s.add_argument("logs", nargs="+", type=Path)
    s.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.cmd == "collect":
        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        return collect(args.log, cmd)
    sys.path.insert(0, str(ROOT.parent))
    doc = summarize(args.logs)
    text = json.dumps(doc, indent=1)
    if args.json:
        args.json.write_text(text)
    for src, res in doc.items():
        print(
            src,
            json.dumps(
                {
                    k: (
                        v if k != "pd" else {kk: vv for kk, vv in v.items() if kk != "per_handover"}
                    )
                    for k, v in res.items()
                },
                indent=1,
            ),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
