"""``hybrid::mla_attention``: MLA attention over HF's (dense) latent cache, as the MLA pass emits it.

Replaces, in one DeepSeek attention, everything from the latent on: HF re-expands the whole cached latent
through ``kv_b_proj`` every step and runs SDPA over per-head K/V; this op absorbs W_UK into the query and
W_UV into the output (both are views of ``kv_b_proj.weight``) and attends MQA-style over the latent
(keys = [latent | k_rope], values = latent): it reads 576 values per cached token instead of
H*(P+R+V). Long fresh prompts (many queries) take the expanded path instead, where it does less work.

Semantics are SDPA's as HF calls it: ``is_causal`` is top-left aligned (HF only sets it with no mask and
as many keys as queries, after cropping an empty static cache), ``attn_mask`` is bool (True = attend) or
additive float, ``scale`` is the module's scaling.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op

from ..library import op_name

#: queries per sequence from which the expanded path (kv_b_proj + flash SDPA) is used: absorbed attention
#: costs 2*(2L+R) FLOP per (query, key, head) against 2*(P+R+V) expanded (3.4x more at DeepSeek sizes)
EXPANDED_MIN_QUERIES = 64


@triton_op(op_name("mla_attention"), mutates_args={})
def _mla_attention(q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, kv_b_weight: Tensor,
                   attn_mask: Optional[Tensor], is_causal: bool, scale: float) -> Tensor:
    """q_nope [B, H, T, P], q_rope [B, H, T, R], latent [B, 1, S, L], k_rope [B, 1, S, R],
    kv_b_weight [H*(P+V), L] -> attention output [B, H, T, V] (what SDPA returned in HF's graph)."""
    b, h, t, p = q_nope.shape
    lat_dim = kv_b_weight.shape[-1]
    lat = latent.reshape(b, -1, lat_dim)
    rope = k_rope.reshape(b, -1, k_rope.shape[-1])
    if is_causal:  # SDPA's causal mask is top-left: keys past the last query are never attended
        lat, rope = lat[:, :t], rope[:, :t]
    w = kv_b_weight.view(h, -1, lat_dim)
    w_uk, w_uv = w[:, :p], w[:, p:]
    if t >= EXPANDED_MIN_QUERIES:
        kv = torch.matmul(lat[:, None], w.transpose(-1, -2))  # [B, H, S, P+V]
        k = torch.cat([kv[..., :p], rope[:, None].expand(-1, h, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        return F.scaled_dot_product_attention(q, k, kv[..., p:], attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale)
    q_lat = _per_head_matmul(q_nope, w_uk)  # [B, H, T, L]
    o_lat = torch.ops.hybrid.mla_attention_dense(q_lat, q_rope, lat, rope, attn_mask, is_causal, scale)
    return _per_head_matmul(o_lat.to(q_nope.dtype), w_uv.transpose(-1, -2))  # [B, H, T, V]


def _per_head_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x [B, H, T, K] @ w [H, K, N] -> [B, H, T, N] (a view) as one batched matmul over heads. A plain
    matmul would broadcast w over B and copy it B times first (B*H*K*N elements: 134 MB per call at
    DeepSeek-V2-Lite widths and B=64, 2 calls per layer, measured as half of a decode step on the H200)."""
    b, h, t, k = x.shape
    rows = x.transpose(0, 1).reshape(h, b * t, k)  # copies only the activations (small)
    return torch.bmm(rows, w).view(h, b, t, w.shape[-1]).transpose(0, 1)


def mla_attention(q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, kv_b_weight: Tensor,
                  attn_mask: Optional[Tensor] = None, *, is_causal: bool = False, scale: float) -> Tensor:
    return torch.ops.hybrid.mla_attention(q_nope, q_rope, latent, k_rope, kv_b_weight, attn_mask,
                                          bool(is_causal), float(scale))
