"""``hybrid::mla_cache_write``, ``hybrid::mla_decode``, ``hybrid::mla_prefill``, ``hybrid::mla_attention_dense``:
torch.library.triton_op definitions and their Python wrappers.

Bodies run the Triton launchers on CUDA (kernels through ``wrap_triton``, so torch.compile and AOT packages
see them) and the plain torch reference elsewhere. A body is also the fake implementation: launch configs
and split counts come from shapes only.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from ..library import op_name, use_triton
from . import kernels, reference


@triton_op(op_name("mla_cache_write"), mutates_args={"cache"})
def _mla_cache_write(cache: Tensor, latent: Tensor, k_rope: Tensor, slot_mapping: Tensor) -> None:
    """cache [NB, BS, L+R] (mutated), latent [N, L], k_rope [N, R], slot_mapping [N] (-1 = skip)."""
    if use_triton(cache):
        kernels.mla_cache_write_triton(cache, latent, k_rope, slot_mapping)
    else:
        reference.mla_cache_write_ref(cache, latent, k_rope, slot_mapping)


@triton_op(op_name("mla_decode"), mutates_args={})
def _mla_decode(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                scale: float, num_splits: int) -> Tensor:
    """q_lat [B, H, L], q_rope [B, H, R], paged cache -> o_lat [B, H, L] (q dtype)."""
    fn = kernels.mla_decode_triton if use_triton(q_lat) else reference.mla_decode_ref
    return fn(q_lat, q_rope, cache, block_table, seq_lens, scale, num_splits)


@triton_op(op_name("mla_prefill"), mutates_args={})
def _mla_prefill(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                 query_start_loc: Tensor, scale: float) -> Tensor:
    """q_lat [Tq, H, L], q_rope [Tq, H, R], ragged by query_start_loc [B+1] -> o_lat [Tq, H, L]."""
    fn = kernels.mla_prefill_triton if use_triton(q_lat) else reference.mla_prefill_ref
    return fn(q_lat, q_rope, cache, block_table, seq_lens, query_start_loc, scale)


@triton_op(op_name("mla_attention_dense"), mutates_args={})
def _mla_attention_dense(q_lat: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor,
                         attn_mask: Optional[Tensor], is_causal: bool, scale: float) -> Tensor:
    """q_lat [B, H, T, L], q_rope [B, H, T, R], latent [B, S, L], k_rope [B, S, R] -> o_lat [B, H, T, L]."""
    fn = kernels.mla_attention_dense_triton if use_triton(q_lat) else reference.mla_attention_dense_ref
    return fn(q_lat, q_rope, latent, k_rope, attn_mask, is_causal, scale)


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
