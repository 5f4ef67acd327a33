"""Triton kernel for writing new tokens into the paged MLA latent cache.

cache [num_blocks, block_size, L+R]: token row = [latent (L) | k_rope (R)]. Slot s lives at block
s // block_size, offset s % block_size; slot -1 skips the row (padding). Traffic: N * (L+R) * e read and
written; one program per token row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from hybrid_kernels.library import pdl_opts, pdl_start


@triton.jit
def _mla_cache_write_kernel(CACHE, LAT, ROPE, SLOTS, s_cb, s_cs, s_ln, s_ld, s_rn, s_rd, L, R,
                            PAGE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                            PDL: tl.constexpr = False):
    pdl_start(PDL)
    n = tl.program_id(0)
    slot = tl.load(SLOTS + n).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    ok_l = (offs_l < L) & ((tl.zeros([BLOCK_L], dtype=tl.int64) + slot) >= 0)   # vector masks: the
    ok_r = (offs_r < R) & ((tl.zeros([BLOCK_R], dtype=tl.int64) + slot) >= 0)   # interpreter wants them
    slot = tl.maximum(slot, 0)
    base = CACHE + (slot // PAGE) * s_cb + (slot % PAGE) * s_cs
    n64 = n.to(tl.int64)
    lat = tl.load(LAT + n64 * s_ln + offs_l * s_ld, mask=ok_l)
    rope = tl.load(ROPE + n64 * s_rn + offs_r * s_rd, mask=ok_r)
    tl.store(base + offs_l, lat.to(CACHE.dtype.element_ty), mask=ok_l)
    tl.store(base + L + offs_r, rope.to(CACHE.dtype.element_ty), mask=ok_r)


def mla_cache_write_triton(cache: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
    """cache [NB, BS, L+R] (written in place), latent [N, L], k_rope [N, R], slot_mapping [N] int."""
    N, L = latent.shape
    R = k_rope.shape[-1]
    assert cache.dim() == 3 and cache.shape[-1] == L + R and cache.stride(-1) == 1, \
        f"cache must be [num_blocks, block_size, {L + R}] with contiguous rows, got {tuple(cache.shape)}"
    assert k_rope.shape[0] == N and slot_mapping.shape[0] == N, "latent, k_rope, slot_mapping disagree on N"
    if N == 0:
        return
    wrap_triton(_mla_cache_write_kernel)[(N,)](
        cache, latent, k_rope, slot_mapping, cache.stride(0), cache.stride(1),
        latent.stride(0), latent.stride(1), k_rope.stride(0), k_rope.stride(1), L, R,
        PAGE=cache.shape[1], BLOCK_L=triton.next_power_of_2(L), BLOCK_R=triton.next_power_of_2(R),
        num_warps=4, **pdl_opts(cache),
    )
