"""A prefill instance bounds the KV blocks unread P/D leases may hold.

Any API client can send ``do_remote_decode``; each finished request then keeps its blocks
for ``lease_s`` unless a decode leg reads or releases them. Without a bound, requests whose
decode leg never comes fill the prefill's KV cache. Drives PDScheduler directly with stand-in
requests (SimpleNamespace: the scheduler reads only these fields), as vLLM's scheduler calls it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridkv.connector.pd_connector import PDConnectorConfig
from hybridkv.connector.pd_metadata import PDHandshakeMetadata
from hybridkv.connector.pd_scheduler import PDScheduler
from hybridkv.connector.store_config import ConfigError

BLOCK = 128
NUM_BLOCKS = 40


def _scheduler(fraction: float) -> PDScheduler:
    s = PDScheduler(
        "prefill",
        False,
        60.0,
        (),
        BLOCK,
        can_decode=False,
        group_block_sizes=(BLOCK, BLOCK),
        num_blocks=NUM_BLOCKS,
        max_lease_fraction=fraction,
    )
    s.set_handshake({0: PDHandshakeMetadata(host="127.0.0.1", port=5000, tp_rank=0)})
    return s


def _finished(s: PDScheduler, rid: str, first_block: int, n_blocks: int):  # noqa: ANN202
    from vllm.v1.request import RequestStatus

    req = SimpleNamespace(
        request_id=rid,
        kv_transfer_params={"do_remote_decode": True},
        num_prompt_tokens=n_blocks * BLOCK + 1,
        num_computed_tokens=n_blocks * BLOCK,
        block_hashes=[bytes([i]) * 8 for i in range(n_blocks)],
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
    )
    ids = list(range(first_block, first_block + n_blocks))
    return s.request_finished(req, (ids, [b + 20 for b in ids]))  # two groups, distinct blocks


def test_unread_leases_hold_at_most_the_budget_then_requests_hand_nothing_over():
    s = _scheduler(0.5)  # 20 of 40 blocks
    held, params = _finished(s, "a", 1, 4)  # 8 blocks (4 per group)
    assert held and params["remote_ports"] == [5000]
    assert _finished(s, "b", 5, 4)[0]  # 16
    refused = _finished(s, "c", 9, 4)  # would be 24 > 20
    assert refused == (False, None) and s.leases_refused == 1
    # a's lease ends (read, released or expired: the worker reports it finished sending)
    s.update_connector_output(
        SimpleNamespace(finished_sending={"a"}, kv_connector_worker_meta=None)
    )
    assert _finished(s, "c", 9, 4)[0]  # 16 again: handed over
    assert s.leases_refused == 1


def test_control_without_a_budget_every_request_holds_its_blocks():
    s = _scheduler(1.0)  # planted: the whole cache (what it was before the bound)
    assert all(_finished(s, r, 1 + 4 * i, 4)[0] for i, r in enumerate("abcd"))  # 32 of 40
    assert s.leases_refused == 0


def test_the_fraction_is_validated():
    assert PDConnectorConfig.from_extra_config({}).max_lease_fraction == 0.5
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ConfigError, match="max_lease_fraction"):
            PDConnectorConfig.from_extra_config(
                {"max_lease_fraction": bad, "allow_unauthenticated": True}
            )
