"""P/D across TP sizes for GDN (Qwen3-Next) state: the spans of ``pd_tp.mamba_slices``
move exactly the bytes vLLM's own split puts on each rank.

Shapes and dtypes are vLLM's (``MambaStateShapeCalculator.gated_delta_net_state_shape`` /
``gated_delta_net_state_dtype``) for the tiny qwen3-next CI runs (cli/harness/tiny_models), at TP1
and TP2; the caches are allocated by vLLM's ``allocate_kv_cache`` and unpacked into conv /
SSM views by vLLM's ``MambaBase.bind_kv_cache``. The TP2 ranks' states are filled from the
TP1 state by vLLM's weight-loading split, not by this test's idea of it: the conv
channels each rank holds are what ``mamba_v2_sharded_weight_loader`` (with the GDN layer's
q/k/v shard spec) loads into rank r's conv1d weight from a weight whose rows are their
own channel index, and the SSM heads what ``sharded_weight_loader(0)`` (A_log, dt_bias:
per v head) loads on rank r. The spans go through ``pd_transport.read_descriptors`` (the
rows a NIXL READ gets) and are applied with memmove; the decode side's states must then
equal the expected ones bit for bit and every other byte (other blocks, page padding)
stay poison.

Planted faults, each failing the byte check: the two prefill ranks swapped, the q and k
parts of the conv state swapped, the SSM span one head off.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.model_loader import weight_utils
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec
from vllm.v1.worker.utils import allocate_kv_cache

from hybridkv.cli.harness.tiny_models import _qwen3next_config
from hybridkv.connector.block_layout import KVLayout, layout_rows
from hybridkv.connector.pd_handshake import LayoutDescriptor, find_mismatches
from hybridkv.connector.pd_tp import (
    StateSplit,
    gdn_state_splits,
    mamba_slices,
    spec_state_splits,
    state_split_problem,
)
from hybridkv.connector.pd_transport import read_descriptors
from hybridkv.connector.pd_worker import group_state_splits, mamba_reslice_problem
from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups

CFG = _qwen3next_config()
NK, NV = CFG["linear_num_key_heads"], CFG["linear_num_value_heads"]
HK, HV = CFG["linear_key_head_dim"], CFG["linear_value_head_dim"]
KERNEL = CFG["linear_conv_kernel_dim"]
KEY_DIM, VALUE_DIM = NK * HK, NV * HV
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
LAYERS = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
NUM_BLOCKS = 8
POISON = 0xA5
REMOTE_IDS = [[3, 5]]
LOCAL_IDS = [[6, 1]]


def _dtypes(dtypes: tuple[torch.dtype, str]) -> tuple[torch.dtype, torch.dtype]:
    """(model dtype, mamba_ssm_cache_dtype) -> vLLM's (conv, ssm) state dtypes."""
    return MambaStateDtypeCalculator.gated_delta_net_state_dtype(dtypes[0], "auto", dtypes[1])


def _shapes(tp: int):
    return MambaStateShapeCalculator.gated_delta_net_state_shape(tp, NK, NV, HK, HV, KERNEL)


class Rank:
    """One rank's GDN cache: 2 layers, ``NUM_BLOCKS`` pages (padded like vLLM pads them up to
    the attention page: 256 tokens x 2 x kv_heads/tp x 64 x 2 bytes)."""

    def __init__(self, tp: int, model_dtype: tuple[torch.dtype, str]) -> None:
        self.tp = tp
        cfg = VllmConfig()
        cfg.cache_config.kv_cache_layout = "LBHNC"
        self.state_shapes = _shapes(tp)
        self.state_dtypes = _dtypes(model_dtype)
        page = 256 * 2 * (CFG["num_key_value_heads"] // tp) * CFG["head_dim"] * 2
        self.spec = MambaSpec(
            block_size=256,
            shapes=tuple(self.state_shapes),
            dtypes=self.state_dtypes,
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
            mamba_cache_mode="align",
            page_size_padded=page,
        )
        assert self.spec.page_size_bytes == page > self.spec.state_content_size_bytes
        group = KVCacheGroupSpec(list(LAYERS), self.spec)
        self.group = group
        self.config = get_kv_cache_config_from_groups(cfg, [group], NUM_BLOCKS * page * len(LAYERS))
        self.caches = allocate_kv_cache(
            self.config, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout()
        )
        self.layout = KVLayout.from_kv_caches(self.config, self.caches)
        first = next(iter(self.caches.values()))
        self.raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
        self.raw.fill_(POISON)
        # vLLM's own unpacking of the int8 page into (conv, ssm) views
        layer = SimpleNamespace(
            get_state_shape=lambda: self.state_shapes, get_state_dtype=lambda: self.state_dtypes
        )
        self.states = {}
        for name in LAYERS:
            MambaBase.bind_kv_cache(layer, self.caches[name])
            self.states[name] = layer.kv_cache

    def splits(self) -> tuple[StateSplit, ...]:
        return spec_state_splits(
            str(self.spec.mamba_type),
            self.spec.shapes,
            [get_dtype_size(d) for d in self.spec.dtypes],
            mamba_utils.is_conv_state_dim_first(),
        )

    def descriptor(self) -> LayoutDescriptor:
        return LayoutDescriptor.from_kv(
            self.layout,
            layout_rows(self.config),
            self.tp,
            kv_heads=[0],
            total_kv_heads=CFG["num_key_value_heads"],
            state_splits=[self.splits()],
        )


def _conv_channels(tp: int, rank: int) -> torch.Tensor:
    """The global conv channels rank ``rank`` holds: vLLM's conv1d weight loader for GDN
    (qwen_gdn_linear_attn.py: q, k with key_dim, v with value_dim) applied to a weight whose
    row i is i."""
    param = torch.full((CONV_DIM // tp, 1, KERNEL), -1.0)
    loader = mamba_v2_sharded_weight_loader(
        [(KEY_DIM, 0, False), (KEY_DIM, 0, False), (VALUE_DIM, 0, False)], tp, rank
    )
    loader(
        param,
        torch.arange(CONV_DIM, dtype=torch.float32)[:, None, None]
        .expand(CONV_DIM, 1, KERNEL)
        .clone(),
    )
    assert bool((param >= 0).all())
    return param[:, 0, 0].long()


def _v_heads(tp: int, rank: int, monkeypatch) -> torch.Tensor:
    """The v heads rank ``rank`` holds: ``sharded_weight_loader(0)`` (A_log / dt_bias, one
    value per v head), as vLLM loads it on that rank."""
    monkeypatch.setattr(weight_utils, "get_tensor_model_parallel_rank", lambda: rank)
    param = torch.full((NV // tp,), -1.0)
    weight_utils.sharded_weight_loader(0)(param, torch.arange(NV, dtype=torch.float32))
    return param.long()


def _conv_view(state: torch.Tensor) -> torch.Tensor:
    """The conv state as (block, channels, state_len) whatever vLLM's layout (SD stores
    (state_len, channels); the kernels use the transpose, as GatedDeltaNet does)."""
    return state if mamba_utils.is_conv_state_dim_first() else state.transpose(-1, -2)


def _split_from_full(full: Rank, tp: int, monkeypatch, model_dtype) -> list[Rank]:
    ranks = [Rank(tp, model_dtype) for _ in range(tp)]
    for r, rank in enumerate(ranks):
        ch, heads = _conv_channels(tp, r), _v_heads(tp, r, monkeypatch)
        for name in LAYERS:
            (fc, fs), (rc, rs) = full.states[name], rank.states[name]
            _conv_view(rc).copy_(_conv_view(fc)[:, ch])
            rs.copy_(fs[:, heads])
    return ranks


def _fill_random(rank: Rank, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name in LAYERS:
        for s in rank.states[name]:
            # random bit patterns, compared as raw bytes (random bits hold NaNs)
            s.view(torch.uint8).copy_(
                torch.randint(0, 256, s.view(torch.uint8).shape, dtype=torch.uint8, generator=gen)
            )


def _read(local: Rank, remote: Rank, remote_rank: int, spans) -> None:
    """What a NIXL READ of these descriptor rows does, done with memmove here."""
    slices = [[spans] * len(LAYERS)]
    l_rows, r_rows = read_descriptors(
        local.layout.groups, remote.layout.groups, REMOTE_IDS, LOCAL_IDS, slices=slices
    )
    for (la, n, _), (ra, n2, _) in zip(l_rows.tolist(), r_rows.tolist(), strict=True):
        assert n == n2
        ctypes.memmove(int(la), int(ra), int(n))


def _equal_states(local: Rank, want: Rank) -> bool:
    """Moved blocks hold ``want``'s states at the remote ids, bit for bit; every other
    byte of ``local`` (other blocks, page padding) is poison."""
    touched = torch.zeros_like(local.raw, dtype=torch.bool)
    for name in LAYERS:
        for got, exp in zip(local.states[name], want.states[name], strict=True):
            for r, l_ in zip(REMOTE_IDS[0], LOCAL_IDS[0], strict=True):
                if not torch.equal(
                    got[l_].contiguous().view(torch.uint8), exp[r].contiguous().view(torch.uint8)
                ):
                    return False
                b = got[l_].view(torch.uint8)
                start = b.data_ptr() - local.raw.data_ptr()
                touched[start : start + b.numel()] = True
    return bool((local.raw[~touched] == POISON).all())


def _spans(local: Rank, remote: Rank, local_rank: int, remote_rank: int, remote_splits=None):
    return mamba_slices(
        local.splits(),
        remote_splits or remote.splits(),
        local.tp,
        remote.tp,
        local_rank,
        remote_rank,
    )


def _swap_qk(spans, rows: int):
    """Planted: per conv row, the q span reads the peer's k bytes and the k span its q bytes."""
    out = list(spans)
    for i in range(rows):
        q, k = out[3 * i], out[3 * i + 1]
        out[3 * i], out[3 * i + 1] = (q[0], k[1], q[2]), (k[0], q[1], k[2])
    return out


@pytest.fixture(params=["SD", "DS"])
def layout(request, monkeypatch):
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", request.param)
    mamba_utils.get_conv_state_layout.cache_clear()  # vLLM reads the env once per process
    assert mamba_utils.is_conv_state_dim_first() == (request.param == "DS")
    yield request.param
    monkeypatch.undo()
    mamba_utils.get_conv_state_layout.cache_clear()


# The CPU platform resets mamba_ssm_cache_dtype to float32 on AVX512-BF16 hosts
# (vllm/platforms/cpu.py, "Reset SSM cache type to float32"): bf16 conv + fp32 SSM is what
# the e2e engines run; bf16/bf16 and fp32/fp32 are the other layouts a peer may have.
@pytest.fixture(
    params=[(torch.bfloat16, "float32"), (torch.bfloat16, "auto"), (torch.float32, "auto")],
    ids=["bf16-ssm32", "bf16", "fp32"],
)
def model_dtype(request):
    return request.param


def test_splits_are_what_vllm_shards(layout, model_dtype, monkeypatch):
    full, half = Rank(1, model_dtype), Rank(2, model_dtype)
    conv, ssm = half.splits()
    cs, ss = (get_dtype_size(d) for d in _dtypes(model_dtype))
    # rank 1's conv channels per vLLM's loader: its half of q, of k, of v, in that order
    ch = _conv_channels(2, 1).tolist()
    kd = KEY_DIM // 2
    assert ch == (
        list(range(kd, 2 * kd))
        + list(range(KEY_DIM + kd, KEY_DIM + 2 * kd))
        + list(range(2 * KEY_DIM + VALUE_DIM // 2, CONV_DIM))
    )
    assert conv.parts == (kd, kd, VALUE_DIM // 2)
    assert (conv.rows, conv.unit) == (
        (1, (KERNEL - 1) * cs) if layout == "DS" else (KERNEL - 1, cs)
    )
    assert ssm == StateSplit(conv.nbytes, 1, HV * HK * ss, (NV // 2,))
    assert _v_heads(2, 1, monkeypatch).tolist() == [2, 3]
    assert full.splits()[0].parts == (KEY_DIM, KEY_DIM, VALUE_DIM)
    assert group_state_splits(half.group) == half.splits()  # what the worker sends in the handshake
    assert mamba_reslice_problem(half.config) is None
    mamba2 = KVCacheGroupSpec(
        list(LAYERS), replace(half.spec, mamba_type=MambaAttentionBackendEnum.MAMBA2)
    )
    assert group_state_splits(mamba2) == ()
    assert "group 0: mamba_type 'mamba2': only 'gdn_attn'" in mamba_reslice_problem(
        replace(half.config, kv_cache_groups=[mamba2])
    )


def test_prefill_tp2_to_decode_tp1_assembles_the_state_exactly(layout, model_dtype, monkeypatch):
    full = Rank(1, model_dtype)
    _fill_random(full, 11)
    ranks = _split_from_full(full, 2, monkeypatch, model_dtype)
    decode = Rank(1, model_dtype)
    for p, rank in enumerate(ranks):
        _read(decode, rank, p, _spans(decode, rank, 0, p))
    assert _equal_states(decode, full)
    conv_rows = decode.splits()[0].rows
    # same-TP spans cover each state whole (one span when adjacent): the content, not the padding
    assert mamba_slices(full.splits(), full.splits(), 1, 1, 0, 0) == [
        (0, 0, full.spec.state_content_size_bytes)
    ]
    # planted: ranks swapped
    swapped = Rank(1, model_dtype)
    for p, rank in enumerate(reversed(ranks)):
        _read(swapped, rank, p, _spans(swapped, rank, 0, p))
    assert not _equal_states(swapped, full)
    # planted: q and k parts of the conv state swapped
    qk = Rank(1, model_dtype)
    for p, rank in enumerate(ranks):
        _read(qk, rank, p, _swap_qk(_spans(qk, rank, 0, p), conv_rows))
    assert not _equal_states(qk, full)
    # planted: the SSM span one head off on the peer (a whole rank's heads: it runs past the
    # peer's state, which read_descriptors refuses before any byte moves)
    off = Rank(1, model_dtype)
    conv, ssm = ranks[1].splits()
    shifted = (conv, StateSplit(ssm.offset + ssm.unit, ssm.rows, ssm.unit, ssm.parts))
    with pytest.raises(ValueError, match="outside"):
        _read(off, ranks[1], 1, _spans(off, ranks[1], 0, 1, remote_splits=shifted))


@pytest.mark.parametrize("rank", [0, 1])
def test_prefill_tp1_to_decode_tp2_takes_this_ranks_share(layout, model_dtype, monkeypatch, rank):
    full = Rank(1, model_dtype)
    _fill_random(full, 12)
    want = _split_from_full(full, 2, monkeypatch, model_dtype)
    decode = Rank(2, model_dtype)
    _read(decode, full, 0, _spans(decode, full, rank, 0))
    assert _equal_states(decode, want[rank])
    other = Rank(2, model_dtype)  # planted: the other rank's share
    _read(other, full, 0, _spans(other, full, 1 - rank, 0))
    assert not _equal_states(other, want[rank])
    qk = Rank(2, model_dtype)
    _read(qk, full, 0, _swap_qk(_spans(qk, full, rank, 0), decode.splits()[0].rows))
    assert not _equal_states(qk, want[rank])
    # planted: the SSM span one head off on the peer (rank 0: heads 1-2 instead of 0-1;
    # rank 1: one head back)
    unit = full.splits()[1].unit
    spans = _spans(decode, full, rank, 0)
    lo, ro, n = spans[-1]  # the SSM span (not adjacent to the conv's v span on the peer)
    assert (lo, ro, n) == (
        decode.splits()[1].offset,
        full.splits()[1].offset + rank * n,
        n,
    ) and n == 2 * unit
    off = Rank(2, model_dtype)
    _read(off, full, 0, spans[:-1] + [(lo, ro + (unit if rank == 0 else -unit), n)])
    assert not _equal_states(off, want[rank])


def test_handshake_accepts_gdn_across_sizes_and_names_what_it_refuses(monkeypatch):
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    mamba_utils.get_conv_state_layout.cache_clear()
    bf = (torch.bfloat16, "float32")
    p2, d1 = Rank(2, bf).descriptor(), Rank(1, bf).descriptor()
    assert find_mismatches(p2, d1) == []
    assert find_mismatches(d1, p2) == []
    # one side in DS conv layout: another byte order, refused naming state_splits
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        ds = Rank(1, bf).descriptor()
    finally:
        monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT")
        mamba_utils.get_conv_state_layout.cache_clear()
    got = [str(m) for m in find_mismatches(p2, ds)]
    assert (
        len(got) == 1
        and got[0].startswith("prefill group 0 state_splits=")
        and "state 0: rows/unit/parts" in got[0]
    )
    assert "--tensor-parallel-size" in got[0]
    # a peer that sent no split (a kind not re-sliced): refused across sizes, fine at equal sizes
    bare = replace(p2, groups=tuple(replace(g, state_splits=()) for g in p2.groups))
    got = [str(m) for m in find_mismatches(bare, d1)]
    assert len(got) == 1 and "a side did not describe how its Mamba state is split" in got[0]
    assert find_mismatches(bare, replace(bare)) == []


def test_split_problems_and_kinds_not_resliced():
    conv, ssm = gdn_state_splits(((3, 256), (2, 64, 64)), (2, 2), False)
    assert conv == StateSplit(0, 3, 2, (64, 64, 128)) and ssm == StateSplit(1536, 1, 8192, (2,))
    assert state_split_problem([conv, ssm], [conv, ssm], 2, 2, 65536, 65536) is None
    assert "past the 9000-byte page" in state_split_problem(
        [conv, ssm], [conv, ssm], 2, 2, 9000, 65536
    )
    tp1 = [StateSplit(0, 3, 2, (128, 128, 256)), StateSplit(3072, 1, 8192, (4,))]
    assert state_split_problem([conv, ssm], tp1, 2, 1) is None
    wide = StateSplit(0, 3, 2, (128, 128, 384))  # another value_dim on the peer
    assert "state 0 part 2: 128 x TP2 here, 384 x TP1" in state_split_problem(
        [conv, ssm], [wide, tp1[1]], 2, 1
    )
    assert "overlaps the state before it" in state_split_problem(
        [conv, ssm], [tp1[0], replace(tp1[1], offset=8)], 2, 1
    )
    for kind, why in (("MambaAttentionBackendEnum.MAMBA2", "only 'gdn_attn'"), ("GDN_ATTN", None)):
        try:
            spec_state_splits(kind, ((3, 256), (2, 64, 64)), (2, 2), False)
            assert why is None
        except ValueError as e:
            assert why and why in str(e)
    with pytest.raises(ValueError, match="replicated"):
        spec_state_splits("GDN_ATTN", ((3, 256), (2, 64, 64)), (2, 2), False, tp_replicated=True)
    with pytest.raises(ValueError, match="not 2 \\* key_dim"):
        gdn_state_splits(((3, 100), (2, 64, 64)), (2, 2), False)


# ------------------------------------------------------------ the allow_mamba_cross_tp switch


def _decode_connector(kv_cache_config, **extra):
    """A real decode-side HybridPDConnector scheduler over ``kv_cache_config``."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hybridkv.connector.pd_connector import HybridPDConnector

    cfg = VllmConfig()
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="HybridPDConnector",
        kv_role="kv_consumer",
        kv_connector_extra_config={"allow_unauthenticated": True, **extra},
    )
    return HybridPDConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)


def _two_rank_params(local):
    """A prefill TP2's signed kv_transfer_params, parsed by a decode instance with ``local``."""
    from hybridkv.connector.pd_auth import DeploymentKey
    from hybridkv.connector.pd_params import (
        PromptView,
        RemotePrefill,
        issue_remote_prefill,
        parse_kv_transfer_params,
    )

    key, hashes = DeploymentKey(b"m" * 32), [bytes([i]) * 32 for i in range(2)]
    p = RemotePrefill(
        engine_id="p",
        request_id="r",
        host="127.0.0.1",
        port=4000,
        block_ids=((3,),),
        num_tokens=256,
        lease_id="b" * 32,
        ports=(4000, 4001),
    )
    return parse_kv_transfer_params(
        issue_remote_prefill(p, key, hashes, 256), PromptView(300, hashes), local, key
    )


def _mamba2_config():
    """A KVCacheConfig whose one Mamba group holds Mamba2 state (not re-sliced)."""
    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = "LBHNC"
    shapes = MambaStateShapeCalculator.mamba2_state_shape(1, 64, 1, 2, 32, 16, 4)
    spec = MambaSpec(
        block_size=256,
        shapes=tuple(shapes),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
        mamba_cache_mode="align",
    )
    return get_kv_cache_config_from_groups(
        cfg, [KVCacheGroupSpec(list(LAYERS), spec)], NUM_BLOCKS * spec.page_size_bytes * len(LAYERS)
    )


def test_allow_mamba_cross_tp_off_refuses_naming_the_switch_on_enables_gdn_only(
    vllm_caplog, monkeypatch
):
    caplog = vllm_caplog
    from hybridkv.connector.pd_connector import PDConnectorConfig
    from hybridkv.connector.pd_params import Refused, RemotePrefill
    from hybridkv.connector.pd_tp import MAMBA_TP_NOT_ENABLED
    from hybridkv.connector.store_config import ConfigError

    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    mamba_utils.get_conv_state_layout.cache_clear()
    with pytest.raises(ConfigError, match="allow_mamba_cross_tp='yes': expected true or false"):
        PDConnectorConfig.from_extra_config({"allow_mamba_cross_tp": "yes"})
    gdn = Rank(1, (torch.bfloat16, "float32")).config
    # off (the default): refused per request, naming the field and the switch
    off = _decode_connector(gdn)._scheduler.local_layout()
    assert off.mamba_problem == MAMBA_TP_NOT_ENABLED and off.mamba_group_ids == (0,)
    got = _two_rank_params(replace(off, total_kv_heads=2))
    assert isinstance(got, Refused) and got.field == "remote_ports", got
    assert "lists 2 prefill ranks" in str(got) and "groups [0]" in str(got)
    assert "set kv_connector_extra_config.allow_mamba_cross_tp=true on the decode instance" in str(
        got
    )
    # on, GDN state: accepted (the prefill side's split is checked at the handshake), said loudly
    caplog.clear()
    with caplog.at_level("WARNING"):
        on = _decode_connector(gdn, allow_mamba_cross_tp=True)._scheduler.local_layout()
    assert on.mamba_problem is None
    assert isinstance(_two_rank_params(replace(on, total_kv_heads=2)), RemotePrefill)
    warned = [
        r.getMessage() for r in caplog.records if "allow_mamba_cross_tp is ON" in r.getMessage()
    ]
    assert (
        len(warned) == 1 and "groups [0]" in warned[0] and "NOT for this model" not in warned[0]
    ), warned
    # on, a layout mamba_reslice_problem refuses (Mamba2 state): still refused, with the reason
    caplog.clear()
    with caplog.at_level("WARNING"):
        m2 = _decode_connector(
            _mamba2_config(), allow_mamba_cross_tp=True
        )._scheduler.local_layout()
    assert m2.mamba_problem == (
        "allow_mamba_cross_tp is on, but this state is not re-sliced: group 0: "
        "mamba_type 'mamba2': only 'gdn_attn' (gated delta net) state is re-sliced"
    )
    got = _two_rank_params(replace(m2, total_kv_heads=2))
    assert (
        isinstance(got, Refused) and got.field == "remote_ports" and m2.mamba_problem in str(got)
    ), got
    assert any(
        "NOT for this model (allow_mamba_cross_tp is on" in r.getMessage() for r in caplog.records
    )
