"""HybridStoreConnector: what vLLM loads from ``--kv-transfer-config``.

A thin dispatcher: configuration and startup checks live here, the scheduler
side in :mod:`hybridkv.connector.store_scheduler`, the worker side in
:mod:`hybridkv.connector.store_worker`. Setups that cannot work are refused in
the constructor, so the engine fails at startup with the reason and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.connector.block_copies import block_copy_views, redo_block_copies
from hybridkv.connector.block_layout import layer_specs
from hybridkv.connector.cpu_amx import allow_amx
from hybridkv.connector.store_auth import StoreSecret
from hybridkv.connector.store_config import (
    ConfigError,
    StoreConnectorConfig,
    load_failure_policy_warning,
    refuse_non_tensor_parallelism,
)
from hybridkv.connector.store_keys import store_key_schema
from hybridkv.connector.store_metadata import StoreConnectorMetadata
from hybridkv.connector.store_scheduler import StoreScheduler
from hybridkv.connector.store_stats import HybridStorePromMetrics, HybridStoreStats
from hybridkv.connector.store_worker import StoreWorker
from hybridkv.connector.vllm_hooks import StoreConnectorHooks
from hybridkv.store.cpu_affinity import unpinned
from hybridkv.store.logs import get_logger
from hybridkv.store.session import (
    ClientSettings,
    embedded_master_address,
    release_all,
    shared_client,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__, "store")


def check_supported(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> None:
    """Refuse, at startup, engine settings under which the store cannot be correct."""
    if not vllm_config.cache_config.enable_prefix_caching:
        raise ConfigError(
            "HybridStoreConnector keys the store by prefix-cache block hashes: start vLLM with "
            "--enable-prefix-caching (or remove the connector)"
        )
    # each rank's objects are keyed by its tensor-parallel rank only
    refuse_non_tensor_parallelism(vllm_config.parallel_config, "HybridStoreConnector")
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        for s in layer_specs(group):
            if isinstance(s, MambaSpec) and s.mamba_cache_mode != "align":
                raise ConfigError(
                    f"KV cache group {gid} holds Mamba/linear-attention state with "
                    f"mamba_cache_mode={s.mamba_cache_mode!r}; the store can only serve states "
                    "checkpointed at block boundaries: start vLLM with --mamba-cache-mode align"
                )
            if isinstance(s, MambaSpec) and s.block_size != vllm_config.cache_config.block_size:
                logger.warning(
                    "KV cache group %d keeps Mamba states every %d tokens but --block-size is "
                    "%s; vLLM 0.32 aligns prefill chunks to --block-size, so states at %d-token "
                    "boundaries are often never written and neither the local prefix cache nor the "
                    "store can hit them. Start vLLM with --block-size %d.",
                    gid,
                    s.block_size,
                    vllm_config.cache_config.block_size,
                    s.block_size,
                    s.block_size,
                )


class HybridStoreConnector(StoreConnectorHooks, KVConnectorBase_V1, SupportsHMA):
    """Offload and cross-instance prefix reuse through a Mooncake store, for hybrid KV caches."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self._cfg = StoreConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        check_supported(vllm_config, kv_cache_config)
        self._loads_enabled = ktc.kv_role in ("kv_both", "kv_consumer")
        self._saves_enabled = ktc.kv_role in ("kv_both", "kv_producer")
        address = self._cfg.master_address
        if address is None:
            address, _ = embedded_master_address(
                str(ktc.engine_id), self._cfg.embedded_lease_ttl_ms
            )
        self._master_address = address
        settings = ClientSettings(
            local_hostname=self._cfg.local_hostname,
            global_segment_size=self._cfg.global_segment_size
            if role == KVConnectorRole.WORKER
            else 0,
            local_buffer_size=self._cfg.local_buffer_size,
            protocol=self._cfg.protocol,
            rdma_devices=self._cfg.rdma_devices,
            timeout_s=self._cfg.timeout_s,
            listen_on_host=self._cfg.pin_mooncake_listeners,
            populate_segment=self._cfg.populate_segment,
            read_wait_nice=self._cfg.read_wait_nice,
        )
        client = shared_client(address, settings)
        self._scheduler: StoreScheduler | None = None
        self._worker: StoreWorker | None = None
        self._copy_views: list["torch.Tensor"] = []  # see register_kv_caches
        secret = StoreSecret.load(self._cfg)  # once: the keys' tenant id and the workers' MAC
        tenant = secret.tenant  # the secret's id: its own keys per secret
        if role == KVConnectorRole.SCHEDULER:
            if warning := load_failure_policy_warning(ktc.kv_load_failure_policy):
                logger.warning("%s", warning)
            self._scheduler = StoreScheduler(
                self._cfg,
                store_key_schema(vllm_config, kv_cache_config, self._cfg.namespace, tenant=tenant),
                client,
                world_size=vllm_config.parallel_config.world_size,
            )
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            allow_amx()  # before this worker's first forward (a full store hit leaves 1 token; see allow_amx)
            schema = store_key_schema(
                vllm_config,
                kv_cache_config,
                self._cfg.namespace,
                tp_rank=get_tensor_model_parallel_rank(),
                pp_rank=get_pp_group().rank_in_group,
                tenant=tenant,
            )
            with unpinned():  # its job threads must not share the engine's pinned core
                self._worker = StoreWorker(
                    self._cfg,
                    kv_cache_config,
                    schema,
                    client,
                    secret=secret,
                    cache_config=vllm_config.cache_config,
                )
        logger.info("HybridStoreConnector (%s) on master %s", role.name, address)

    # ----------------------------------------------------------------- scheduler
    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        # Lookups take the dense reference's local hit and supply the lagging sparse
        # state from the store (window tail, Mamba checkpoint); when the store cannot,
        # they answer 0 and vLLM falls back to the convergent local hit.
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: preemption may drop in-flight saves

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.bind(kv_cache_manager, loads=self._loads_enabled, saves=self._saves_enabled)

    def on_new_request(self, request: "Request") -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._loads_enabled:
            return 0, False
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping until workers acknowledge saves (releases pins).
        return self._scheduler is not None and self._scheduler.has_pending_saves()

    def has_pending_block_frees(self) -> bool:
        # True only when a pin alone holds a block: vLLM then waits for it instead of preempting.
        return self._scheduler is not None and self._scheduler.has_pin_only_blocks()

    def reset_cache(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)`` (a weight update, ``pause`` with
        ``clear_cache``): nothing stored before is loaded by this engine afterwards. The store is
        shared, so nothing is deleted; this engine's keys move to a new generation
        (``StoreScheduler.reset``). Engines sharing the master share objects again once they
        have been reset the same number of times."""
        if self._scheduler is not None:
            self._scheduler.reset()
        return True

    # -------------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        assert self._worker is not None
        with unpinned():  # threads started here (staging, Mooncake) stay off the engine's core
            self._worker.register_kv_caches(kv_caches)
        self._copy_views = block_copy_views(kv_caches, self._kv_cache_config.num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The model runner calls this after vLLM's own (partial) block copies, before the forward.
        super().bind_connector_metadata(connector_metadata)
        redo_block_copies(self._copy_views, getattr(connector_metadata, "block_copies", ()))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert self._worker is not None and isinstance(meta, StoreConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(
        self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # saves move whole blocks of all layers after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert self._worker is not None and isinstance(meta, StoreConnectorMetadata)
        self._worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def build_connector_worker_meta(self):  # noqa: ANN201 - vLLM's signature
        return self._worker.build_worker_meta() if self._worker is not None else None

    # ----------------------------------------------------------- both / metrics
    def get_kv_connector_stats(self) -> HybridStoreStats | None:
        side = self._scheduler or self._worker
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HybridStoreStats:
        return HybridStoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # noqa: ANN001, ANN206
        return HybridStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Stop this side's threads, then close this process's store clients and stop a master it
        owns (``release_all``) on BOTH sides. Why the worker too: vLLM starts workers by fork on
        GPU (its default) and a forked process exits by ``os._exit``, so the ``atexit`` hook never
        runs there; the worker's client (its segment, holding the objects it put) stayed mounted
        at the master until the master's client TTL, and other instances got TRANSFER_FAIL on
        those objects and recomputed (seen once the e2e engines started by fork)."""
        if self._worker is not None:
            self._worker.shutdown()
        release_all()
