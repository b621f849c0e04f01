"""How a stored KV object is named.

``hkv2/<model>/<layout>/g<group>/<rank>/<block hash hex>``

* ``hkv2`` -- the key-scheme version. Bump it whenever the bytes stored under a
  key change meaning (layout, dtype packing); old objects then simply miss.
* ``<model>`` -- model identity: a short fingerprint of the model name and
  revision given by the operator plus the dtype. Two deployments share objects
  only if they serve the same weights.
* ``<layout>`` -- a fingerprint of the group geometry (spec kind, block size,
  per-token bytes of every group). A group id only means something within one
  layout, so two layouts never read each other's objects.
* ``g<group>`` -- the KV cache group id.
* ``<rank>`` -- the parallel rank layout: ``tp<size>.<rank>-pp<size>.<rank>``
  (each rank stores its own shard).
* the block hash -- vLLM's chained block hash of the hash unit ending where
  the object's valid KV ends (it already includes ``cache_salt`` and LoRA).

An object is the block's bytes followed by a 16-byte trailer (``object_trailer``:
magic, format version, tag kind, XXH3-64 seeded with the key), so a wrong object
never loads silently; an object in an older trailer format reads as a format
mismatch (recomputed), so the trailer can change without bumping the key scheme.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

KEY_SCHEME_VERSION = "hkv2"


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class KeySchema:
    """Builds store keys for one model, layout and rank."""

    model_id: str
    layout_id: str
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    @classmethod
    def create(
        cls,
        model_name: str,
        dtype: str,
        layout_rows: list[dict],
        tp_size: int = 1,
        tp_rank: int = 0,
        pp_size: int = 1,
        pp_rank: int = 0,
    ) -> "KeySchema":
        """Fingerprint the model and layout so keys stay short and fixed-size."""
        layout = ";".join(
            ",".join(f"{k}={row[k]}" for k in sorted(row)) for row in layout_rows
        )
        return cls(
            model_id=_fingerprint(f"{model_name}|{dtype}"),
            layout_id=_fingerprint(layout),
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
        )

    @property
    def prefix(self) -> str:
        return f"{KEY_SCHEME_VERSION}/{self.model_id}/{self.layout_id}"

    @property
    def rank_part(self) -> str:
        return f"tp{self.tp_size}.{self.tp_rank}-pp{self.pp_size}.{self.pp_rank}"

    def __post_init__(self) -> None:
        # Lookups build tens of thousands of keys per request: format the prefix once per group.
        object.__setattr__(self, "_group_prefixes", {})

    def key(self, group_id: int, block_hash: bytes) -> str:
        prefix = self._group_prefixes.get(group_id)
        if prefix is None:
            prefix = self._group_prefixes[group_id] = f"{self.prefix}/g{group_id}/{self.rank_part}/"
        return prefix + block_hash.hex()

    def for_rank(self, tp_rank: int, pp_rank: int = 0) -> "KeySchema":
        """The same schema seen from another rank (the scheduler probes rank 0)."""
        return KeySchema(
            self.model_id, self.layout_id, self.tp_size, tp_rank, self.pp_size, pp_rank
        )
