"""Drive vLLM's REAL KVCacheManager with hand-built hybrid geometries.

No engine: requests go through ``allocate_slots`` in chunks exactly as the
scheduler would admit them, so the manager's block pool ends up holding what a
real run would cache (window tails only, Mamba checkpoints only, partial tails
in fine-grained mode). Tests compare hybridkv's answers with this manager's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    get_mamba_prefill_checkpoint_position,
)
from vllm.v1.request import Request

from hybridkv.store import vllm_compat

init_none_hash(sha256)


def fa(block_size: int, heads: int = 1) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=8, dtype=torch.float16
    )


def sw(block_size: int, window: int, heads: int = 1) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=8,
        dtype=torch.float16,
        sliding_window=window,
    )


def mamba(block_size: int) -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        shapes=((4,),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
    )


@dataclass
class Geometry:
    """A hand-built geometry: specs, flags and the block sizes vLLM needs."""

    specs: list[KVCacheSpec]
    hash_block_size: int
    eagle_group: int | None = None  # group flagged is_eagle_group
    use_eagle: bool = False
    num_blocks: int = 400
    max_model_len: int = 8192
    retention_interval: int | None = None
    label: str = field(default="")

    @property
    def scheduler_block_size(self) -> int:
        import math

        out = 1
        for s in self.specs:
            out = out * s.block_size // math.gcd(out, s.block_size)
        return out

    def kv_cache_config(self) -> KVCacheConfig:
        groups = [
            KVCacheGroupSpec([f"layer{i}"], spec, is_eagle_group=(i == self.eagle_group))
            for i, spec in enumerate(self.specs)
        ]
        return KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=self.retention_interval,
        )

    def manager(self) -> KVCacheManager:
        return KVCacheManager(
            self.kv_cache_config(),
            max_model_len=self.max_model_len,
            scheduler_block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            use_eagle=self.use_eagle,
            num_prefill_lookahead=1 if self.use_eagle else 0,
        )


_counter = [0]


def make_request(geo: Geometry, tokens: list[int], salt: str | None = None) -> Request:
    _counter[0] += 1
    return Request(
        f"req-{_counter[0]}",
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(geo.hash_block_size, sha256),
    )


def run_prefill(
    manager: KVCacheManager,
    geo: Geometry,
    tokens: list[int],
    rng: random.Random | None = None,
    free: bool = True,
) -> Request | None:
    """Admit a request like the scheduler: local hit, then chunked prefill.

    Chunks end on scheduler-block boundaries (what the scheduler does with
    Mamba align mode) except the last. Returns None if the pool was too full.
    """
    rng = rng or random.Random(0)
    req = make_request(geo, tokens)
    computed, num_local, _ = manager.get_computed_blocks(req)
    first = True
    sbs = geo.scheduler_block_size
    while req.num_computed_tokens < req.num_tokens:
        start = req.num_computed_tokens if not first else num_local
        remaining = req.num_tokens - start
        chunk = min(remaining, sbs * rng.randint(1, 4))
        if chunk < remaining:
            # End the chunk on a scheduler-block boundary.
            end = (start + chunk) // sbs * sbs
            chunk = max(end - start, min(remaining, sbs))
        # Like the scheduler's tail_boundary stop: end a chunk at the prompt's
        # Mamba checkpoint so fine-grained (sub-block) states exist there.
        checkpoint = get_mamba_prefill_checkpoint_position(
            req.num_prompt_tokens, geo.hash_block_size, geo.use_eagle
        )
        if start < checkpoint < start + chunk:
            chunk = checkpoint - start
        if first:
            out = manager.allocate_slots(
                req, chunk, num_new_computed_tokens=num_local, new_computed_blocks=computed
            )
            req.num_computed_tokens = num_local
            first = False
        else:
            out = manager.allocate_slots(req, chunk)
        if out is None:
            manager.free(req)
            return None
        req.num_computed_tokens += chunk
    if free:
        manager.free(req)
    return req


def cached_keys(manager: KVCacheManager) -> set[tuple[int, bytes]]:
    """What a store would hold if it mirrored this manager's prefix cache."""
    return {
        (get_group_id(k), bytes(get_block_hash(k)))
        for k in vllm_compat.cached_block_ids(manager.block_pool.cached_block_hash_to_block)
    }


def evict_random(manager: KVCacheManager, rng: random.Random, fraction: float) -> None:
    ids = {
        i
        for entry in vllm_compat.cached_block_ids(
            manager.block_pool.cached_block_hash_to_block
        ).values()
        for i in entry
    }
    victims = {i for i in ids if rng.random() < fraction}
    if victims:
        manager.evict_blocks(victims)


def nonnull_positions(blocks) -> list[int]:
    return [i for i, b in enumerate(blocks) if not b.is_null]
