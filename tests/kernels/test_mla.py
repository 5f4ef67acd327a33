"""MLA ops: paged cache write, split-KV decode, ragged prefill and the dense drop-in, each against the plain
torch reference (Triton through the interpreter on CPU, fp32), the reference against HF's expanded math,
and the absorbed drop-in against tiny HF DeepseekV2/V3 models (prefill + decode with a DynamicCache)."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybrid_kernels.library import GLUON
from hybrid_kernels.mla import gluon, ops
from hybrid_kernels.mla import reference as ref
from hybrid_kernels.mla import triton_attention as kernels
from hybrid_kernels.mla import triton_cache, triton_step
from hybrid_kernels.mla.ops import mla_attention_dense, mla_cache_write, mla_decode, mla_prefill

SCALE = 0.37
REPO = Path(__file__).resolve().parents[2]
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # CPU: Triton through the interpreter (fp32)


def _paged(seq_lens, L, R, block_size, spare=3, seed=0):
    """Random cache with shuffled, non-contiguous blocks; table entries past each sequence's end are -1."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(max(need), 1) + 1
    nb = sum(need) + spare
    cache = torch.randn(nb, block_size, L + R, generator=g)
    perm = torch.randperm(nb, generator=g)
    bt = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[used:used + n].int()
        used += n
    return cache.to(DEV), bt.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEV).to(dtype)


def _triton_ops(monkeypatch):
    monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")


# ---------------------------------------------------------------------------------------------- cache write
@pytest.mark.parametrize("impl", ["ref", "triton", "op"])
def test_cache_write(impl, monkeypatch):
    L, R, bs = 32, 8, 16
    cache = randn(5, bs, L + R)
    before = cache.clone()
    slots = torch.tensor([3, -1, 16, 79, 17, -1, 40], device=DEV)   # crosses blocks, skips two rows
    lat, rope = randn(7, L), randn(7, R)
    if impl == "ref":
        ref.mla_cache_write_ref(cache, lat, rope, slots)
    elif impl == "triton":
        triton_cache.mla_cache_write_triton(cache, lat, rope, slots)
    else:
        _triton_ops(monkeypatch)
        assert mla_cache_write(cache, lat, rope, slots) is None
    flat, flat0 = cache.view(-1, L + R), before.view(-1, L + R)
    written = torch.zeros(flat.shape[0], dtype=torch.bool, device=DEV)
    for n, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(flat[s], torch.cat([lat[n], rope[n]]), rtol=0, atol=0)
            written[s] = True
    torch.testing.assert_close(flat[~written], flat0[~written], rtol=0, atol=0)   # untouched slots unchanged


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_cache_write_all_skipped(impl):
    cache = randn(2, 16, 40)
    before = cache.clone()
    fn = ref.mla_cache_write_ref if impl == "ref" else triton_cache.mla_cache_write_triton
    fn(cache, randn(3, 32), randn(3, 8), torch.tensor([-1, -1, -1], device=DEV))
    torch.testing.assert_close(cache, before, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- decode
@pytest.fixture(params=[1024, 16], ids=["one_window", "many_windows"])
def window_keys(request, monkeypatch):
    """Block ids are read a window at a time: small windows cross many window edges (unaligned with odd pages)."""
    monkeypatch.setitem(kernels.CONFIGS, "window_keys", request.param)
    return request.param


@pytest.mark.parametrize("L,R,H,block_size,block_n", [(32, 8, 3, 16, 64), (32, 8, 3, 64, 16), (64, 16, 5, 16, 32),
                                                      (32, 8, 3, 24, 32)])
def test_decode_matches_reference(L, R, H, block_size, block_n, window_keys):
    seq_lens = [1, 17, 300, 0, 64]
    cache, bt, sl = _paged(seq_lens, L, R, block_size)
    q_lat, q_rope = randn(len(seq_lens), H, L), randn(len(seq_lens), H, R)
    want = ref.mla_decode_ref(q_lat, q_rope, cache, bt, sl, SCALE)
    assert torch.isfinite(want).all() and (want[3] == 0).all()          # seq_len 0 -> zeros
    outs = [kernels.mla_decode_triton(q_lat, q_rope, cache, bt, sl, SCALE, num_splits=ns,
                                      config={"block_n": block_n}) for ns in (1, 3, 0, 19)]
    for got in outs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)  # split == no split


def test_decode_strided_queries_and_op(monkeypatch):
    L, R, H = 32, 8, 3
    cache, bt, sl = _paged([5, 33], L, R, 16, seed=1)
    q = randn(2, H, L + R + 4)                                          # q_lat / q_rope as strided views
    q_lat, q_rope = q[..., :L], q[..., L:L + R]
    want = ref.mla_decode_ref(q_lat, q_rope, cache, bt, sl, SCALE)
    _triton_ops(monkeypatch)
    torch.testing.assert_close(mla_decode(q_lat, q_rope, cache, bt, sl, scale=SCALE, num_splits=2), want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [3, 37])
@pytest.mark.parametrize("tiles", [(1, 128), (4, 512)])
def test_merge_kernel_skips_empty_splits(num_splits, tiles, monkeypatch):
    """The split-KV merge alone, against logsumexp weights in torch: 300 columns (128-column programs, the last
    ragged, or one 512-column program), 6 rows one or four per program (the last block ragged), 37 splits (three
    blocks of 16: the online rescale across blocks), empty splits (lse -inf) whose unwritten partial rows hold NaN
    and must not reach the output, and a row whose every split is empty (zeros). The lse are base 2, as the
    attention kernels write them."""
    _triton_ops(monkeypatch)
    monkeypatch.setattr(kernels, "merge_tiles", lambda rows, block_s, L: tiles)
    T, H, L = 2, 3, 300
    lse = randn(T * H, num_splits) * 4
    po = randn(T * H, num_splits, L)
    dead = torch.rand(T * H, num_splits, device=DEV) < 0.4
    dead[:, 0] = False
    dead[1] = True
    lse[dead] = float("-inf")
    po[dead] = float("nan")
    w = torch.softmax(lse * math.log(2), 1).nan_to_num(0.0)
    want = (w[..., None] * po.nan_to_num(0.0)).sum(1).view(T, H, L)
    out = torch.full((T, H, L), 7.0, device=DEV)
    kernels.merge(po.flatten(), lse.flatten(), out, H=H, L=L, num_splits=num_splits, n_scr_tokens=T, t_out=1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert out.view(T * H, L)[1].eq(0).all()


def test_choose_num_splits_is_shape_only():
    assert kernels.choose_num_splits(1024, 16384, 64) == 1                  # enough programs already
    assert kernels.choose_num_splits(1, 1 << 20, 64) == 64                  # capped by max_splits
    least = kernels.CONFIGS["split"]["min_tokens"]                          # no split holds fewer keys
    assert all(s // kernels.choose_num_splits(b, s, 32) >= least for b in (1, 3, 8) for s in (64, 200, 512, 4096))
    assert kernels.choose_num_splits(1, 1024, 32) == 16                     # one short wave: many short splits
    assert kernels.choose_num_splits(8, 0, 64) == 1
    # the last wave stays full: 128 sequences x 2 splits = 256 programs fit 132 SMs x 2 at once; 3 would not
    assert kernels.choose_num_splits(128, 16384, 64, per_sm=2) == 2
    assert kernels.choose_num_splits(64, 16384, 64, per_sm=2) == 4


def test_gluon_split_counts_fill_the_sms_once():
    """gluon.split_count (the Gluon kernels, one program per SM): one program per sequence at up to 32 heads, one per
    64 heads above; the counts the 2026-12-01 sweep found best (or within 1.1 us) at 16 heads."""
    assert [gluon.split_count(b, 16, s) for b, s in ((128, 1024), (64, 1024), (32, 4096), (8, 16384))] == [1, 2, 4, 16]
    assert gluon.split_count(64, 16, 1024) == gluon.split_count(64, 3, 1024)     # every head in one program
    assert gluon.split_count(64, 128, 1024) == 1                                  # 2 programs per sequence already
    assert gluon.split_count(8, 16, 0) == 1


# ---------------------------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("L,R,H,block_size,config", [
    (32, 8, 3, 16, None), (32, 8, 3, 64, {"block_m": 16, "block_n": 16}), (64, 16, 3, 16, {"block_m": 8}),
    (32, 8, 3, 24, None)])
def test_prefill_matches_reference(L, R, H, block_size, config, window_keys):
    # (cached prefix + new tokens): 295 + 5, fresh prompt 17, single token, 40 new over 260 cached, 1 + 0
    seq_lens = [300, 17, 1, 300, 1]
    q_lens = [5, 17, 1, 40, 0]
    cache, bt, sl = _paged(seq_lens, L, R, block_size, seed=2)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    Tq = int(qsl[-1])
    q_lat, q_rope = randn(Tq, H, L), randn(Tq, H, R)
    want = ref.mla_prefill_ref(q_lat, q_rope, cache, bt, sl, qsl, SCALE)
    got = kernels.mla_prefill_triton(q_lat, q_rope, cache, bt, sl, qsl, SCALE, config=config)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_reference_brute_force():
    """The (vectorised) prefill reference against a per-query loop; and decode == prefill with q_len 1."""
    L, R, H = 32, 8, 2
    seq_lens, q_lens = [20, 7], [4, 7]
    cache, bt, sl = _paged(seq_lens, L, R, 16, seed=3)
    qsl = torch.tensor([0, 4, 11], dtype=torch.int32, device=DEV)
    q_lat, q_rope = randn(11, H, L), randn(11, H, R)
    got = ref.mla_prefill_ref(q_lat, q_rope, cache, bt, sl, qsl, SCALE)
    kv = ref._gather_pages(cache, bt)
    for b in range(2):
        for i in range(q_lens[b]):
            t, pos = int(qsl[b]) + i, seq_lens[b] - q_lens[b] + i
            k = kv[b, :pos + 1]
            p = torch.softmax((q_lat[t] @ k[:, :L].T + q_rope[t] @ k[:, L:].T) * SCALE, -1)
            torch.testing.assert_close(got[t], p @ k[:, :L], rtol=1e-5, atol=1e-5)
    last = qsl[1:] - 1
    torch.testing.assert_close(ref.mla_decode_ref(q_lat[last], q_rope[last], cache, bt, sl, SCALE), got[last])


def test_prefill_op(monkeypatch):
    L, R, H = 32, 8, 3
    cache, bt, sl = _paged([9, 3], L, R, 16, seed=4)
    qsl = torch.tensor([0, 9, 11], dtype=torch.int32, device=DEV)
    q_lat, q_rope = randn(11, H, L), randn(11, H, R)
    want = ref.mla_prefill_ref(q_lat, q_rope, cache, bt, sl, qsl, SCALE)
    _triton_ops(monkeypatch)
    torch.testing.assert_close(mla_prefill(q_lat, q_rope, cache, bt, sl, qsl, scale=SCALE), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- dense
def _dense_inputs(B, H, T, S, L=32, R=8, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, L + R, generator=g).permute(0, 2, 1, 3)     # non-contiguous, like HF's transpose
    kv = torch.randn(B, S, L + R + 3, generator=g)                        # latent / rope as strided slices
    q, kv = q.to(DEV), kv.to(DEV)
    return q[..., :L], q[..., L:], kv[..., :L], kv[..., L:L + R]


def _masks(B, T, S):
    g = torch.Generator().manual_seed(6)
    bool_mask = torch.rand(B, 1, T, S, generator=g) > 0.4
    bool_mask[0, 0, 1] = False                                            # one fully masked row
    float_mask = torch.randn(1, 1, T, S, generator=g)
    float_mask[..., 1, :3] = float("-inf")
    float_mask[..., 2, :] = torch.finfo(torch.float32).min               # SDPA: uniform row, finite
    float_mask[..., 3, :] = float("-inf")                                 # SDPA: NaN row; ours: zeros
    bool_mask, float_mask = bool_mask.to(DEV), float_mask.to(DEV)
    return {"none": (None, False), "causal": (None, True), "bool": (bool_mask, False),
            "float": (float_mask, False), "bool+causal": (bool_mask, True)}


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float", "bool+causal"])
@pytest.mark.parametrize("T,S", [(5, 5), (5, 23)])
def test_dense_matches_reference(kind, T, S):
    B, H = 2, 3
    q_lat, q_rope, lat, krope = _dense_inputs(B, H, T, S)
    mask, causal = _masks(B, T, S)[kind]
    want = ref.mla_attention_dense_ref(q_lat, q_rope, lat, krope, mask, causal, SCALE)
    assert torch.isfinite(want).all()
    got = kernels.mla_attention_dense_triton(q_lat, q_rope, lat, krope, mask, causal, SCALE,
                                             config={"block_m": 8, "block_n": 16})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if kind in ("bool", "float"):
        assert (got[0, :, 1 if kind == "bool" else 3] == 0).all()         # fully masked rows -> zeros


def test_dense_matches_sdpa_where_sdpa_is_defined():
    """Against torch SDPA with expanded K/V (= latent): same semantics for bool/float masks and causal T == S."""
    B, H, T, S = 2, 3, 6, 6
    q_lat, q_rope, lat, krope = _dense_inputs(B, H, T, S)
    q = torch.cat([q_lat, q_rope], -1)
    # contiguous K/V for SDPA: its fused CUDA kernels fault on odd row strides (misaligned address)
    k = torch.cat([lat, krope], -1)[:, None].expand(B, H, S, -1).contiguous()
    v = lat[:, None].expand(B, H, S, -1).contiguous()
    bool_mask = torch.rand(B, 1, T, S, device=DEV) > 0.3
    bool_mask[..., 0] = True
    float_mask = torch.where(bool_mask, 0.0, torch.finfo(torch.float32).min)
    float_mask[0, 0, 2] = torch.finfo(torch.float32).min                  # finite fully-biased row: uniform
    for mask, causal in [(None, True), (None, False), (bool_mask, False), (float_mask, False)]:
        with sdpa_kernel(SDPBackend.MATH):  # the fused CUDA backends zero the finite fully-biased row
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                    scale=SCALE)
        got = kernels.mla_attention_dense_triton(q_lat, q_rope, lat, krope, mask, causal, SCALE)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dense_decode_split_and_op(monkeypatch):
    B, H, S = 2, 3, 150
    q_lat, q_rope, lat, krope = _dense_inputs(B, H, 1, S)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=DEV)
    mask[1, ..., :40] = False                                             # left padding
    want = ref.mla_attention_dense_ref(q_lat, q_rope, lat, krope, mask, False, SCALE)
    a = kernels.mla_attention_dense_triton(q_lat, q_rope, lat, krope, mask, False, SCALE, num_splits=1)
    b = kernels.mla_attention_dense_triton(q_lat, q_rope, lat, krope, mask, False, SCALE, num_splits=4,
                                           config={"block_n": 16})
    torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, want, rtol=1e-5, atol=1e-5)
    _triton_ops(monkeypatch)
    torch.testing.assert_close(mla_attention_dense(q_lat, q_rope, lat, krope, mask, scale=SCALE), want,
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- absorbed math
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float"])
def test_reference_matches_expanded_attention(kind):
    """Absorbed (q_lat = q_nope W_UK, o = o_lat W_UV^T) == HF's expanded keys/values."""
    B, H, T, S, L, R, P, V = 2, 3, 5, 23, 32, 8, 16, 12
    g = torch.Generator().manual_seed(7)
    q_nope, q_rope = torch.randn(B, H, T, P, generator=g), torch.randn(B, H, T, R, generator=g)
    lat, krope = torch.randn(B, S, L, generator=g), torch.randn(B, S, R, generator=g)
    w = torch.randn(H * (P + V), L, generator=g) * 0.2
    q_nope, q_rope, lat, krope, w = (t.to(DEV) for t in (q_nope, q_rope, lat, krope, w))
    mask, causal = _masks(B, T, S)[kind]
    if kind == "float":
        mask = mask.clamp(min=-1e4)                                       # no -inf rows: SDPA would NaN
    want = ref.expanded_attention_ref(q_nope, q_rope, lat, krope, w, V, mask, causal, SCALE)
    w_uk, w_uv = ref.split_kv_b(w, H, P, V)
    q_lat = ref.absorb_q(q_nope.transpose(1, 2), w_uk).transpose(1, 2)
    o_lat = ref.mla_attention_dense_ref(q_lat, q_rope, lat, krope, mask, causal, SCALE)
    got = ref.unabsorb_out(o_lat.transpose(1, 2), w_uv).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- HF drop-in
_CACHE = {}


def _cached(cache, idx):
    """(keys, values) of layer idx as [B, S, *] (HF stores the latent as keys, k_rope as values)."""
    if hasattr(cache, "layers"):
        return cache.layers[idx].keys[:, 0], cache.layers[idx].values[:, 0]
    return cache.key_cache[idx][:, 0], cache.value_cache[idx][:, 0]         # older transformers


def _cache_kwarg(model):
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _absorbed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What the graph pass substitutes for HF's expand_kv + SDPA: attention over the cached latent."""
    latent, k_rope = _cached(_CACHE["cache"], module.layer_idx)         # [B, S, L], [B, S, R] (post-RoPE)
    P = module.qk_nope_head_dim
    w_uk, w_uv = ref.split_kv_b(module.kv_b_proj.weight, module.num_heads, P, module.v_head_dim)
    q_lat = ref.absorb_q(query[..., :P].transpose(1, 2), w_uk).transpose(1, 2)        # [B, H, T, L]
    # HF's sdpa_attention_forward: is_causal only for T > 1 without a mask
    is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    o_lat = mla_attention_dense(q_lat, query[..., P:], latent, k_rope, attention_mask, is_causal=is_causal,
                                scale=scaling)
    _CACHE["calls"].append(None if attention_mask is None else attention_mask.dtype)
    return ref.unabsorb_out(o_lat.transpose(1, 2), w_uv), None            # [B, T, H, V]


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("family", ["v2", "v3"])
def test_absorbed_drop_in_reproduces_hf(family, impl, monkeypatch):
    from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
    from transformers.masking_utils import sdpa_mask
    if family == "v2":
        from transformers import DeepseekV2Config as Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Model as Model
    else:
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Model as Model
    AttentionInterface.register("hybrid_mla_test", _absorbed_attention)
    AttentionMaskInterface.register("hybrid_mla_test", sdpa_mask)          # same masks as sdpa
    if impl == "triton":
        _triton_ops(monkeypatch)
    torch.manual_seed(8)
    cfg = Config(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=3,
                 num_key_value_heads=3, kv_lora_rank=32, q_lora_rank=24 if family == "v3" else None,
                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=1,
                 max_position_embeddings=64, attn_implementation="sdpa")
    model = Model(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.to(DEV)
    ids = torch.randint(0, 50, (2, 7), device=DEV)
    pad = torch.ones(2, 7, dtype=torch.long, device=DEV)
    pad[1, :3] = 0                                                        # left padding -> bool masks
    for attn_mask in (None, pad):
        outs = {}
        for name in ("sdpa", "hybrid_mla_test"):
            model.set_attn_implementation(name)
            cache = DynamicCache(config=cfg)
            _CACHE.update(cache=cache, calls=[])
            with torch.no_grad():
                kw = {_cache_kwarg(model): cache, "use_cache": True}
                prefill = model(input_ids=ids, attention_mask=attn_mask, **kw).last_hidden_state
                m2 = None if attn_mask is None else torch.cat([attn_mask, torch.ones_like(attn_mask[:, :1])], 1)
                decode = model(input_ids=ids[:, :1], attention_mask=m2, **kw).last_hidden_state
            outs[name] = (prefill, decode)
        calls = _CACHE["calls"]
        assert calls == ([None, None] if attn_mask is None else [torch.bool, torch.bool])
        assert [t.shape[-1] for t in _cached(cache, 0)] == [32, 8]              # HF caches the latent
        (want_p, want_d), (got_p, got_d) = outs["sdpa"], outs["hybrid_mla_test"]
        assert torch.isfinite(got_p).all()
        valid = slice(None) if attn_mask is None else attn_mask.bool()  # padded queries: SDPA backends differ
        torch.testing.assert_close(got_p[valid], want_p[valid], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_d, want_d, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- engine decode
@pytest.mark.parametrize("impl", ["ref", "triton", "triton-uv-after-merge"])
def test_paged_attention_equals_dropin_over_the_gather(impl, monkeypatch):
    """hybrid::mla_attention_paged (pages read in place) = hybrid::mla_attention over what
    hybrid::paged_gather returns for the engine's left-padded gather map and mask; 3 heads, block size 4,
    lengths 1 / 6 / 17 across block boundaries, blocks shuffled, one padding row of the reserved block 0.
    "triton": W_UV applied by the merge kernel (4 rows, V = 12 over 16-column tiles); "triton-uv-after-merge": the
    batched matmul after the merge, as above uv_max_batch rows."""
    from hybrid_kernels.mla.ops import mla_attention
    from hybrid_kernels.mla.ops import mla_attention_paged
    if impl != "ref":
        _triton_ops(monkeypatch)
        uv_max = 4 if impl == "triton" else 0
        monkeypatch.setitem(kernels.CONFIGS, "merge_uv", {**kernels.CONFIGS["merge_uv"], "uv_max_batch": uv_max})
    g = torch.Generator().manual_seed(4)
    H, P, R, V, L, bs = 3, 16, 8, 12, 32, 4
    lengths = [1, 6, 17, 1]                                              # the last row is bucket padding
    width = 32
    nb = 16
    buf = torch.randn(nb * bs, 1, L + R, generator=g).to(DEV)
    perm = (torch.randperm(nb - 1, generator=g) + 1).tolist()            # block 0 stays reserved
    table = torch.zeros(len(lengths), width // bs, dtype=torch.long)
    for b, n in enumerate(lengths[:-1]):
        for j in range(-(-n // bs)):
            table[b, j] = perm.pop()
    pads = torch.tensor([width - n for n in lengths])
    pos = torch.arange(width)[None] - pads[:, None]                      # left padding, as the runner lays out
    keep = pos >= 0
    pos = pos.clamp(min=0)
    gather = torch.where(keep, table.gather(1, pos // bs) * bs + pos % bs, 0).to(DEV)
    table, seq_lens = table.int().to(DEV), torch.tensor(lengths, dtype=torch.int32, device=DEV)
    weight = (torch.randn(H * (P + V), L, generator=g) * 0.2).to(DEV)
    q_nope = torch.randn(len(lengths), H, 1, P, generator=g).to(DEV)
    q_rope = torch.randn(len(lengths), H, 1, R, generator=g).to(DEV)
    latent, k_rope = torch.ops.hybrid.paged_gather(buf, gather, table, seq_lens, L, bs)
    assert latent.shape == (len(lengths), 1, width, L) and k_rope.shape == (len(lengths), 1, width, R)
    want = mla_attention(q_nope, q_rope, latent, k_rope, weight, keep[:, None, None, :].to(DEV), scale=SCALE)
    got = mla_attention_paged(q_nope, q_rope, buf, table, seq_lens, weight, block_size=bs, scale=SCALE)
    assert got.shape == (len(lengths), H, 1, V)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("B", [1, 3, 70])
def test_decode_step_prep_kernel_matches_reference(B, monkeypatch):
    """The decode step's first launch (hybrid_kernels/mla/triton_step.py): kv_a_layernorm + the row write into the pages + the
    absorbed query, Triton against the torch reference: q_lat and every cache row (written rows and untouched ones),
    3 heads, L = 40 and P = 24 (not powers of two), R = 6, a strided q (a view of the projection's output), 70
    sequences over two 64-row tiles."""
    H, P, L, R, V = 3, 24, 40, 6, 12
    g = torch.Generator().manual_seed(B)
    proj = torch.randn(B, H * (P + R), generator=g).to(DEV)
    q_nope = proj.view(B, H, P + R)[:, :, :P]                           # strided, as the engine's graph has it
    w_uk = (torch.randn(H * (P + V), L, generator=g) * 0.2).to(DEV).view(H, P + V, L)[:, :P]
    kv = (torch.randn(B, L + R, generator=g) * 3).to(DEV)[:, :L]
    norm_w, k_rope = torch.randn(L, generator=g).to(DEV), torch.randn(B, R, generator=g).to(DEV)
    buf = torch.randn(128, 1, L + R, generator=g).to(DEV)
    slots = torch.randperm(127, generator=g)[:B].add(1).to(DEV)
    want_buf = buf.clone()
    want = ref.mla_step_prep_ref(q_nope, w_uk, kv, norm_w, 1e-6, k_rope, want_buf, slots)
    _triton_ops(monkeypatch)
    got = triton_step.mla_step_prep_triton(q_nope, w_uk, kv, norm_w, 1e-6, k_rope, buf, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buf, want_buf, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want_buf[slots], torch.zeros_like(want_buf[slots]))


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_decode_step_equals_write_then_paged_attention(impl, monkeypatch):
    """hybrid::mla_decode_step = the steps it replaces in the engine's decode graph: HF's RMSNorm of the new latent,
    the row [latent | k_rope] written with index_copy_, then hybrid::mla_attention_paged over the pages (block size 4,
    lengths 1 / 6 / 17, each sequence's new token the last one it attends)."""
    from hybrid_kernels.mla.ops import mla_attention_paged, mla_decode_step
    from hybrid_kernels.linear.reference import add_rms_norm_ref
    if impl == "triton":
        _triton_ops(monkeypatch)
    g = torch.Generator().manual_seed(12)
    H, P, R, V, L, bs = 3, 16, 8, 12, 32, 4
    lengths = [1, 6, 17]
    nb = 12
    perm = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(lengths), 5, dtype=torch.int32)
    for b, n in enumerate(lengths):
        for j in range(-(-n // bs)):
            table[b, j] = perm.pop()
    slots = torch.tensor([int(table[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lengths)])
    buf = torch.randn(nb * bs, 1, L + R, generator=g).to(DEV)
    weight = (torch.randn(H * (P + V), L, generator=g) * 0.2).to(DEV)
    q_nope, q_rope = torch.randn(3, H, 1, P, generator=g).to(DEV), torch.randn(3, H, 1, R, generator=g).to(DEV)
    kv, k_rope = torch.randn(3, 1, L, generator=g).to(DEV), torch.randn(3, 1, 1, R, generator=g).to(DEV)
    norm_w = torch.randn(L, generator=g).to(DEV)
    table, seq_lens, slots = table.to(DEV), torch.tensor(lengths, dtype=torch.int32, device=DEV), slots.to(DEV)
    want_buf = buf.clone()
    rows = torch.cat([add_rms_norm_ref(kv, None, norm_w, 1e-5, False, torch.float32)[0], k_rope[:, 0]], -1)
    want_buf.index_copy_(0, slots, rows.view(3, 1, L + R))
    want = mla_attention_paged(q_nope, q_rope, want_buf, table, seq_lens, weight, block_size=bs, scale=SCALE)
    got = mla_decode_step(q_nope, q_rope, kv, norm_w, k_rope, buf, slots, table, seq_lens, weight, eps=1e-5,
                          block_size=bs, scale=SCALE)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(buf, want_buf, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- compile
def test_ops_under_torch_compile():
    """Cache write (mutating) + decode through Inductor on CPU (reference bodies), one graph."""
    L, R, H = 32, 8, 3
    cache, bt, sl = _paged([5, 20], L, R, 16, seed=9)
    lat, rope = randn(2, L), randn(2, R)
    slots = (bt[:, 0].long() * 16 + sl.long() - 1).clone()               # write each sequence's last token
    q_lat, q_rope = randn(2, H, L), randn(2, H, R)

    def step(cache, lat, rope, slots, q_lat, q_rope):
        mla_cache_write(cache, lat, rope, slots)
        return mla_decode(q_lat, q_rope, cache, bt, sl, scale=SCALE)

    eager_cache = cache.clone()
    want = step(eager_cache, lat, rope, slots, q_lat, q_rope)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(cache, lat, rope, slots, q_lat, q_rope)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache, eager_cache)                        # the in-place write survived


# ---------------------------------------------------------------------------------------------- GPU, bf16
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels at DeepSeek widths need a GPU")
@pytest.mark.parametrize("H", [16, 128])
def test_bf16_deepseek_widths(H):
    """The configs that ship (mma.sync at 16 heads, wgmma at 128), bf16 against the fp32 reference."""
    L, R, bf16, scale = 512, 64, torch.bfloat16, 192 ** -0.5
    tol = dict(rtol=2e-2, atol=3e-2)
    seq_lens = [1, 100, 1000, 4097, 0, 64]
    cache, bt, sl = _paged(seq_lens, L, R, 64, seed=10)
    cache = cache.to(bf16)
    q_lat, q_rope = randn(6, H, L, dtype=bf16), randn(6, H, R, dtype=bf16)
    want = ref.mla_decode_ref(q_lat.float(), q_rope.float(), cache, bt, sl, scale)
    for ns in (1, 0, 7):
        got = kernels.mla_decode_triton(q_lat, q_rope, cache, bt, sl, scale, num_splits=ns)
        assert got.dtype == bf16
        torch.testing.assert_close(got.float(), want, **tol)
    q_lens = [1, 100, 300, 1, 0, 64]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    Tq = int(qsl[-1])
    q_lat, q_rope = randn(Tq, H, L, dtype=bf16), randn(Tq, H, R, dtype=bf16)
    want = ref.mla_prefill_ref(q_lat.float(), q_rope.float(), cache, bt, sl, qsl, scale)
    got = kernels.mla_prefill_triton(q_lat, q_rope, cache, bt, sl, qsl, scale)
    torch.testing.assert_close(got.float(), want, **tol)
    B, T, S = 2, 7, 700
    lat, krope = randn(B, S, L, dtype=bf16), randn(B, S, R, dtype=bf16)
    mask = torch.rand(B, 1, T, S, device=DEV) > 0.2
    for t, m, causal in ((1, None, False), (T, mask, False), (T, None, True)):
        ql, qr = randn(B, H, t, L, dtype=bf16), randn(B, H, t, R, dtype=bf16)
        want = ref.mla_attention_dense_ref(ql, qr, lat, krope, m, causal, scale)
        got = kernels.mla_attention_dense_triton(ql, qr, lat, krope, m, causal, scale)
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels at DeepSeek widths need a GPU")
@pytest.mark.parametrize("B", [1, 5, 64])
def test_bf16_decode_step_prep_deepseek_widths(B):
    """The decode step's prep kernel in bf16 at DeepSeek-V2-Lite widths (16 heads, P 128, L 512, R 64; one tile of
    16 sequences and one of 64) against the reference on the same bf16 inputs."""
    H, P, L, R, V, bf16 = 16, 128, 512, 64, 128, torch.bfloat16
    proj = randn(B, H * (P + R), dtype=bf16)
    q_nope = proj.view(B, H, P + R)[:, :, :P]
    w_uk = (randn(H * (P + V), L) * 0.05).to(bf16).view(H, P + V, L)[:, :P]
    kv = (randn(B, L + R) * 3).to(bf16)[:, :L]
    norm_w, k_rope = randn(L, dtype=bf16), randn(B, R, dtype=bf16)
    buf = randn(4096, 1, L + R, dtype=bf16)
    slots = torch.randperm(4096, device=DEV)[:B]
    want_buf = buf.clone()
    want = ref.mla_step_prep_ref(q_nope, w_uk, kv, norm_w, 1e-6, k_rope, want_buf, slots)
    got = triton_step.mla_step_prep_triton(q_nope, w_uk, kv, norm_w, 1e-6, k_rope, buf, slots)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(buf.float(), want_buf.float(), rtol=1e-2, atol=1e-2)


def test_warpgroup_kernel_only_where_it_applies(monkeypatch):
    """ops.implementation: the Gluon kernels take a decode only on a Hopper GPU, at up to 32 or 64k heads, L 512 / R 64,
    16-bit, and not with HYBRID_MLA_WG=0."""
    q_lat, q_rope = torch.zeros(2, 128, 512, dtype=torch.bfloat16), torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    gluon_ok = lambda *a: ops.implementation(*a) == GLUON  # noqa: E731
    assert not gluon_ok(q_lat, q_rope, cache)                            # CPU tensors
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and gluon.HAVE_GLUON):
        return
    q_lat, q_rope, cache = q_lat.cuda(), q_rope.cuda(), cache.cuda()
    assert gluon_ok(q_lat, q_rope, cache)
    assert gluon_ok(q_lat[:, :16], q_rope[:, :16], cache)              # 16 heads: gluon_narrow.py
    assert gluon_ok(q_lat[:, :3], q_rope[:, :3], cache)
    assert not gluon_ok(q_lat[:, :48], q_rope[:, :48], cache)          # 33..63 heads: the Triton kernel
    assert not gluon_ok(q_lat[:, :96], q_rope[:, :96], cache)          # not a multiple of 64
    assert not gluon_ok(q_lat.float(), q_rope.float(), cache.float())
    assert not gluon_ok(q_lat[..., :256], q_rope, cache[..., :320])    # another latent width
    lat, rope = cache[..., :512], torch.zeros(4, 64, 64, dtype=torch.bfloat16, device="cuda")
    assert gluon_ok(q_lat, q_rope, lat, rope)                          # HF's dense latent and rope tensors
    monkeypatch.setenv("HYBRID_MLA_WG", "0")
    assert not gluon_ok(q_lat, q_rope, cache)


def test_warpgroup_kernel_compiles_for_sm90_offline():
    """The Gluon kernels cannot run in the interpreter: compile them for sm_90 here (Triton's bundled ptxas, no GPU),
    paged, direct-output and dense (page 0) forms at 128, 16 and 32 heads, and check they fit: wgmma, under the 227 KB
    of shared memory, and at most 128 B of spills (Triton 3.9: 8-16 B; 3.6: 20-36 B of hoisted addresses at 128 heads;
    a spilled accumulator would be kilobytes)."""
    if not gluon.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    pytest.importorskip("triton.backends.nvidia.compiler")
    code = ("import sys; sys.path.insert(0, '.'); import bench.mla as m\n"
            "for heads, page, direct in ((128, 16, False), (128, 64, True), (128, 0, False), (16, 64, False),\n"
            "                            (16, 0, True), (32, 16, False)):\n"
            "    k = m.compile_wg(page, direct, heads)\n"
            "    info = m.ptxas_info(m.bundled_ptxas(), k).split()\n"
            "    print(k.metadata.shared, 'wgmma.mma_async' in k.asm['ptx'], info[info.index('spills') + 1])")
    # "0", not unset: bench/mla.py turns the interpreter on where there is no GPU, and Triton's own jit helpers (the
    # combine function of gl.max) must not be interpreted functions when Gluon compiles
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()[-6:]
    assert len(lines) == 6, res.stdout
    for line in lines:
        shared, wgmma, spills = line.split()
        assert int(shared) <= 232448 and wgmma == "True" and int(spills) <= 128, line


def _spy_wg_launches(monkeypatch, arg: str) -> list:
    """Records one argument (by name) of every launch of the Gluon decode kernels (gluon._launch)."""
    import inspect
    launches, real = [], gluon._launch
    names = list(inspect.signature(real).parameters)
    monkeypatch.setattr(gluon, "_launch", lambda *a: launches.append(a[names.index(arg)]) or real(*a))
    return launches


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon warpgroup kernel is for sm_90")
@pytest.mark.parametrize("H,block_size", [(64, 16), (128, 64), (128, 32), (16, 64), (3, 16), (32, 32)])
def test_warpgroup_decode_matches_reference(H, block_size, monkeypatch):
    """The Gluon kernels (gluon_wide.py at 64+ heads, gluon_narrow.py at up to 32) on ragged lengths across page and tile boundaries (empty, 1, 17, 63, 65, 300,
    1000 keys), one split (direct output), automatic and 5 splits, with W_UV in the merge, and inside a compiled
    graph; against the fp32 reference and against the Triton kernel on the same inputs."""
    if not gluon.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    L, R, V, bf16, scale = 512, 64, 128, torch.bfloat16, 192 ** -0.5
    tol = dict(rtol=2e-2, atol=3e-2)
    seq_lens = [1, 17, 300, 0, 63, 65, 1000]
    cache, bt, sl = _paged(seq_lens, L, R, block_size, seed=11)
    cache = cache.to(bf16)
    B = len(seq_lens)
    q_lat, q_rope = randn(B, H, L, dtype=bf16), randn(B, H, R, dtype=bf16)
    w_uv = (randn(H, V, L) * L ** -0.5).to(bf16)
    launches = _spy_wg_launches(monkeypatch, "num_splits")
    want = ref.mla_decode_ref(q_lat.float(), q_rope.float(), cache, bt, sl, scale)
    want_uv = ref.unabsorb_out(want.to(bf16), w_uv)
    for ns in (1, 0, 5):
        got = ops.decode(q_lat, q_rope, cache, bt, sl, scale, num_splits=ns)
        assert got.dtype == bf16 and got.shape == (B, H, L)
        torch.testing.assert_close(got.float(), want, **tol)
        got_uv = ops.decode(q_lat, q_rope, cache, bt, sl, scale, num_splits=ns, w_uv=w_uv)
        torch.testing.assert_close(got_uv.float(), want_uv.float(), **tol)
    assert len(launches) == 6 and launches[0] == 1 and launches[4] == 5
    monkeypatch.setenv("HYBRID_MLA_WG", "0")                            # the Triton kernel, same inputs
    tri = ops.decode(q_lat, q_rope, cache, bt, sl, scale)
    assert len(launches) == 6
    torch.testing.assert_close(got.float(), tri.float(), **tol)
    monkeypatch.delenv("HYBRID_MLA_WG")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: mla_decode(*a, scale=scale), fullgraph=True)
    torch.testing.assert_close(compiled(q_lat, q_rope, cache, bt, sl).float(), want, **tol)
    assert len(launches) == 7


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon warpgroup kernel is for sm_90")
@pytest.mark.parametrize("H", [128, 16])
def test_warpgroup_dense_decode_matches_reference(H, monkeypatch):
    """One-token decode over HF's dense latent cache at 128 and 16 heads (the drop-in path) takes a Gluon kernel (page 0):
    S = 1, 17, 300, 1000 keys, one and automatic splits, HF's [B, 1, S, *] cache tensors reshaped as
    hybrid::mla_attention does, and inside a compiled graph; with a mask it stays on the Triton kernel. Against the
    fp32 reference."""
    if not gluon.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    B, L, R, bf16, scale = 3, 512, 64, torch.bfloat16, 192 ** -0.5
    tol = dict(rtol=2e-2, atol=3e-2)
    launches = _spy_wg_launches(monkeypatch, "page")
    for S in (1, 17, 300, 1000):
        lat = randn(B, 1, S, L, dtype=bf16).reshape(B, S, L)
        rope = randn(B, 1, S, R, dtype=bf16).reshape(B, S, R)
        q_lat, q_rope = randn(B, H, 1, L, dtype=bf16), randn(B, H, 1, R, dtype=bf16)
        want = ref.mla_attention_dense_ref(q_lat.float(), q_rope.float(), lat.float(), rope.float(), None, False,
                                           scale)
        got = ops.mla_decode_wg_dense(q_lat[:, :, 0], q_rope[:, :, 0], lat, rope, scale, 1).unsqueeze(2)
        torch.testing.assert_close(got.float(), want, **tol)
        got = mla_attention_dense(q_lat, q_rope, lat, rope, scale=scale)   # the op: automatic splits
        assert got.shape == (B, H, 1, L) and got.dtype == bf16
        torch.testing.assert_close(got.float(), want, **tol)
    assert launches == [0] * 8
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=DEV)
    mask[1, ..., S // 2:] = False
    got = mla_attention_dense(q_lat, q_rope, lat, rope, mask, scale=scale)
    assert len(launches) == 8                                           # masked: the Triton kernel
    want = ref.mla_attention_dense_ref(q_lat.float(), q_rope.float(), lat.float(), rope.float(), mask, False, scale)
    torch.testing.assert_close(got.float(), want, **tol)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: mla_attention_dense(*a, scale=scale), fullgraph=True)
    want = ref.mla_attention_dense_ref(q_lat.float(), q_rope.float(), lat.float(), rope.float(), None, False, scale)
    torch.testing.assert_close(compiled(q_lat, q_rope, lat, rope).float(), want, **tol)
    assert launches == [0] * 9
