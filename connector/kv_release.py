"""What hybridkv's worker-side connectors do when vLLM releases the KV cache's memory.

vLLM 0.34 gives back the KV cache's physical memory and later re-commits it at the same
addresses (sleep / wake-up, ``release_kv_cache_memory``, a process checkpoint, a weight
update that borrows the cache), calling the connector's ``unregister_kv_caches`` before and
``restore_kv_caches`` after. Only sleep asks ``supports_sleep_mode`` first (hybridkv answers
False there, so ``--enable-sleep-mode`` is refused at startup); the other paths do not ask.

P/D: the worker's NIXL registrations, and the agent metadata its handshake service gave
decode peers, name the released memory (a same-host peer's ``cuda_ipc`` mapping keeps the old
pages alive, so a READ there returns old bytes instead of failing), and the handshake carries
no generation by which a peer would learn to fetch it again. So the release stops the P/D
worker's transfers for the engine's life: the handshake service stops (no peer fetches
metadata or has a lease claim granted, so a READ a decode peer already posted is discarded
and recomputed there) and the NIXL agent is destroyed (its registrations go; this rank's own
READs then fail and recompute). ``restore_kv_caches`` re-enables nothing and logs so: P/D
hand-overs resume after an engine restart.

Store: a GPU KV cache is staged through host buffers registered with Mooncake, which the
release does not touch, and vLLM re-commits the cache at the same addresses, so only the
store's own load and save jobs matter: their gathers and scatters read and write the cache,
so the release waits for them (bounded) and says so when they did not end in time.
"""

from __future__ import annotations

from typing import Any

from hybridkv.store.logs import get_logger

logger = get_logger(__name__, "P/D")
store_logger = get_logger(__name__, "store")

# Longest wait for the store's jobs when vLLM releases the KV cache (a batch's deadline is
# at most a few seconds; this bounds a stuck store call).
STORE_DRAIN_S = 30.0


def release_pd_transfers(worker: Any) -> bool:
    """Stop the P/D worker's handshake service and destroy its NIXL agent (idempotent).

    True when this call stopped them; False when there was nothing left to stop."""
    if worker is None:
        return False
    server, transport = worker._server, worker._transport
    worker._server, worker._transport = None, None
    if server is None and transport is None:
        return False
    logger.error(
        "vLLM is releasing the KV cache's memory (sleep, release_kv_cache_memory, a "
        "checkpoint or a weight update): P/D transfers are off until the engine restarts, "
        "since peers hold registrations of the released memory; requests are recomputed"
    )
    if server is not None:
        server.stop()
    if transport is not None:
        transport.shutdown()
    return True


def restore_pd_transfers(worker: Any) -> None:
    """After vLLM re-committed the KV cache: P/D transfers stay off (see the module)."""
    if worker is not None:
        logger.error(
            "KV cache memory restored: P/D transfers stay off until the engine restarts "
            "(peers may hold registrations of the released memory)"
        )


def drain_store_jobs(worker: Any, timeout_s: float = STORE_DRAIN_S) -> bool:
    """Wait until the store worker runs no job that touches the KV cache (True), or log that
    some still run after ``timeout_s`` (False)."""
    if worker is None or worker.drain(timeout_s):
        return True
    store_logger.error(
        "vLLM is releasing the KV cache's memory while store loads or saves still run after "
        "%g s; a job that touches the cache after the release may fail or move stale bytes",
        timeout_s,
    )
    return False
