"""Hypothesis strategies: random hybrid geometries vLLM accepts."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.unit.harness import Geometry, fa, mamba, sw

# Every property runs at least 500 examples (CI included); examples build real
# vLLM managers, so per-example deadlines are off.
PROPERTY = settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def geometries(draw, allow_eagle: bool = True) -> Geometry:
    """1-3 full-attention groups at 16/32/64, 0-2 sliding-window groups,
    0-1 Mamba align group, EAGLE on/off, fine-grained on/off (with Mamba)."""
    n_fa = draw(st.integers(1, 3))
    n_sw = draw(st.integers(0, 2))
    n_mamba = draw(st.integers(0, 1))
    fine_grained = n_mamba == 1 and draw(st.booleans())
    specs = []
    mamba_bs = draw(st.sampled_from([32, 64])) if n_mamba else None
    # Without fine-grained hits the hash unit must divide every block size; with
    # Mamba it is the Mamba block (no sub-block hits) or 16 (fine-grained).
    floor = 16 if (not n_mamba or fine_grained) else mamba_bs
    sizes = [s for s in (16, 32, 64) if s >= floor]
    for i in range(n_fa):
        specs.append(fa(draw(st.sampled_from(sizes)), heads=i + 1))
    for i in range(n_sw):
        bs = draw(st.sampled_from(sizes))
        window = draw(st.sampled_from([24, 48, 64, 100, 128]))
        specs.append(sw(bs, window, heads=i + 1))
    if n_mamba:
        specs.append(mamba(mamba_bs))
    hash_block = 16 if fine_grained else (mamba_bs if n_mamba else min(s.block_size for s in specs))
    if not n_mamba:
        import math
        from functools import reduce

        hash_block = reduce(math.gcd, [s.block_size for s in specs])
    eagle_mode = draw(st.sampled_from(["off", "flagged", "all"] if allow_eagle else ["off"]))
    eagle_group = draw(st.integers(0, n_fa - 1)) if eagle_mode == "flagged" else None
    geo = Geometry(
        specs=specs,
        hash_block_size=hash_block,
        eagle_group=eagle_group,
        use_eagle=eagle_mode != "off",
        num_blocks=draw(st.sampled_from([60, 120, 400])) * len(specs),
        label=f"fa={n_fa} sw={n_sw} mamba={n_mamba} fg={fine_grained} eagle={eagle_mode}",
    )
    return geo


@st.composite
def token_workloads(draw, vocab: int = 50):
    """A shared trunk plus branches; queries resend, extend or cut them."""
    trunk_len = draw(st.integers(64, 600))
    trunk = draw(st.lists(st.integers(0, vocab), min_size=trunk_len, max_size=trunk_len))
    prompts = []
    for _ in range(draw(st.integers(1, 3))):
        cut = draw(st.integers(trunk_len // 2, trunk_len))
        tail_len = draw(st.integers(1, 300))
        tail = draw(st.lists(st.integers(0, vocab), min_size=tail_len, max_size=tail_len))
        prompts.append(trunk[:cut] + tail)
    queries = []
    for _ in range(draw(st.integers(1, 4))):
        base = draw(st.sampled_from(prompts))
        kind = draw(st.sampled_from(["resend", "extend", "cut"]))
        if kind == "resend":
            queries.append(list(base))
        elif kind == "extend":
            extra = draw(st.lists(st.integers(0, vocab), min_size=1, max_size=120))
            queries.append(base + extra)
        else:
            cut = draw(st.integers(1, len(base)))
            queries.append(base[:cut] + [vocab + 1])
    return prompts, queries
