"""Scheduler lookup cost of HybridStoreConnector vs the bare batched existence query.

``python bench/lookup_cost.py`` (CPU only, starts its own mooncake_master).

For prompts of 4k/32k/128k tokens over a hybrid geometry (two dense groups at
different block sizes, a sliding window, Mamba align; hash unit 16), the store
holds every object of the prompt. Timed, side by side in one process:

* ``hybridkv``: ``StoreScheduler.get_num_new_matched_tokens`` (key building, ONE
  ``batch_is_exist`` round trip, vLLM's coordinator over the answers);
* ``floor``: one ``batch_is_exist`` of exactly the keys hybridkv probed;
* ``repeat``: the same lookup of the same waiting request again (the scheduler
  re-asks while it cannot admit the request; answered from ``lookup_cache_s``).

Ratios are medians over repeats in the same run. vLLM's in-tree
MooncakeStoreConnector is NOT measured here yet (issue 5).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import numpy as np
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from hybridkv.connector.store_config import StoreConnectorConfig
    from hybridkv.connector.store_scheduler import StoreScheduler
    from hybridkv.store.embedded_master import EmbeddedMaster
    from hybridkv.store.keys import KeySchema
    from hybridkv.store.mooncake_backend import MooncakeBackend
    from tests.unit.harness import Geometry, fa, mamba, sw

    init_none_hash(sha256)
    geo = Geometry(specs=[fa(16), fa(32, heads=2), sw(16, 128), mamba(64)], hash_block_size=16,
                   num_blocks=20_000, max_model_len=140_000)
    rows = []
    with EmbeddedMaster() as master:
        client = MooncakeBackend(master.address, global_segment_size=256 << 20)
        schema = KeySchema.create("bench", "bf16", [{"g": 4}])
        sched = StoreScheduler(StoreConnectorConfig(), schema, client, world_size=1)
        sched.bind(geo.manager())
        buf = np.zeros(64, dtype=np.uint8)
        client.register(buf.ctypes.data, buf.nbytes)
        for n_tokens in (4096, 32768, 131072):
            tokens = list(np.random.default_rng(n_tokens).integers(3, 30000, n_tokens))
            req = Request(f"r{n_tokens}", tokens, SamplingParams(max_tokens=1), None,
                          block_hasher=get_request_block_hasher(16, sha256))
            # Store every key a lookup may probe (what a previous turn would have saved).
            probe = sched._mirror.probe_keys(req.block_hashes, req.num_tokens - 1, 0)
            keys = [schema.key(g, h) for g, h in probe]
            for lo in range(0, len(keys), 4096):
                part = keys[lo:lo + 4096]
                client.put_from(part, [buf.ctypes.data] * len(part), [64] * len(part))
            t_first, t_floor, t_repeat = [], [], []
            for _ in range(7):
                sched._recent_lookups.clear()  # a first lookup: nothing remembered for this request
                t0 = time.perf_counter()
                ext, _ = sched.get_num_new_matched_tokens(req, 0)
                t_first.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                client.exists(keys, timeout_s=30)
                t_floor.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                sched.get_num_new_matched_tokens(req, 0)
                t_repeat.append(time.perf_counter() - t0)
            med = statistics.median
            rows.append((n_tokens, len(keys), ext, med(t_first) * 1e3, min(t_first) * 1e3, max(t_first) * 1e3,
                         med(t_floor) * 1e3, med(t_first) / med(t_floor), med(t_repeat) / med(t_first)))
        client.close()
    print("geometry: FA16 + FA32 + SW16(window 128) + Mamba64 align, hash unit 16; 7 repeats")
    print("tokens  keys_probed  hit  hybridkv_ms(median [min-max])  floor_ms  hybridkv/floor  repeat/first")
    for r in rows:
        print(f"{r[0]:<7} {r[1]:<12} {r[2]:<6} {r[3]:.1f} [{r[4]:.1f}-{r[5]:.1f}]{'':<14} {r[6]:.1f}      "
              f"{r[7]:.2f}            {r[8]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
