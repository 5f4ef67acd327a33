"""MLA decode over the engine's paged latent cache, as the MLA pass finds it in a decode graph.

``hybrid::paged_gather`` is what the engine's cache layer returns from HF's ``cache.update`` on a decode
step of an MLA model, in place of ``buf[gather_idx]``: the same two tensors (the step's cached latent and
rope key, [B, 1, S, L] and [B, 1, S, R]), but the node also carries the step's block table and sequence
lengths. Contract (kept by ``runtime/engine/model_runner.py``, the only caller): the keys row b may attend
are positions 0..seq_lens[b]-1, stored at ``block_table[b, p // block_size] * block_size + p % block_size``
of the buffer; ``gather_idx`` lists the same rows, and the step's attention mask masks out every other key.

The MLA pass (passes/mla.py), when a one-token decode's latent and rope key come straight from this op,
emits ``hybrid::mla_decode_step`` (when it also proves the step's cache write and kv_a_layernorm, which the op then
does itself) or ``hybrid::mla_attention_paged`` instead of ``hybrid::mla_attention``: W_UK absorbed into the query,
split-KV ``hybrid::mla_decode`` over the pages in place, W_UV applied to the output (by the split-KV merge
kernel itself at up to ``CONFIGS["merge_uv"]["uv_max_batch"]`` sequences, kernels.py). The gather (a copy of
every cached token, then read again) disappears from the graph; each cached token's L + R values are read
once. The attention mask is not read: by the contract above it says what seq_lens says. The engine's tests hold
the contract to account end to end (greedy tokens equal HF generate's through this op, tests/test_engine.py).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from ..library import op_name, size_hint, use_triton
from . import kernels, step
from .dropin import _per_head_matmul


@torch.library.custom_op(op_name("paged_gather"), mutates_args=())
def paged_gather(buf: Tensor, gather_idx: Tensor, block_table: Tensor, seq_lens: Tensor, split: int,
                 block_size: int) -> tuple[Tensor, Tensor]:
    """buf [rows, 1, L + R] (rows = blocks x block_size), gather_idx [B, S] -> (latent [B, 1, S, L],
    rope key [B, 1, S, R]): ``buf[gather_idx]`` split at ``split``. block_table / seq_lens / block_size are
    carried for the MLA pass (see the module docstring)."""
    kv = buf[gather_idx].transpose(1, 2)  # [B, 1, S, L + R]
    return kv[..., :split].contiguous(), kv[..., split:].contiguous()


@paged_gather.register_fake
def _(buf, gather_idx, block_table, seq_lens, split, block_size):
    b, s = gather_idx.shape
    h, d = buf.shape[1], buf.shape[2]
    return buf.new_empty((b, h, s, split)), buf.new_empty((b, h, s, d - split))


@triton_op(op_name("mla_attention_paged"), mutates_args={})
def _mla_attention_paged(q_nope: Tensor, q_rope: Tensor, buf: Tensor, block_table: Tensor, seq_lens: Tensor,
                         kv_b_weight: Tensor, block_size: int, scale: float) -> Tensor:
    """q_nope [B, H, 1, P], q_rope [B, H, 1, R], buf [rows, 1, L + R] in pages of ``block_size`` rows,
    block_table [B, W] int32, seq_lens [B] int32, kv_b_weight [H*(P+V), L] -> [B, H, 1, V]: what
    ``hybrid::mla_attention`` returns over the gathered keys under the contract above."""
    b, h, t, p = q_nope.shape
    torch._check(t == 1, lambda: f"mla_attention_paged decodes one query token per sequence, got {t}")
    w_uk, w_uv = _split_kv_b(kv_b_weight, h, p)
    q_lat = _per_head_matmul(q_nope, w_uk)[:, :, 0]  # [B, H, L]
    return _attend(q_lat, q_rope, buf, block_table, seq_lens, w_uv, block_size, scale)


@triton_op(op_name("mla_decode_step"), mutates_args={"buf"})
def _mla_decode_step(q_nope: Tensor, q_rope: Tensor, kv: Tensor, norm_weight: Tensor, k_rope: Tensor, buf: Tensor,
                     write_slots: Tensor, block_table: Tensor, seq_lens: Tensor, kv_b_weight: Tensor, eps: float,
                     block_size: int, scale: float) -> Tensor:
    """``hybrid::mla_attention_paged`` with the step's own cache write before it: kv [B, 1, L] (the new token's
    latent before ``kv_a_layernorm``, whose weight and eps are given), k_rope [B, 1, 1, R] (after RoPE); the row
    ``[norm(kv) | k_rope]`` of sequence b is written at ``buf[write_slots[b]]``, then each sequence attends over its
    pages (step.py: the norm, the write and the absorbed query are one launch)."""
    b, h, t, p = q_nope.shape
    torch._check(t == 1, lambda: f"mla_decode_step decodes one query token per sequence, got {t}")
    lat_dim = kv_b_weight.shape[-1]
    w_uk, w_uv = _split_kv_b(kv_b_weight, h, p)
    prep = step.mla_step_prep_triton if use_triton(q_nope) else step.mla_step_prep_ref
    q_lat = prep(q_nope[:, :, 0], w_uk, kv.reshape(b, lat_dim), norm_weight, eps, k_rope.reshape(b, -1), buf,
                 write_slots)
    return _attend(q_lat, q_rope, buf, block_table, seq_lens, w_uv, block_size, scale)


def _split_kv_b(kv_b_weight: Tensor, h: int, p: int) -> tuple[Tensor, Tensor]:
    """kv_b_weight [H*(P+V), L] -> (W_UK [H, P, L], W_UV [H, V, L]), views."""
    w = kv_b_weight.view(h, -1, kv_b_weight.shape[-1])
    return w[:, :p], w[:, p:]


def _attend(q_lat: Tensor, q_rope: Tensor, buf: Tensor, block_table: Tensor, seq_lens: Tensor, w_uv: Tensor,
            block_size: int, scale: float) -> Tensor:
    """Absorbed query q_lat [B, H, L] (q's dtype) -> [B, H, 1, V] over the pages."""
    b = q_lat.shape[0]
    cache = buf.view(-1, block_size, buf.shape[-1])  # [blocks, block_size, L + R]
    if use_triton(q_lat) and size_hint(b) <= kernels.CONFIGS["merge_uv"]["uv_max_batch"] \
            and w_uv.dtype == q_lat.dtype and w_uv.stride(2) == 1:  # W_UV in the merge kernel (one launch less)
        return kernels.mla_decode_triton(q_lat, q_rope[:, :, 0], cache, block_table, seq_lens, scale,
                                         w_uv=w_uv)[:, :, None]
    o_lat = torch.ops.hybrid.mla_decode(q_lat, q_rope[:, :, 0], cache, block_table, seq_lens, scale, 0)
    return _per_head_matmul(o_lat[:, :, None].to(q_lat.dtype), w_uv.transpose(-1, -2))  # [B, H, 1, V]


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
