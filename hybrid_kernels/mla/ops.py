"""The MLA family's ops, their run-time twins and Python wrappers, and ``implementation``, the one place that chooses
between the torch reference, the Triton kernels and the Gluon kernels (Hopper) for a call.

Primitives (absorbed attention over the latent, L = kv_lora_rank, R = rope dim):
  ``hybrid::mla_cache_write``      token rows -> paged latent cache (also the engine's cache write: ``write_rows``)
  ``hybrid::mla_decode``           one query per sequence, split-KV over the pages
  ``hybrid::mla_prefill``          ragged causal prefill over the pages
  ``hybrid::mla_attention_dense``  HF's dense latent layout, optional mask, bottom-right causal
  ``hybrid::mla_decode_wg``(``_dense``)  the Gluon decode kernels as opaque ops (Inductor cannot inline Gluon)
What the MLA passes emit:
  ``hybrid::mla_attention``        everything of one DeepSeek attention from the cached latent on, over HF's cache
  ``hybrid::paged_gather``         what the engine's cache layer returns on an MLA decode step (contract below)
  ``hybrid::mla_attention_paged``  one-token decode over the engine's pages in place
  ``hybrid::mla_decode_step``      the same with the step's kv_a_layernorm and cache write in its first launch

Bodies run on CUDA through ``wrap_triton`` (torch.compile and AOT packages see the kernels) and as the reference
elsewhere; a triton_op body is also its fake, so launch configs and split counts come from shapes only.

The paged-decode contract (kept by ``runtime/engine``): on a decode step of an MLA model the cache layer writes the
step's rows with ``write_rows`` and returns ``hybrid::paged_gather(buf, gather_idx, block_table, seq_lens, L,
block_size)`` in place of ``buf[gather_idx]``: the same two tensors, with the step's block table and lengths carried
along. The keys row b may attend are positions 0..seq_lens[b]-1, stored at ``block_table[b, p // block_size] *
block_size + p % block_size`` of the buffer; ``gather_idx`` lists the same rows and the step's attention mask masks
out every other key, so the paged ops do not read the mask.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op

from hybrid_kernels.library import GLUON, REFERENCE, TRITON, define_twin, implementation as default_implementation, \
    op_name, size_hint

from . import gluon, reference, triton_attention, triton_cache, triton_step
from .gluon_common import HAVE_GLUON, LAT, NARROW_MAX_HEADS, ROPE, WIDE_HEADS, rows_ok
from .reference import per_head_matmul

#: queries per sequence from which ``hybrid::mla_attention`` takes the expanded path (kv_b_proj + flash SDPA):
#: absorbed attention costs 2*(2L+R) FLOP per (query, key, head) against 2*(P+R+V) expanded (3.4x more at DeepSeek
#: sizes)
EXPANDED_MIN_QUERIES = 64


def implementation(q_lat: Tensor, q_rope: Tensor, *keys: Tensor) -> str:
    """GLUON, TRITON or REFERENCE for a one-query-per-sequence attention of q_lat [B, H, L], q_rope [B, H, R] over
    ``keys`` (the paged cache [NB, page, L+R], or HF's dense latent [B, S, L] and rope key [B, S, R]). Gluon: a Hopper
    GPU, heads <= 32 or a multiple of 64, L = 512, R = 64, bf16 / fp16 everywhere, rows cp.async can copy, and
    ``HYBRID_MLA_WG`` not 0 (read per call; 0 sends these calls to the Triton kernel, for A/B runs)."""
    impl = default_implementation(q_lat)
    if impl != TRITON or not (HAVE_GLUON and q_lat.is_cuda) or os.environ.get("HYBRID_MLA_WG", "1") == "0":
        return impl
    if torch.cuda.get_device_capability(q_lat.device)[0] != 9:
        return impl
    heads = q_lat.shape[1]
    paged = len(keys) == 1
    widths = [LAT + ROPE] if paged else [LAT, ROPE]
    ok = ((heads % WIDE_HEADS == 0 or 0 < heads <= NARROW_MAX_HEADS)
          and q_lat.dtype in (torch.bfloat16, torch.float16)
          and all(t.dtype == q_lat.dtype for t in (q_rope, *keys))
          and rows_ok(q_lat, LAT) and rows_ok(q_rope, ROPE) and all(map(rows_ok, keys, widths)))
    return GLUON if ok else impl


def decode(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
           num_splits: int = 0, w_uv: Optional[Tensor] = None) -> Tensor:
    """Paged decode on the implementation ``implementation`` picks: q_lat [B, H, L], q_rope [B, H, R], cache
    [NB, page, L+R], block_table [B, MB] int32, seq_lens [B] int32 -> o_lat [B, H, L], or with w_uv [H, V, L] the
    absorbed output o_lat @ W_UV^T [B, H, V] (Triton / Gluon: from the merge kernel). num_splits 0: automatic."""
    impl = implementation(q_lat, q_rope, cache)
    if impl == GLUON:
        if num_splits <= 0:
            num_splits = gluon.split_count(q_lat.shape[0], q_lat.shape[1], block_table.shape[1] * cache.shape[1])
        return torch.ops.hybrid.mla_decode_wg(q_lat, q_rope, cache, block_table, seq_lens, float(scale), num_splits,
                                              w_uv)
    if impl == TRITON:
        return triton_attention.mla_decode_triton(q_lat, q_rope, cache, block_table, seq_lens, scale, num_splits,
                                                  w_uv=w_uv)
    o_lat = reference.mla_decode_ref(q_lat, q_rope, cache, block_table, seq_lens, scale, num_splits)
    return o_lat if w_uv is None else reference.unabsorb_out(o_lat, w_uv).to(q_lat.dtype)


# ------------------------------------------------------------------------------------------------------------------
# primitives
# ------------------------------------------------------------------------------------------------------------------
@triton_op(op_name("mla_cache_write"), mutates_args={"cache"})
def _mla_cache_write(cache: Tensor, latent: Tensor, k_rope: Tensor, slot_mapping: Tensor) -> None:
    """cache [NB, BS, L+R] (mutated), latent [N, L], k_rope [N, R], slot_mapping [N] (-1 = skip)."""
    if default_implementation(cache) == TRITON:
        triton_cache.mla_cache_write_triton(cache, latent, k_rope, slot_mapping)
    else:
        reference.mla_cache_write_ref(cache, latent, k_rope, slot_mapping)


@triton_op(op_name("mla_decode"), mutates_args={})
def _mla_decode(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                scale: float, num_splits: int) -> Tensor:
    """q_lat [B, H, L], q_rope [B, H, R], paged cache -> o_lat [B, H, L] (q dtype)."""
    return decode(q_lat, q_rope, cache, block_table, seq_lens, scale, num_splits)


@triton_op(op_name("mla_prefill"), mutates_args={})
def _mla_prefill(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                 query_start_loc: Tensor, scale: float) -> Tensor:
    """q_lat [Tq, H, L], q_rope [Tq, H, R], ragged by query_start_loc [B+1] -> o_lat [Tq, H, L]."""
    fn = triton_attention.mla_prefill_triton if default_implementation(q_lat) == TRITON else reference.mla_prefill_ref
    return fn(q_lat, q_rope, cache, block_table, seq_lens, query_start_loc, scale)


@triton_op(op_name("mla_attention_dense"), mutates_args={})
def _mla_attention_dense(q_lat: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor,
                         attn_mask: Optional[Tensor], is_causal: bool, scale: float) -> Tensor:
    """q_lat [B, H, T, L], q_rope [B, H, T, R], latent [B, S, L], k_rope [B, S, R] -> o_lat [B, H, T, L]. One unmasked
    query per sequence takes the Gluon kernel where ``implementation`` allows."""
    b, h, t, _ = q_lat.shape
    if t == 1 and attn_mask is None and b > 0 and \
            implementation(q_lat[:, :, 0], q_rope[:, :, 0], latent, k_rope) == GLUON:
        splits = gluon.split_count(b, h, latent.shape[1])
        return torch.ops.hybrid.mla_decode_wg_dense(q_lat[:, :, 0], q_rope[:, :, 0], latent, k_rope, float(scale),
                                                    splits).unsqueeze(2)
    impl = default_implementation(q_lat)
    fn = triton_attention.mla_attention_dense_triton if impl == TRITON else reference.mla_attention_dense_ref
    return fn(q_lat, q_rope, latent, k_rope, attn_mask, is_causal, scale)


@torch.library.custom_op(op_name("mla_decode_wg"), mutates_args=())
def mla_decode_wg(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                  num_splits: int, w_uv: Optional[Tensor] = None) -> Tensor:
    """``decode``'s contract on the Gluon kernels (``implementation`` must say GLUON). Opaque: Inductor re-emits traced
    kernels as Triton source and cannot inline a Gluon kernel, so a compiled graph calls this as it stands."""
    return gluon.decode(q_lat, q_rope, cache, cache[..., LAT:], cache.shape[1], block_table, seq_lens, scale,
                        num_splits, w_uv)


@mla_decode_wg.register_fake
def _(q_lat, q_rope, cache, block_table, seq_lens, scale, num_splits, w_uv=None):
    B, H, L = q_lat.shape
    return q_lat.new_empty((B, H, L if w_uv is None else w_uv.shape[1]))


@torch.library.custom_op(op_name("mla_decode_wg_dense"), mutates_args=())
def mla_decode_wg_dense(q_lat: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, scale: float,
                        num_splits: int) -> Tensor:
    """One-token decode over HF's dense latent cache on the Gluon kernels: q_lat [B, H, 512], q_rope [B, H, 64],
    latent [B, S, 512], k_rope [B, S, 64] -> o_lat [B, H, 512]; every key attended."""
    return gluon.decode(q_lat, q_rope, latent, k_rope, 0, None, None, scale, num_splits)


@mla_decode_wg_dense.register_fake
def _(q_lat, q_rope, latent, k_rope, scale, num_splits):
    return q_lat.new_empty(q_lat.shape)


# ------------------------------------------------------------------------------------------------------------------
# what the MLA passes emit
# ------------------------------------------------------------------------------------------------------------------
@triton_op(op_name("mla_attention"), mutates_args={})
def _mla_attention(q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, kv_b_weight: Tensor,
                   attn_mask: Optional[Tensor], is_causal: bool, scale: float) -> Tensor:
    """One DeepSeek attention from the cached latent on, over HF's dense cache: q_nope [B, H, T, P], q_rope
    [B, H, T, R], latent [B, 1, S, L], k_rope [B, 1, S, R], kv_b_weight [H*(P+V), L] -> [B, H, T, V] (what SDPA
    returned in HF's graph). HF re-expands the whole cached latent through kv_b_proj every step and runs SDPA over
    per-head K/V; this absorbs W_UK into the query and W_UV into the output (views of kv_b_weight) and attends
    MQA-style over the latent: 576 values read per cached token instead of H*(P+R+V). From EXPANDED_MIN_QUERIES
    queries (long fresh prompts) the expanded path does less work and runs instead.
    Semantics are SDPA's as HF calls it: ``is_causal`` is top-left aligned (HF sets it only with no mask and as many
    keys as queries, after cropping an empty static cache), ``attn_mask`` bool (True = attend) or additive float."""
    b, h, t, p = q_nope.shape
    lat_dim = kv_b_weight.shape[-1]
    lat = latent.reshape(b, -1, lat_dim)
    rope = k_rope.reshape(b, -1, k_rope.shape[-1])
    if is_causal:  # SDPA's causal mask is top-left: keys past the last query are never attended
        lat, rope = lat[:, :t], rope[:, :t]
    w_uk, w_uv = reference.split_kv_b(kv_b_weight, h, p)
    if t >= EXPANDED_MIN_QUERIES:
        w = kv_b_weight.view(h, -1, lat_dim)
        kv = torch.matmul(lat[:, None], w.transpose(-1, -2))  # [B, H, S, P+V]
        k = torch.cat([kv[..., :p], rope[:, None].expand(-1, h, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        return F.scaled_dot_product_attention(q, k, kv[..., p:], attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale)
    q_lat = per_head_matmul(q_nope, w_uk)  # [B, H, T, L]
    o_lat = torch.ops.hybrid.mla_attention_dense(q_lat, q_rope, lat, rope, attn_mask, is_causal, scale)
    return per_head_matmul(o_lat.to(q_nope.dtype), w_uv.transpose(-1, -2))  # [B, H, T, V]


@torch.library.custom_op(op_name("paged_gather"), mutates_args=())
def paged_gather(buf: Tensor, gather_idx: Tensor, block_table: Tensor, seq_lens: Tensor, split: int,
                 block_size: int) -> tuple[Tensor, Tensor]:
    """buf [rows, 1, L + R] (rows = blocks x block_size), gather_idx [B, S] -> (latent [B, 1, S, L], rope key
    [B, 1, S, R]): ``buf[gather_idx]`` split at ``split``. block_table / seq_lens / block_size are carried for the MLA
    pass (the paged-decode contract above)."""
    kv = buf[gather_idx].transpose(1, 2)  # [B, 1, S, L + R]
    return kv[..., :split].contiguous(), kv[..., split:].contiguous()


@paged_gather.register_fake
def _(buf, gather_idx, block_table, seq_lens, split, block_size):
    b, s = gather_idx.shape
    h, d = buf.shape[1], buf.shape[2]
    return buf.new_empty((b, h, s, split)), buf.new_empty((b, h, s, d - split))


def write_rows(buf: Tensor, slots: Tensor, latent: Tensor, k_rope: Tensor) -> None:
    """The engine's cache write of an MLA layer's new tokens, the one form ``passes/mla_step.py`` takes over: latent
    [B, 1, T, L] and k_rope [B, 1, T, R] as rows ``[latent | k_rope]`` at ``buf[slots]`` (buf [rows, 1, L + R], pages
    of one row to the op; slots [B*T])."""
    torch.ops.hybrid.mla_cache_write(buf, latent.reshape(-1, latent.shape[-1]), k_rope.reshape(-1, k_rope.shape[-1]),
                                     slots)


#: the op ``write_rows`` calls, as the decode-step pass finds it in a graph (dynamo records the packet, later stages
#: the overload)
CACHE_WRITE = (torch.ops.hybrid.mla_cache_write, torch.ops.hybrid.mla_cache_write.default)
#: the op the engine's packed-step attention calls for MLA layers (runtime/engine/attention.py), as passes/mla.py
#: finds it in a graph
PREFILL = (torch.ops.hybrid.mla_prefill, torch.ops.hybrid.mla_prefill.default)


def _attend_pages(q_lat: Tensor, q_rope: Tensor, buf: Tensor, block_table: Tensor, seq_lens: Tensor, w_uv: Tensor,
                  block_size: int, scale: float) -> Tensor:
    """Absorbed query q_lat [B, H, L] (q's dtype) -> [B, H, 1, V] over the pages. Up to
    ``CONFIGS["merge_uv"]["uv_max_batch"]`` sequences the merge kernel applies W_UV (one launch less)."""
    cache = buf.view(-1, block_size, buf.shape[-1])  # [blocks, block_size, L + R]
    b = q_lat.shape[0]
    if implementation(q_lat, q_rope[:, :, 0], cache) != REFERENCE and w_uv.dtype == q_lat.dtype \
            and w_uv.stride(2) == 1 and size_hint(b) <= triton_attention.CONFIGS["merge_uv"]["uv_max_batch"]:
        return decode(q_lat, q_rope[:, :, 0], cache, block_table, seq_lens, scale, 0, w_uv=w_uv)[:, :, None]
    o_lat = torch.ops.hybrid.mla_decode(q_lat, q_rope[:, :, 0], cache, block_table, seq_lens, scale, 0)
    return per_head_matmul(o_lat[:, :, None].to(q_lat.dtype), w_uv.transpose(-1, -2))  # [B, H, 1, V]


@triton_op(op_name("mla_attention_paged"), mutates_args={})
def _mla_attention_paged(q_nope: Tensor, q_rope: Tensor, buf: Tensor, block_table: Tensor, seq_lens: Tensor,
                         kv_b_weight: Tensor, block_size: int, scale: float) -> Tensor:
    """q_nope [B, H, 1, P], q_rope [B, H, 1, R], buf [rows, 1, L + R] in pages of ``block_size`` rows, block_table
    [B, W] int32, seq_lens [B] int32, kv_b_weight [H*(P+V), L] -> [B, H, 1, V]: what ``hybrid::mla_attention``
    returns over the gathered keys under the paged-decode contract."""
    b, h, t, p = q_nope.shape
    torch._check(t == 1, lambda: f"mla_attention_paged decodes one query token per sequence, got {t}")
    w_uk, w_uv = reference.split_kv_b(kv_b_weight, h, p)
    q_lat = per_head_matmul(q_nope, w_uk)[:, :, 0]  # [B, H, L]
    return _attend_pages(q_lat, q_rope, buf, block_table, seq_lens, w_uv, block_size, scale)


@triton_op(op_name("mla_decode_step"), mutates_args={"buf"})
def _mla_decode_step(q_nope: Tensor, q_rope: Tensor, kv: Tensor, norm_weight: Tensor, k_rope: Tensor, buf: Tensor,
                     write_slots: Tensor, block_table: Tensor, seq_lens: Tensor, kv_b_weight: Tensor, eps: float,
                     block_size: int, scale: float) -> Tensor:
    """``hybrid::mla_attention_paged`` with the step's own cache write before it: kv [B, 1, L] (the new token's
    latent before ``kv_a_layernorm``, whose weight and eps are given), k_rope [B, 1, 1, R] (after RoPE); the row
    ``[norm(kv) | k_rope]`` of sequence b is written at ``buf[write_slots[b]]``, then each sequence attends over its
    pages (triton_step.py: the norm, the write and the absorbed query are one launch)."""
    b, h, t, p = q_nope.shape
    torch._check(t == 1, lambda: f"mla_decode_step decodes one query token per sequence, got {t}")
    w_uk, w_uv = reference.split_kv_b(kv_b_weight, h, p)
    prep = triton_step.mla_step_prep_triton if default_implementation(q_nope) == TRITON else \
        reference.mla_step_prep_ref
    q_lat = prep(q_nope[:, :, 0], w_uk, kv.reshape(b, kv_b_weight.shape[-1]), norm_weight, eps, k_rope.reshape(b, -1),
                 buf, write_slots)
    return _attend_pages(q_lat, q_rope, buf, block_table, seq_lens, w_uv, block_size, scale)


def _attention_fake(q_nope, q_rope, latent, k_rope, kv_b_weight, *args):
    b, h, t, p = q_nope.shape
    return q_nope.new_empty((b, h, t, kv_b_weight.shape[0] // h - p))


def _attention_paged_fake(q_nope, q_rope, buf, block_table, seq_lens, kv_b_weight, *args):
    return _attention_fake(q_nope, q_rope, None, None, kv_b_weight)


def _decode_step_fake(q_nope, q_rope, kv, norm_weight, k_rope, buf, write_slots, block_table, seq_lens, kv_b_weight,
                      *args):
    return _attention_fake(q_nope, q_rope, None, None, kv_b_weight)


# split counts and the absorbed / expanded choice depend on sizes: the twins keep one graph for every batch
define_twin(torch.ops.hybrid.mla_attention.default, _attention_fake)
define_twin(torch.ops.hybrid.mla_attention_paged.default, _attention_paged_fake)
define_twin(torch.ops.hybrid.mla_decode_step.default, _decode_step_fake)


# ------------------------------------------------------------------------------------------------------------------
# Python wrappers
# ------------------------------------------------------------------------------------------------------------------
def mla_cache_write(cache: Tensor, latent: Tensor, k_rope: Tensor, slot_mapping: Tensor) -> None:
    torch.ops.hybrid.mla_cache_write(cache, latent, k_rope, slot_mapping)


def mla_decode(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, *,
               scale: float, num_splits: int = 0) -> Tensor:
    return torch.ops.hybrid.mla_decode(q_lat, q_rope, cache, block_table, seq_lens, float(scale), int(num_splits))


def mla_prefill(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                query_start_loc: Tensor, *, scale: float) -> Tensor:
    return torch.ops.hybrid.mla_prefill(q_lat, q_rope, cache, block_table, seq_lens, query_start_loc, float(scale))


def mla_attention_dense(q_lat: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor,
                        attn_mask: Optional[Tensor] = None, *, is_causal: bool = False, scale: float) -> Tensor:
    return torch.ops.hybrid.mla_attention_dense(q_lat, q_rope, latent, k_rope, attn_mask, bool(is_causal),
                                                float(scale))


def mla_attention(q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, kv_b_weight: Tensor,
                  attn_mask: Optional[Tensor] = None, *, is_causal: bool = False, scale: float) -> Tensor:
    return torch.ops.hybrid.mla_attention(q_nope, q_rope, latent, k_rope, kv_b_weight, attn_mask, bool(is_causal),
                                          float(scale))


def mla_attention_paged(q_nope: Tensor, q_rope: Tensor, buf: Tensor, block_table: Tensor, seq_lens: Tensor,
                        kv_b_weight: Tensor, *, block_size: int, scale: float) -> Tensor:
    if q_nope.shape[2] != 1:
        raise ValueError(f"mla_attention_paged decodes one query token per sequence, got {q_nope.shape[2]}")
    return torch.ops.hybrid.mla_attention_paged(q_nope, q_rope, buf, block_table, seq_lens, kv_b_weight,
                                                int(block_size), float(scale))


def mla_decode_step(q_nope: Tensor, q_rope: Tensor, kv: Tensor, norm_weight: Tensor, k_rope: Tensor, buf: Tensor,
                    write_slots: Tensor, block_table: Tensor, seq_lens: Tensor, kv_b_weight: Tensor, *, eps: float,
                    block_size: int, scale: float) -> Tensor:
    if q_nope.shape[2] != 1:
        raise ValueError(f"mla_decode_step decodes one query token per sequence, got {q_nope.shape[2]}")
    return torch.ops.hybrid.mla_decode_step(q_nope, q_rope, kv, norm_weight, k_rope, buf, write_slots, block_table,
                                            seq_lens, kv_b_weight, float(eps), int(block_size), float(scale))
