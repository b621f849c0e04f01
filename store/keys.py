"""How a stored KV object is named.

``hkv2/<model>/<layout>/g<group>/<rank>/<block hash hex>``

* ``hkv2`` -- the key-scheme version. Bump it whenever the bytes stored under a
  key change meaning (layout, dtype packing); old objects then simply miss.
* ``<model>`` -- KV identity: a fingerprint of everything outside the group
  geometry that changes the stored bytes or what they mean (:func:`kv_identity`:
  model and weights path, revision and code revision, quantization and its config
  -- where a checkpoint's k/v scales come from --, the model dtype, the KV cache
  dtype as the operator named it -- fp8, fp8_e4m3 and fp8_e5m2 all store uint8
  pages of one size --, the skip-layers list, Mamba state dtypes, hf_overrides and
  the resolved rope / rotary parameters that shape K). Two deployments share
  objects only if all of it agrees.
* ``<layout>`` -- a fingerprint of the group geometry (spec kind, block size,
  page bytes, layer count, dtype, window of every group, and vLLM's resolved
  ``kv_cache_layout``: LBHNC and LBNHC order the same bytes differently). A group id only means something within one
  layout, so two layouts never read each other's objects.
* ``g<group>`` -- the KV cache group id.
* ``<rank>`` -- the parallel rank layout: ``tp<size>.<rank>-pp<size>.<rank>``
  (each rank stores its own shard).
* the block hash -- vLLM's chained block hash of the hash unit ending where
  the object's valid KV ends (it already includes ``cache_salt`` and LoRA),
  all of it. Shorter keys (16 hash bytes) would save about a tenth of an existence
  query and collide wherever hashes are not digests (tests/unit/test_store_overlap.py
  pads a counter to 32 bytes: its 18 blocks would share one key), so keys keep the
  whole hash.

An object is the block's bytes followed by a 16-byte trailer (``object_trailer``:
magic, format version, tag kind, XXH3-64 seeded with the key), so a wrong object
never loads silently; an object in an older trailer format reads as a format
mismatch (recomputed), so the trailer can change without bumping the key scheme.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

KEY_SCHEME_VERSION = "hkv2"


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _canonical(value: Any) -> str:
    """A process-independent text for a config value (a callable by name, never by address)."""
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))


# hf_text_config entries that shape K through the rotary embedding (rope_scaling, rope_theta,
# rope_parameters, partial_rotary_factor, ...) or its range.
_ROPE_MARKERS = ("rope", "rotary")
_ROPE_EXTRA = ("max_position_embeddings",)


def _rope_fields(hf_text_config: Any) -> dict[str, Any]:
    if hf_text_config is None:
        return {}
    items = (
        hf_text_config.to_dict().items()
        if hasattr(hf_text_config, "to_dict")
        else vars(hf_text_config).items()
    )
    return {k: v for k, v in items if k in _ROPE_EXTRA or any(m in k for m in _ROPE_MARKERS)}


def kv_identity(vllm_config: "VllmConfig") -> dict[str, str]:
    """Every config field, outside the group geometry, that changes the KV bytes or their meaning.

    Read from values every engine process has identically (the scheduler and each
    worker build the same keys), never from addresses or timings. The geometry
    (block and page sizes, layer counts, spec dtype, ``kv_cache_layout``) is in
    the layout rows instead. k/v scales: vLLM takes them from the checkpoint, and
    how they are applied (per tensor or per head) from its quantization config's
    ``kv_cache_scheme``, so that config is part of the identity; the scale VALUES of
    a checkpoint rewritten in place under the same path and revision are not
    detectable here (no weight hashing at startup): give such a checkpoint a new
    revision or path.
    """
    m = vllm_config.model_config
    c = vllm_config.cache_config
    fields = {
        "model": m.model,
        "model_weights": m.model_weights,
        "revision": m.revision,
        "code_revision": m.code_revision,
        "quantization": m.quantization,
        "quantization_config": m.quantization_config,
        # The checkpoint's own (kv_cache_scheme: per-tensor or per-head k/v scales; what
        # --kv-cache-dtype auto resolves to).
        "checkpoint_quantization_config": getattr(
            getattr(m, "hf_config", None), "quantization_config", None
        ),
        "dtype": m.dtype,
        "hf_overrides": m.hf_overrides,
        "rope": _rope_fields(getattr(m, "hf_text_config", None)),
        "kv_cache_dtype": c.cache_dtype,
        "kv_cache_dtype_skip_layers": sorted(c.kv_cache_dtype_skip_layers),
        "mamba_cache_dtype": c.mamba_cache_dtype,
        "mamba_ssm_cache_dtype": c.mamba_ssm_cache_dtype,
    }
    return {k: _canonical(v) for k, v in fields.items()}


@dataclass(frozen=True)
class KeySchema:
    """Builds store keys for one model, layout and rank."""

    model_id: str
    layout_id: str
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    # Bumped by each connector reset of this engine (``reset_prefix_cache(reset_connector=True)``):
    # keys of earlier generations are never looked up again, so KV computed before the reset
    # (old weights) is never loaded after it. Engines that reset equally often share keys.
    generation: int = 0

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
        identity: Mapping[str, str] | None = None,
    ) -> "KeySchema":
        """Fingerprint the model and layout so keys stay short and fixed-size.

        ``identity`` is :func:`kv_identity` of the engine (left out: name and dtype only,
        for tools and benches that have no VllmConfig)."""
        layout = ";".join(",".join(f"{k}={row[k]}" for k in sorted(row)) for row in layout_rows)
        ident = "" if not identity else "|" + _canonical(dict(identity))
        return cls(
            model_id=_fingerprint(f"{model_name}|{dtype}{ident}"),
            layout_id=_fingerprint(layout),
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
        )

    @property
    def prefix(self) -> str:
        reset = f"/r{self.generation}" if self.generation else ""
        return f"{KEY_SCHEME_VERSION}/{self.model_id}/{self.layout_id}{reset}"

    @property
    def rank_part(self) -> str:
        return f"tp{self.tp_size}.{self.tp_rank}-pp{self.pp_size}.{self.pp_rank}"

    def __post_init__(self) -> None:
        # Lookups build tens of thousands of keys per request: format the prefix once per group.
        object.__setattr__(self, "_group_prefixes", {})

    def group_prefix(self, group_id: int) -> str:
        """Everything of a key before the block hash (formatted once per group)."""
        prefix = self._group_prefixes.get(group_id)
        if prefix is None:
            prefix = self._group_prefixes[group_id] = f"{self.prefix}/g{group_id}/{self.rank_part}/"
        return prefix

    def key(self, group_id: int, block_hash: bytes) -> str:
        return self.group_prefix(group_id) + block_hash.hex()

    def names(self, group_id: int, block_hashes: Sequence[bytes]) -> list[str]:
        """``key(group_id, h)`` for every ``h``: one group's keys in bulk (lookups name
        thousands at once)."""
        prefix = self.group_prefix(group_id)
        return [prefix + h.hex() for h in block_hashes]

    def for_rank(self, tp_rank: int, pp_rank: int = 0) -> "KeySchema":
        """The same schema seen from another rank (the scheduler probes rank 0)."""
        return dataclasses.replace(self, tp_rank=tp_rank, pp_rank=pp_rank)

    def at_generation(self, generation: int) -> "KeySchema":
        """The same schema after ``generation`` connector resets."""
        return (
            self
            if generation == self.generation
            else dataclasses.replace(self, generation=generation)
        )
