"""Request ``kv_transfer_params`` -> one typed, validated value: the only place they are read.

Why: the parameters come from the request body (vLLM accepts them on /v1/completions
and /v1/chat/completions), so any API client can send any JSON there. Read raw, a
string in ``remote_num_tokens`` would raise inside vLLM's ``schedule()`` and kill the
engine, and well-formed forged values would make decode READ any prefill block into its
cache. Here every field is checked (type, range, length against this prompt and this
instance's KV layout), the role is enforced, and, with a deployment secret, the
prefill side's MAC is verified against THIS prompt's block hashes, before the
scheduler acts on any of it. A bad set becomes a :class:`Refused` naming the field and
the fix; nothing here raises on input.

The same module writes what the prefill side issues (:func:`issue_remote_prefill`), so
the signed fields are listed once (:meth:`RemotePrefill.signed_fields`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.connector.pd_auth import PURPOSE_PARAMS, DeploymentKey
from hybridkv.connector.pd_tp import MAMBA_TP_NOT_ENABLED, MAX_TP, heterogeneous_tp_problem

MAX_ENGINE_ID_CHARS = 256
MAX_REQUEST_ID_CHARS = 1024
MAX_HOST_CHARS = 253
LEASE_ID_HEX_CHARS = 32
_HOST = re.compile(r"^[A-Za-z0-9._:\-\[\]]+$")
_HEX = re.compile(r"^[0-9a-f]+$")

_SAME_PARAMS = (
    "send the kv_transfer_params the prefill instance returned, unchanged, with the same prompt"
)


@dataclass(frozen=True)
class LocalLayout:
    """What this instance checks parameters against (its role and KV layout)."""

    can_prefill: bool  # kv_role kv_producer or kv_both
    can_decode: bool  # kv_role kv_consumer or kv_both
    group_block_sizes: tuple[int, ...]
    num_blocks: int
    hash_block_size: int
    # Tensor parallelism: this instance's size, its Mamba groups and the model's KV heads
    # decide which prefill TP sizes it can read from (pd_tp.heterogeneous_tp_problem).
    tp_size: int = 1
    mamba_group_ids: tuple[int, ...] = ()
    total_kv_heads: int = 0
    # Why this instance's Mamba state is not re-sliced across TP sizes (None: GDN state, which
    # pd_tp re-slices, enabled; the prefill side's split is then checked at the handshake).
    mamba_problem: str | None = MAMBA_TP_NOT_ENABLED


@dataclass(frozen=True)
class PromptView:
    """The request facts parameters are checked against."""

    num_prompt_tokens: int
    block_hashes: Sequence[bytes]  # vLLM's, at hash_block_size (cache_salt, LoRA, mm included)


@dataclass(frozen=True)
class Refused:
    """An invalid or unverifiable set: the request recomputes or fails, per policy."""

    field: str
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"kv_transfer_params.{self.field} {self.reason}: {self.fix}"


@dataclass(frozen=True)
class RemoteDecode:
    """Prefill side: compute the prompt and hand its KV to a decode instance."""


@dataclass(frozen=True)
class RemotePrefill:
    """Decode side: where the prompt's KV lies on the prefill side (validated)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[tuple[int, ...], ...]  # per group, by block position; 0 = null
    num_tokens: int
    lease_id: str
    ports: tuple[int, ...] = ()  # each prefill rank's handshake port on ``host`` (rank order)

    @property
    def rank_ports(self) -> tuple[int, ...]:
        return self.ports or (self.port,)

    def signed_fields(self, covered_hashes: Sequence[bytes]) -> list[Any]:
        """What the prefill side's MAC covers: every field decode acts on, and the
        prompt block hashes the KV belongs to (so it cannot be replayed for another prompt)."""
        return [
            self.engine_id,
            self.request_id,
            self.host,
            self.port,
            [list(g) for g in self.block_ids],
            self.num_tokens,
            self.lease_id,
            [bytes(h).hex() for h in covered_hashes],
            list(self.rank_ports),
        ]


ParsedParams = RemoteDecode | RemotePrefill | Refused | None


def covered_hashes(
    block_hashes: Sequence[bytes], num_tokens: int, hash_block_size: int
) -> Sequence[bytes] | None:
    """The prompt's block hashes covering its first ``num_tokens`` tokens (None: not that many)."""
    n = num_tokens // hash_block_size
    return block_hashes[:n] if n <= len(block_hashes) else None


def issue_remote_prefill(
    p: RemotePrefill,
    key: DeploymentKey | None,
    block_hashes: Sequence[bytes],
    hash_block_size: int,
    group_block_sizes: Sequence[int] = (),
) -> dict[str, Any]:
    """Prefill side: the wire form of ``p``, signed when there is a key.

    ``group_block_sizes`` (the prefill's block size per KV cache group) travels unsigned: decode
    compares it with its own first, so that a deployment whose two sides chose different block
    sizes is refused naming them; the MAC, computed over hashes at the prefill's block size,
    would otherwise be the first check to fail and name the secret."""
    out: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.engine_id,
        "remote_request_id": p.request_id,
        "remote_host": p.host,
        "remote_port": p.port,
        "remote_block_ids": [list(g) for g in p.block_ids],
        "remote_num_tokens": p.num_tokens,
        "remote_lease_id": p.lease_id,
        "remote_ports": list(p.rank_ports),
    }
    if group_block_sizes:
        out["remote_block_sizes"] = [int(b) for b in group_block_sizes]
    if key is not None:
        hashes = covered_hashes(block_hashes, p.num_tokens, hash_block_size)
        assert hashes is not None, "the prefill side signs only tokens it hashed"
        out["remote_mac"] = key.mac(PURPOSE_PARAMS, *p.signed_fields(hashes))
    return out


def _flag(raw: dict, name: str) -> bool | Refused:
    v = raw.get(name)
    if v is None or isinstance(v, bool):
        return bool(v)
    return Refused(name, f"is {type(v).__name__} {_short(v)}", "send true or false")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _int(raw: dict, name: str, lo: int, hi: int, what: str) -> int | Refused:
    v = raw.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        return Refused(name, f"is {type(v).__name__} {_short(v)}, not an integer", _SAME_PARAMS)
    if not lo <= v <= hi:
        return Refused(name, f"is {v}, outside [{lo}, {hi}] ({what})", _SAME_PARAMS)
    return v


def _str(
    raw: dict,
    name: str,
    max_chars: int,
    pattern: re.Pattern[str] | None = None,
    exact: int | None = None,
) -> str | Refused:
    v = raw.get(name)
    if not isinstance(v, str) or not v:
        return Refused(
            name, f"is {type(v).__name__} {_short(v)}, not a non-empty string", _SAME_PARAMS
        )
    if len(v) > max_chars or (exact is not None and len(v) != exact):
        return Refused(
            name,
            f"has {len(v)} characters (expected {exact or f'at most {max_chars}'})",
            _SAME_PARAMS,
        )
    if pattern is not None and not pattern.match(v):
        return Refused(name, f"{_short(v)} has characters outside {pattern.pattern}", _SAME_PARAMS)
    return v


def _sizes(sizes: Sequence[int]) -> str:
    """``block_size=N`` when every group has N, else the list."""
    return f"block_size={sizes[0]}" if len(set(sizes)) == 1 else f"block_size={list(sizes)}"


def _block_sizes(raw: dict, local: LocalLayout) -> Refused | None:
    """A refusal when the prefill's block sizes (sent unsigned, optional) are not this
    instance's: its block ids and hashes then mean other tokens here."""
    name = "remote_block_sizes"
    v = raw.get(name)
    if v is None:
        return None
    if (
        not isinstance(v, list)
        or len(v) > 64
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in v)
    ):
        return Refused(name, f"is {_short(v)}, not a list of block sizes", _SAME_PARAMS)
    if tuple(v) != tuple(local.group_block_sizes):
        return Refused(
            name,
            f"is {_short(v)}: the prefill's KV cache groups have {_sizes(v)}, this instance's "
            f"{_sizes(local.group_block_sizes)}",
            "serve prefill and decode with the same block sizes: the same model, --block-size, "
            "speculative config and, where vLLM aligns blocks to a Mamba state's page, TP size",
        )
    return None


def _block_ids(
    raw: dict, prompt: PromptView, local: LocalLayout
) -> tuple[tuple[int, ...], ...] | Refused:
    name = "remote_block_ids"
    groups = raw.get(name)
    n_groups = len(local.group_block_sizes)
    if not isinstance(groups, list):
        return Refused(
            name,
            f"is {type(groups).__name__} {_short(groups)}, not a list of lists (one per KV cache "
            "group)",
            _SAME_PARAMS,
        )
    if len(groups) != n_groups:
        return Refused(
            name,
            f"has {len(groups)} groups but this instance has {n_groups} KV cache groups",
            "serve the same model with the same config on prefill and decode",
        )
    seen: set[int] = set()
    out: list[tuple[int, ...]] = []
    for gid, (ids, bs) in enumerate(zip(groups, local.group_block_sizes)):
        where = f"{name}[{gid}]"
        if not isinstance(ids, list):
            return Refused(
                where, f"is {type(ids).__name__} {_short(ids)}, not a list", _SAME_PARAMS
            )
        most = math.ceil(prompt.num_prompt_tokens / bs)
        if len(ids) > most:
            return Refused(
                where,
                f"has {len(ids)} blocks but a {prompt.num_prompt_tokens}-token prompt has at most "
                f"{most} at this instance's group {gid} block_size={bs}",
                "start prefill and decode with the same model and --block-size; else "
                + _SAME_PARAMS,
            )
        for b in ids:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < local.num_blocks:
                return Refused(
                    where,
                    f"holds {_short(b)}, not a block id in [0, {local.num_blocks})",
                    "serve the same model with the same KV cache size on prefill and decode"
                    if isinstance(b, int) and not isinstance(b, bool) and b >= 0
                    else _SAME_PARAMS,
                )
            if b and b in seen:  # groups share one block pool: real ids never repeat (0 = null)
                return Refused(where, f"repeats block {b}", _SAME_PARAMS)
            seen.add(b)
        out.append(tuple(ids))
    return tuple(out)


def _ports(raw: dict, port: int | Refused, local: LocalLayout) -> tuple[int, ...] | Refused:
    """``remote_ports``: one handshake port per prefill rank; absent means one rank."""
    name = "remote_ports"
    if isinstance(port, Refused):
        return port
    ports = raw.get(name, [port])
    if not isinstance(ports, list) or not 1 <= len(ports) <= MAX_TP:
        return Refused(
            name,
            f"is {_short(ports)}, not a list of 1 to {MAX_TP} ports (one per prefill rank)",
            _SAME_PARAMS,
        )
    for v in ports:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
            return Refused(name, f"holds {_short(v)}, not a TCP port", _SAME_PARAMS)
    if ports[0] != port:
        return Refused(
            name, f"starts with {ports[0]} but remote_port is {port} (rank 0's port)", _SAME_PARAMS
        )
    problem = heterogeneous_tp_problem(
        len(ports), local.tp_size, local.mamba_group_ids, local.total_kv_heads, local.mamba_problem
    )
    if problem:
        return Refused(
            name,
            f"lists {len(ports)} prefill ranks: {problem}",
            "pair instances whose --tensor-parallel-size this model can be re-sliced between",
        )
    return tuple(ports)


def parse_kv_transfer_params(
    raw: object, prompt: PromptView, local: LocalLayout, key: DeploymentKey | None
) -> ParsedParams:
    """Validate a request's raw ``kv_transfer_params``. Never raises on input.

    None: nothing for this connector to do. :class:`RemoteDecode` / :class:`RemotePrefill`:
    act on it. :class:`Refused`: recompute (or fail, per ``kv_load_failure_policy``).
    Keys this connector does not use (e.g. vLLM's ``remote_prefill_cached_tokens``) are ignored.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        return Refused(
            "", f"is {type(raw).__name__}, not an object", "send a JSON object or leave it out"
        )
    decode = _flag(raw, "do_remote_decode")
    if isinstance(decode, Refused):
        return decode
    remote = _flag(raw, "do_remote_prefill")
    if isinstance(remote, Refused):
        return remote
    if decode and remote:
        return Refused(
            "do_remote_prefill",
            "and do_remote_decode are both true",
            "a request is either the prefill leg (do_remote_decode) or the decode leg",
        )
    if decode:
        if not local.can_prefill:
            return Refused(
                "do_remote_decode",
                "is true on an instance that is not a prefill instance",
                "send the prefill leg to an instance with kv_role kv_producer or kv_both",
            )
        return RemoteDecode()
    if not remote:
        return None
    if not local.can_decode:
        return Refused(
            "do_remote_prefill",
            "is true on an instance that is not a decode instance",
            "send the decode leg to an instance with kv_role kv_consumer or kv_both",
        )
    sizes = _block_sizes(raw, local)
    if sizes is not None:
        return sizes
    fields: dict[str, Any] = {
        "engine_id": _str(raw, "remote_engine_id", MAX_ENGINE_ID_CHARS),
        "request_id": _str(raw, "remote_request_id", MAX_REQUEST_ID_CHARS),
        "host": _str(raw, "remote_host", MAX_HOST_CHARS, _HOST),
        "port": _int(raw, "remote_port", 1, 65535, "a TCP port"),
        "num_tokens": _int(
            raw, "remote_num_tokens", 0, prompt.num_prompt_tokens, "this prompt's length"
        ),
        "lease_id": _str(
            raw, "remote_lease_id", LEASE_ID_HEX_CHARS, _HEX, exact=LEASE_ID_HEX_CHARS
        ),
        "block_ids": _block_ids(raw, prompt, local),
    }
    fields["ports"] = _ports(raw, fields["port"], local)
    for v in fields.values():
        if isinstance(v, Refused):
            return v
    p = RemotePrefill(**fields)
    hashes = covered_hashes(prompt.block_hashes, p.num_tokens, local.hash_block_size)
    if hashes is None:
        return Refused(
            "remote_num_tokens",
            f"is {p.num_tokens} but only {len(prompt.block_hashes)} blocks of "
            f"{local.hash_block_size} tokens of this prompt are hashed",
            _SAME_PARAMS,
        )
    if key is not None and not key.verify(
        raw.get("remote_mac"), PURPOSE_PARAMS, *p.signed_fields(hashes)
    ):
        return Refused(
            "remote_mac",
            "does not verify for this prompt and these fields (missing, altered, issued "
            "for another prompt, or signed with another secret)",
            f"{_SAME_PARAMS}; give prefill and decode the same auth_secret_file",
        )
    return p


__all__ = [
    "LocalLayout",
    "ParsedParams",
    "PromptView",
    "Refused",
    "RemoteDecode",
    "RemotePrefill",
    "covered_hashes",
    "issue_remote_prefill",
    "parse_kv_transfer_params",
]
