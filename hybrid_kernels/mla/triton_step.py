"""The first launch of an engine MLA decode step (``hybrid::mla_decode_step``): the step's latent row written into the
pages and the query absorbed, one Triton kernel. Reference: ``reference.mla_step_prep_ref``.

HF computes, per DeepSeek attention and decode step: ``kv_a_layernorm`` over the new token's latent, the
concatenation ``[latent | k_rope]`` written into the cache, and (in hybrid's absorbed attention) the query's nope
part times W_UK per head. Compiled by Inductor these are two kernels (the norm, the cache write) plus a cuBLAS batched
matmul, each a fixed cost of 2-3 us for a few KB of data at one sequence. ``_mla_step_prep_kernel`` runs all of
them as one grid:

- programs ``0 .. n_q - 1``: q_lat[b, h, l] = sum_p q_nope[b, h, p] * W_UK[h, p, l] for a tile of BLOCK_B sequences x
  one head x BLOCK_L latent columns (tensor cores, fp32 accumulation, rounded to q's dtype as the batched matmul
  stores it). The W_UK tile (a weight) is loaded before the wait for the kernel before (programmatic dependent
  launch), so its read overlaps that kernel's tail.
- programs ``n_q .. n_q + B - 1``: one sequence's row, ``[w * round(x * rsqrt(mean(x^2) + eps)) | k_rope]`` in the
  cache's dtype (HF's RMSNorm rounding, as ``hybrid_kernels.linear.reference.add_rms_norm_ref``), stored at cache row
  ``slots[b]`` (as ``buf.index_copy_(0, slots, rows)``).

The attention kernel that follows reads the row this one wrote (a later launch on the same stream).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from hybrid_kernels.library import pdl_opts, pdl_start, size_hint

from .reference import check_step_args

#: q programs: BLOCK_L latent columns each (B=1 at DeepSeek widths: 16 heads x 4 = 64 programs, 32 KB of W_UK
#: each), up to max_block_b sequences per tile (W_UK is read once per tile of sequences)
CONFIG = dict(block_l=128, max_block_b=64, num_warps=4)


@triton.jit(do_not_specialize=["B", "N_Q"])
def _mla_step_prep_kernel(QN, W, QL, KV, NW, KR, SLOTS, CACHE,
                          s_qb, s_qh, s_wh, s_wp, s_lb, s_lh, s_kvb, s_krb, s_row,
                          B, H, P, L, R, N_Q, eps,
                          BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr,
                          BLOCK_LN: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                          PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    if pid < N_Q:
        n_l = tl.cdiv(L, BLOCK_L)
        lb = pid % n_l
        h = (pid // n_l) % H
        bb = pid // (n_l * H)
        offs_p = tl.arange(0, BLOCK_P)
        offs_l = lb * BLOCK_L + tl.arange(0, BLOCK_L)
        offs_b = bb * BLOCK_B + tl.arange(0, BLOCK_B)
        w = tl.load(W + h.to(tl.int64) * s_wh + offs_p[:, None] * s_wp + offs_l[None, :],
                    mask=(offs_p < P)[:, None] & (offs_l < L)[None, :], other=0.0)
        pdl_start(PDL)
        q = tl.load(QN + offs_b.to(tl.int64)[:, None] * s_qb + h * s_qh + offs_p[None, :],
                    mask=(offs_b < B)[:, None] & (offs_p < P)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(q, w, input_precision="ieee")
        else:
            acc = tl.dot(q, w)
        tl.store(QL + offs_b.to(tl.int64)[:, None] * s_lb + h * s_lh + offs_l[None, :],
                 acc.to(QL.dtype.element_ty), mask=(offs_b < B)[:, None] & (offs_l < L)[None, :])
    else:
        pdl_start(PDL)
        b = (pid - N_Q).to(tl.int64)
        offs = tl.arange(0, BLOCK_LN)
        ok = offs < L
        x = tl.load(KV + b * s_kvb + offs, mask=ok, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=0) / L + eps)
        y = y.to(KV.dtype.element_ty).to(tl.float32)  # HF: weight * hidden.to(input_dtype)
        g = tl.load(NW + offs, mask=ok, other=0.0).to(tl.float32)
        row = CACHE + tl.load(SLOTS + b).to(tl.int64) * s_row
        tl.store(row + offs, (g * y).to(CACHE.dtype.element_ty), mask=ok)
        offs_r = tl.arange(0, BLOCK_R)
        kr = tl.load(KR + b * s_krb + offs_r, mask=offs_r < R, other=0.0)
        tl.store(row + L + offs_r, kr.to(CACHE.dtype.element_ty), mask=offs_r < R)


def mla_step_prep_triton(q_nope: Tensor, w_uk: Tensor, kv: Tensor, norm_weight: Tensor, eps: float, k_rope: Tensor,
                         buf: Tensor, slots: Tensor) -> Tensor:
    """What ``mla_step_prep_ref`` computes, one launch. Inner dims must be contiguous (the engine's views are)."""
    check_step_args(q_nope, w_uk, kv, norm_weight, k_rope, buf, slots)
    B, H, P = q_nope.shape
    L, R = kv.shape[-1], k_rope.shape[-1]
    assert q_nope.stride(2) == 1 and w_uk.stride(2) == 1 and kv.stride(1) == 1 and k_rope.stride(1) == 1, \
        "inner dims must be contiguous"
    q_lat = torch.empty((B, H, L), device=q_nope.device, dtype=q_nope.dtype)
    block_b = min(CONFIG["max_block_b"], max(16, triton.next_power_of_2(max(size_hint(B), 1))))
    block_l = min(CONFIG["block_l"], triton.next_power_of_2(L))
    n_q = triton.cdiv(B, block_b) * H * triton.cdiv(L, block_l)
    wrap_triton(_mla_step_prep_kernel)[(n_q + B,)](
        q_nope, w_uk, q_lat, kv, norm_weight, k_rope, slots, buf,
        q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1), q_lat.stride(0), q_lat.stride(1),
        kv.stride(0), k_rope.stride(0), buf.stride(0), B, H, P, L, R, n_q, eps,
        BLOCK_B=block_b, BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_L=block_l,
        BLOCK_LN=triton.next_power_of_2(L), BLOCK_R=triton.next_power_of_2(R), IEEE=q_nope.dtype == torch.float32,
        num_warps=CONFIG["num_warps"], **pdl_opts(q_nope))
    return q_lat
