"""`hybridkv mirror-demo`: what hybridkv decides that vLLM's own reference gets wrong.

Runs without an engine, in a few seconds, against a REAL embedded
``mooncake_master``:

1. builds vLLM's real ``KVCacheManager`` for a hybrid geometry with two dense
   groups at different block sizes (16 and 32) plus a Mamba group;
2. serves a multi-turn session (each prompt extends the previous one) through
   the manager, writes every block the manager caches to the Mooncake store
   under hybridkv's keys (only the masked window/Mamba blocks), and looks each
   next turn up in the store with ONE batched existence query, computing the
   hit with vLLM's own coordinator (the store mirror) -- and checks it equals
   the manager's own hit;
3. evicts the 32-token dense group deeper than the 16-token one and prints
   what vLLM's ``get_computed_blocks_for_connector`` reports vs hybridkv's
   reconciled dense reference.

This demo exercises the parts the engine-level connector (HybridStoreConnector)
stands on.
"""

from __future__ import annotations

import random
import sys
import time

from vllm.utils.math_utils import cdiv


def _rows(title: str, header: list[str], rows: list[list[object]]) -> None:
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  " + "  ".join(str(x).ljust(w) for x, w in zip(r, widths)))


def _chunked_prefill(manager, req, chunk: int = 64) -> None:
    """Prefill like the scheduler with chunked prefill: chunks end on block
    boundaries and one ends at the prompt's Mamba checkpoint, so Mamba states
    exist where a later turn can resume."""
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

    checkpoint = get_mamba_prefill_checkpoint_position(req.num_prompt_tokens, 16, False)
    while req.num_computed_tokens < req.num_tokens:
        start = req.num_computed_tokens
        end = min(req.num_tokens, start + chunk)
        if start < checkpoint < end:
            end = checkpoint
        assert manager.allocate_slots(req, end - start) is not None
        req.num_computed_tokens = end


def run_demo(turns: int = 4, seed: int = 0) -> int:
    import numpy as np
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (
        get_block_hash,
        get_group_id,
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.request import Request

    from hybridkv.connector.dense_reference import reconciled_computed_blocks_for_connector
    from hybridkv.store.embedded_master import EmbeddedMaster
    from hybridkv.store.geometry import GroupGeometry
    from hybridkv.store.keys import KeySchema
    from hybridkv.store.mirror import StoreMirror
    from hybridkv.store.mooncake_backend import MooncakeBackend

    init_none_hash(sha256)
    specs = [
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16),
        FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.bfloat16),
        MambaSpec(
            block_size=32, shapes=((64,),), dtypes=(torch.float32,), mamba_cache_mode="align"
        ),
    ]
    config = KVCacheConfig(
        num_blocks=600,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
    )
    manager = KVCacheManager(
        config, max_model_len=16384, scheduler_block_size=32, hash_block_size=16
    )
    geometry = GroupGeometry.from_kv_cache_manager(manager)
    mirror = StoreMirror(geometry)
    schema = KeySchema.create("demo-hybrid", "bfloat16", geometry.describe())
    hasher = get_request_block_hasher(16, sha256)
    _rows(
        "KV cache groups (read off vLLM's coordinator)",
        list(geometry.describe()[0]),
        [list(r.values()) for r in geometry.describe()],
    )

    rng = random.Random(seed)
    payload = np.zeros(4096, dtype=np.uint8)
    master = EmbeddedMaster()
    store = MooncakeBackend(
        master.address, global_segment_size=64 << 20, local_buffer_size=16 << 20
    )
    rows, ok = [], True
    try:
        store.register(payload.ctypes.data, payload.nbytes)
        tokens: list[int] = []
        for turn in range(1, turns + 1):
            tokens = tokens + [rng.randrange(2000) for _ in range(rng.randint(150, 400))]
            req = Request(
                f"t{turn}", list(tokens), SamplingParams(max_tokens=1), None, block_hasher=hasher
            )
            t0 = time.perf_counter()
            queries = []

            def exists(keys):
                queries.append(len(keys))
                return store.exists([schema.key(g, h) for g, h in keys])

            hit = mirror.longest_hit(req.block_hashes, req.num_tokens - 1, exists)
            lookup_ms = (time.perf_counter() - t0) * 1e3
            # Prefill the turn through the real manager, then save what it caches.
            _chunked_prefill(manager, req)
            cached = [
                (get_group_id(k), bytes(get_block_hash(k)))
                for k in manager.block_pool.cached_block_hash_to_block._cache
            ]
            keys = [schema.key(g, h) for g, h in cached]
            codes = store.put_from(keys, [payload.ctypes.data] * len(keys), [256] * len(keys))
            manager.free(req)
            # The store must give the same hit as a manager holding the same blocks.
            replay = Request(
                f"r{turn}", list(tokens), SamplingParams(max_tokens=1), None, block_hasher=hasher
            )
            store_hit = mirror.longest_hit(
                replay.block_hashes,
                replay.num_tokens - 1,
                lambda ks: store.exists([schema.key(g, h) for g, h in ks]),
            ).tokens
            manager_hit = manager.get_computed_blocks(replay)[1]
            ok &= store_hit == manager_hit and all(c == 0 for c in codes)
            rows.append(
                [
                    turn,
                    len(tokens),
                    hit.tokens,
                    f"{lookup_ms:.1f}",
                    queries[0],
                    len(keys),
                    store_hit,
                    manager_hit,
                    store_hit == manager_hit,
                ]
            )
    finally:
        store.close()
        master.stop()
    _rows(
        "Multi-turn session through a real mooncake_master (store hit = vLLM coordinator over store keys)",
        [
            "turn",
            "prompt",
            "store_hit_before",
            "lookup_ms",
            "keys_probed",
            "keys_in_store",
            "replay_store_hit",
            "replay_manager_hit",
            "equal",
        ],
        rows,
    )

    # Dense reference: evict the 32-token dense group deeper than the 16-token one.
    manager = KVCacheManager(
        config, max_model_len=16384, scheduler_block_size=32, hash_block_size=16
    )
    geometry = GroupGeometry.from_kv_cache_manager(manager)
    prompt = [rng.randrange(2000) for _ in range(257)]
    req = Request("p", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    _chunked_prefill(manager, req)
    ids = manager.get_block_ids(req.request_id)
    manager.free(req)
    manager.evict_blocks(set(ids[1][2:]))
    q = Request("q", prompt + [1, 2, 3], SamplingParams(max_tokens=1), None, block_hasher=hasher)
    vb, vlen, _, vdiv = manager.get_computed_blocks_for_connector(q)
    hb, hlen, _, hdiv = reconciled_computed_blocks_for_connector(manager, geometry, q)
    _rows(
        "Dense reference after evicting the 32-token dense group past token 64",
        [
            "who",
            "reported_tokens",
            "fa16_covers",
            "fa32_covers",
            "diverged",
            "every_dense_list_covers",
        ],
        [
            [
                "vLLM 0.32",
                vlen,
                len(vb.blocks[0]) * 16,
                len(vb.blocks[1]) * 32,
                vdiv,
                len(vb.blocks[0]) * 16 >= vlen and len(vb.blocks[1]) * 32 >= vlen,
            ],
            [
                "hybridkv",
                hlen,
                len(hb.blocks[0]) * 16,
                len(hb.blocks[1]) * 32,
                hdiv,
                len(hb.blocks[1]) * 32 >= hlen and len(hb.blocks[0]) == cdiv(hlen, 16),
            ],
        ],
    )
    ok &= len(hb.blocks[1]) * 32 >= hlen
    print("\nRESULT:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_demo())
