"""HybridPDConnector: prefill/decode disaggregation over NIXL, for hybrid KV caches.

One class for both instances of a pair (``kv_role`` ``kv_producer`` / ``kv_consumer``
/ ``kv_both``); what a request does is decided by its ``kv_transfer_params``
(``do_remote_decode`` on the prefill instance, ``do_remote_prefill`` with the
prefill side's answer on the decode instance), which ``hybridkv proxy`` sets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.connector.block_copies import block_copy_views, redo_block_copies
from hybridkv.connector.block_layout import layer_specs
from hybridkv.connector.cpu_amx import allow_amx
from hybridkv.connector.pd_auth import load_key
from hybridkv.connector.pd_idle import IdlePacer
from hybridkv.connector.pd_lease_pins import LeasePins, PDLeaseWorkerMetadata
from hybridkv.connector.pd_metadata import PDConnectorMetadata
from hybridkv.connector.pd_scheduler import PDScheduler
from hybridkv.connector.pd_stats import HybridPDPromMetrics, HybridPDStats
from hybridkv.connector.pd_tp import MAMBA_TP_CROSS_SWITCH, MAMBA_TP_NOT_ENABLED
from hybridkv.connector.pd_worker import PDWorker, PDWorkerSettings, mamba_reslice_problem
from hybridkv.connector.store_config import (
    FLAG,
    SECONDS,
    SHARE,
    STRING,
    Check,
    bad_value,
    key,
    parse_declared,
    refuse_non_tensor_parallelism,
)
from hybridkv.connector.vllm_hooks import PDConnectorHooks
from hybridkv.store.cpu_affinity import unpinned
from hybridkv.store.keys import kv_identity
from hybridkv.store.logs import get_logger

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = get_logger(__name__, "P/D")


def _port(key_: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
        raise bad_value(key_, value, "expected 0 (any free port) or a port")
    return value


def _optional_path(key_: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise bad_value(key_, value, "expected a file path")
    return value or None


@dataclass(frozen=True)
class PDConnectorConfig:
    """HybridPDConnector's validated ``kv_connector_extra_config`` (docs/config.md says why each
    key is there; its table is :func:`~hybridkv.connector.store_config.markdown_table` of this)."""

    handshake_host: str = key(
        "127.0.0.1", STRING, "address the gRPC handshake service binds and advertises"
    )
    handshake_port: int = key(
        0,
        Check("port 0-65535", _port),
        "rank 0's handshake port (rank r binds port + r); 0: a free port per worker, advertised "
        "in `kv_transfer_params`",
    )
    lease_s: float = key(
        60.0, SECONDS, "seconds the prefill keeps a finished request's blocks for the decode side"
    )
    handshake_timeout_s: float = key(5.0, SECONDS, "decode: bound on one handshake round trip")
    read_timeout_s: float = key(
        30.0,
        SECONDS,
        "decode: bound on one request's read; past it the request recomputes or fails",
    )
    auth_secret_file: str | None = key(
        None,
        Check("file path", _optional_path),
        "the deployment secret signing `kv_transfer_params` and side-channel RPCs (or "
        "`$HYBRIDKV_AUTH_SECRET_FILE` / `$HYBRIDKV_AUTH_SECRET`)",
    )
    allow_unauthenticated: bool = key(
        False,
        FLAG,
        "run without a secret (any API client can forge `kv_transfer_params`; logged loudly)",
    )
    max_lease_fraction: float = key(
        0.5,
        SHARE,
        "prefill: share of the KV cache unread leases may hold; past it a finished request hands "
        "nothing over and its blocks are freed at once (any API client can send "
        "`do_remote_decode`)",
    )
    allow_mamba_cross_tp: bool = key(
        False,
        FLAG,
        "decode: pair with prefill instances of another TP size for GDN state, re-sliced "
        "byte-exact (below)",
    )

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "PDConnectorConfig":
        """Parse and validate; unknown keys are refused."""
        return parse_declared(cls, extra, "HybridPDConnector")


def _mamba_group_ids(kv_cache_config: "KVCacheConfig") -> tuple[int, ...]:
    return tuple(
        gid
        for gid, group in enumerate(kv_cache_config.kv_cache_groups)
        if any(isinstance(s, MambaSpec) for s in layer_specs(group))
    )


def _group_windows(kv_cache_config: "KVCacheConfig") -> tuple[int, ...]:
    """Each group's sliding window in tokens (0: none); see PDScheduler's ``group_windows``."""
    return tuple(
        max(
            (int(s.sliding_window) for s in layer_specs(group) if isinstance(s, SlidingWindowSpec)),
            default=0,
        )
        for group in kv_cache_config.kv_cache_groups
    )


def _mamba_problem(
    cfg: PDConnectorConfig, kv_cache_config: "KVCacheConfig", mamba: tuple[int, ...], engine_id: str
) -> str | None:
    """Why this instance does not pair with a prefill instance of another TP size for its
    Mamba state (None: it may; ``LocalLayout.mamba_problem``). With ``allow_mamba_cross_tp``
    a layout whose state pd_tp cannot re-slice is still refused, with the reason."""
    if not cfg.allow_mamba_cross_tp:
        return MAMBA_TP_NOT_ENABLED
    problem = mamba_reslice_problem(kv_cache_config)
    if problem:
        problem = f"{MAMBA_TP_CROSS_SWITCH} is on, but this state is not re-sliced: {problem}"
    if mamba:
        logger.warning(
            "%s: allow_mamba_cross_tp is ON: requests from prefill instances of another "
            "--tensor-parallel-size get their Mamba/GDN state (groups %s) re-sliced by heads%s. The state a "
            "prefill at another TP size computes is not the bits this size computes (vLLM's CPU GDN runs only "
            "in bfloat16), so outputs can differ from a local recompute",
            engine_id,
            list(mamba),
            f"; NOT for this model ({problem})" if problem else "",
        )
    return problem


def handshake_port_of(base: int, tp_rank: int, tp_size: int, dp_rank: int) -> int:
    """The handshake port of one worker: a configured port ``base`` is rank 0's and worker rank
    r of the instance serves ``base + r``, r = ``dp_rank * tp_size + tp_rank`` (each DP rank is
    an engine core with its own workers on the same host, as vLLM numbers them). 0: a free
    port."""
    return base + dp_rank * tp_size + tp_rank if base else 0


class HybridPDConnector(PDConnectorHooks, KVConnectorBase_V1, SupportsHMA):
    """Decode pulls every transfer-enabled group's blocks from prefill with NIXL READs."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self._cfg = PDConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        # Any --tensor-parallel-size: a decode instance reads prefill instances of another TP
        # size when the model's KV heads re-slice (pd_tp), else that request recomputes.
        refuse_non_tensor_parallelism(parallel, "HybridPDConnector")
        tp_size = int(parallel.tensor_parallel_size)
        model_config = vllm_config.model_config  # None in configs built without a model (tests)
        total_kv_heads = (
            int(model_config.get_total_num_kv_heads()) if model_config is not None else 0
        )
        engine_id = str(ktc.engine_id)
        mamba = _mamba_group_ids(kv_cache_config)
        key = load_key(self._cfg.auth_secret_file, self._cfg.allow_unauthenticated)
        self._scheduler: PDScheduler | None = None
        self._worker: PDWorker | None = None
        # Scheduler side: the leases' blocks, held by the connector (pd_lease_pins); empty
        # steps are paced while only leases or pins remain (pd_idle); the requests whose
        # READ this engine awaits.
        self._lease_pins = LeasePins(int(vllm_config.parallel_config.tensor_parallel_size))
        # Prefill: physical blocks unread leases may hold (max_lease_fraction of the cache).
        self._lease_budget = int(kv_cache_config.num_blocks * self._cfg.max_lease_fraction)
        self.leases_refused = 0
        self._block_pool: Any = None
        self._pacer = IdlePacer()
        self._awaiting_reads: set[str] = set()
        self._leases_ended: set[str] = (
            set()
        )  # worker side: for the next build_connector_worker_meta
        self._copy_views: list[torch.Tensor] = []
        if role == KVConnectorRole.SCHEDULER:
            mamba_problem = _mamba_problem(self._cfg, kv_cache_config, mamba, engine_id)
            align = 1
            for group in kv_cache_config.kv_cache_groups:
                align = math.lcm(align, group.kv_cache_spec.block_size)
            self._scheduler = PDScheduler(
                engine_id,
                bool(mamba),
                self._cfg.lease_s,
                mamba,
                align,
                can_prefill=ktc.is_kv_producer,
                can_decode=ktc.is_kv_consumer,
                group_block_sizes=tuple(
                    g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
                ),
                num_blocks=kv_cache_config.num_blocks,
                key=key,
                fail_on_refusal=ktc.kv_load_failure_policy == "fail",
                tp_size=tp_size,
                total_kv_heads=total_kv_heads,
                # The lease budget is decided here over physical blocks (pd_lease_pins), so
                # PDScheduler's own per-lease count is off (0: no budget).
                max_lease_fraction=0.0,
                mamba_problem=mamba_problem,
                group_windows=_group_windows(kv_cache_config),
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            allow_amx()  # before this worker's first forward (see allow_amx)

            rank = int(get_tensor_model_parallel_rank()) if tp_size > 1 else 0
            port = handshake_port_of(
                self._cfg.handshake_port, rank, tp_size, int(parallel.data_parallel_index)
            )
            with unpinned():  # its read thread must not share the engine's pinned core
                self._worker = PDWorker(
                    PDWorkerSettings(
                        engine_id,
                        rank,
                        tp_size,
                        self._cfg.handshake_host,
                        port,
                        self._cfg.handshake_timeout_s,
                        self._cfg.read_timeout_s,
                        serve_handshake=ktc.is_kv_producer,
                        key=key,
                        kv_identity=kv_identity(vllm_config),
                        total_kv_heads=total_kv_heads,
                    ),
                    kv_cache_config,
                )

    # ----------------------------------------------------------------- scheduler
    @property
    def requires_kv_delivery(self) -> bool:
        return self._kv_transfer_config.is_kv_producer

    def on_new_request(self, request: "Request") -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._scheduler.build_connector_meta(scheduler_output)
        self._awaiting_reads.update(job.req_id for job in meta.reads if not job.release_only)
        self._pacer.after_step(self._only_waiting_on_leases(scheduler_output, meta))
        return meta

    def _only_waiting_on_leases(
        self, scheduler_output: "SchedulerOutput", meta: PDConnectorMetadata
    ) -> bool:
        """This step runs nothing and ships nothing, no READ of this engine is awaited, and
        leases or read-target pins are what keeps vLLM stepping: a step to pace (pd_idle)."""
        return (
            not scheduler_output.total_num_scheduled_tokens
            and not scheduler_output.finished_req_ids
            and not meta.reads
            and not meta.leases
            and not self._awaiting_reads
            and (len(self._lease_pins) > 0 or self.has_pending_push_work())
        )

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        if self._over_lease_budget(request, block_ids):
            # No block list: the scheduler hands nothing over and vLLM frees the blocks now.
            return self._scheduler.request_finished(request, tuple([] for _ in block_ids))
        delay_free, params = self._scheduler.request_finished(request, block_ids)
        if delay_free and self._block_pool is not None:
            # The connector holds the blocks, so vLLM frees the request now and an engine with
            # nothing else to run goes idle instead of stepping until the lease ends.
            self._lease_pins.hold(self._block_pool, request.request_id, block_ids)
            return False, params
        return delay_free, params

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._block_pool = kv_cache_manager.block_pool
        self._scheduler.bind_block_pool(kv_cache_manager.block_pool)

    def _over_lease_budget(self, request: "Request", block_ids: tuple[list[int], ...]) -> bool:
        """A hand-over whose lease would take the blocks leases hold past the budget (any API
        client can send do_remote_decode: unread leases must not hold the whole cache)."""
        from hybridkv.connector.pd_params import RemoteDecode

        assert self._scheduler is not None
        if not self._lease_budget or not isinstance(self._scheduler.params(request), RemoteDecode):
            return False
        in_use = self._lease_pins.physical_blocks
        if in_use + self._lease_pins.added_by(block_ids) <= self._lease_budget:
            return False
        self.leases_refused += 1
        logger.warning(
            "not handing %s over: unread leases hold %d of %d blocks (max_lease_fraction "
            "of the KV cache); its blocks are freed now and decode computes the prompt itself. Many "
            "do_remote_decode requests whose decode leg never comes, or a slow decode: raise "
            "max_lease_fraction or lower lease_s",
            request.request_id,
            in_use,
            self._lease_budget,
        )
        return True

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)
            self._awaiting_reads.difference_update(
                getattr(connector_output, "finished_recving", None) or ()
            )
            meta = connector_output.kv_connector_worker_meta
            if (
                isinstance(meta, PDLeaseWorkerMetadata)
                and meta.leases_ended
                and self._block_pool is not None
            ):
                freed = self._lease_pins.ended(self._block_pool, meta.leases_ended)
                if freed:  # the lease budget counts them no more
                    from vllm.v1.outputs import KVConnectorOutput

                    self._scheduler.update_connector_output(
                        KVConnectorOutput(finished_sending=set(freed))
                    )

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pins()

    def build_connector_worker_meta(self):  # noqa: ANN201 - vLLM's signature
        if self._worker is None:
            return None
        released, ended = self._worker.take_released(), self._leases_ended
        self._leases_ended = set()
        if not released and not ended:
            return None
        return PDLeaseWorkerMetadata({r: 1 for r in released}, {r: 1 for r in ended})

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        if self._scheduler is not None:
            self._scheduler.set_handshake(metadata)

    # -------------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        assert self._worker is not None
        # The NIXL/UCX and gRPC threads started here inherit this thread's CPU affinity;
        # pinned to the engine's busy core, the decode's handshake missed its 5 s timeout.
        with unpinned():
            self._worker.register_kv_caches(kv_caches)
        self._copy_views = block_copy_views(kv_caches, self._kv_cache_config.num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Called by the model runner after vLLM's own block copies and before the forward.
        super().bind_connector_metadata(connector_metadata)
        redo_block_copies(self._copy_views, getattr(connector_metadata, "block_copies", ()))

    def get_handshake_metadata(self):  # noqa: ANN201 - vLLM's signature
        return self._worker.handshake_metadata() if self._worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert self._worker is not None and isinstance(meta, PDConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # reads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(
        self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # decode pulls; prefill only keeps its blocks alive

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        results = self._worker.get_transfer_results()
        # Ended leases go to the scheduler in the worker metadata (pd_lease_pins): vLLM freed
        # those requests at their finish and knows them no more.
        self._leases_ended |= results.finished_sending or set()
        results.finished_sending = set()
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    # ------------------------------------------------------------------ metrics
    def get_kv_connector_stats(self) -> HybridPDStats | None:
        # Workers only (the scheduler side counts nothing): each TP rank its own reads and
        # leases, summed by vLLM over the ranks (pd_stats: reads is once per rank per request).
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HybridPDStats:
        return HybridPDStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # noqa: ANN001, ANN206
        return HybridPDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
