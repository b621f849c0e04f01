"""What hybridkv's connector classes declare to vLLM about themselves (class-level hooks).

Each connector class mixes in one of these before ``KVConnectorBase_V1``. The
answers and the reasons for them live here; whether vLLM asks at all (and with
which enum) is :mod:`hybridkv.store.vllm_compat`'s concern.

* ``kv_cache_access`` (vLLM 0.34's growable KV cache): the P/D connector
  registers the KV cache with NIXL (UCX) and same-host peers READ it through
  ``cuda_ipc``, as vLLM's own NixlConnector does: ``REGISTERS | EXPORTS_FABRIC``
  (one physical chunk per segment, fabric handles). The store connector
  registers the KV cache (CPU) or its staging buffers with Mooncake:
  ``REGISTERS``. Both answers are the same for every role and device: vLLM asks
  the class before any instance exists.
* ``unregister_kv_caches`` / ``restore_kv_caches`` (0.33/0.34; called on every
  release of the KV cache's memory, not only sleep): P/D stops its transfers for
  the engine's life; the store waits for its jobs that read or write the KV
  cache and needs nothing on restore (``connector/kv_release.py`` says why).
* ``supports_sleep_mode``: False. Sleep/wake, discard and the KV memory release
  re-commit the KV cache's physical memory; hybridkv's workers registered the
  old memory with NIXL / Mooncake and the P/D handshake has already advertised
  it to decode peers, which READ by those registrations. Until the workers
  re-register and the handshake generation changes on restore, the honest
  answer is False: vLLM then refuses ``--enable-sleep-mode`` at startup naming
  the connector, instead of transferring from released memory.
* ``supports_lookahead_block_hashes`` (0.34; MultiConnector: only if every child
  does, so a declining child turns them off for its siblings too). Store: True.
  Its keys are the scheduler's own block hashes (a lookahead hash also hashes
  the token after the block, so it never equals a legacy one and a legacy
  engine's objects never hit), it saves and looks up only blocks whose hash
  exists, and its mirror's coordinator is built with the scheduler's lookahead
  count and EAGLE setting (``store/geometry.py``). P/D: True. A prefill that
  computes its whole prompt samples a token, and the lookahead hash of a prompt
  block ending within the lookahead of the prompt's end covers that token, which
  decode (holding the prompt only) cannot hash: such a prefill signs and hands
  over only ``vllm_compat.prompt_hashed_tokens`` tokens, whose hashes decode
  computes identically. A prefill that cuts its prompt (sliding window, Mamba)
  hashed it before the cut, over prompt tokens only, and hands over as before
  (its Mamba state is h(cut), so the bound must not move).
* ``may_load_async`` (vLLM 0.34, asked when a request enters the waiting
  queues, before any lookup): vLLM's default for both, ``do_remote_prefill`` in
  the request's ``kv_transfer_params``. A store hit is unknown until the
  lookup, and a false positive holds other async loads back, so store loads
  start when a running slot is free, as without ``--max-num-inflight-kv-loads``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridkv.connector import kv_release
from hybridkv.store import vllm_compat

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig


class _Declarations:
    _KV_CACHE_ACCESS: tuple[str, ...] = ()

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: "KVTransferConfig") -> Any:
        return vllm_compat.kv_cache_access_flags(*cls._KV_CACHE_ACCESS)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: "KVTransferConfig") -> bool:
        return False

    _LOOKAHEAD_BLOCK_HASHES: bool = False

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: "KVTransferConfig") -> bool:
        return cls._LOOKAHEAD_BLOCK_HASHES


class PDConnectorHooks(_Declarations):
    """``HybridPDConnector``'s declarations (see the module docstring)."""

    _KV_CACHE_ACCESS = ("REGISTERS", "EXPORTS_FABRIC")
    _LOOKAHEAD_BLOCK_HASHES = True
    _worker: Any

    def unregister_kv_caches(self) -> None:
        """vLLM releases the KV cache's memory: P/D transfers stop (``connector/kv_release``)."""
        kv_release.release_pd_transfers(getattr(self, "_worker", None))

    def restore_kv_caches(self) -> None:
        kv_release.restore_pd_transfers(getattr(self, "_worker", None))


class StoreConnectorHooks(_Declarations):
    """``HybridStoreConnector``'s declarations (see the module docstring)."""

    _KV_CACHE_ACCESS = ("REGISTERS",)
    _LOOKAHEAD_BLOCK_HASHES = True
    _worker: Any

    def unregister_kv_caches(self) -> None:
        """vLLM releases the KV cache's memory: wait for the store's jobs that touch it."""
        kv_release.drain_store_jobs(getattr(self, "_worker", None))
