"""The attention family's op: ``hybrid::varlen_attention``, packed queries of several sequences attending to their
keys in the engine's paged buffer (the engine's packed steps, where prefill chunks and decoding sequences share one
forward). A custom op: its reference reads the sequences' lengths on the host, so the fake is registered apart."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hybrid_kernels.library import TRITON, implementation, op_name

from .reference import varlen_attention_ref
from .triton_varlen import varlen_attention_triton


@torch.library.custom_op(op_name("varlen_attention"), mutates_args=())
def varlen_attention(q: Tensor, buf: Tensor, block_table: Tensor, cu_q: Tensor, ctx: Tensor, v_dim: int,
                     block_size: int, window: int, scale: float, sinks: Optional[Tensor] = None,
                     softcap: float = 0.0) -> Tensor:
    """q [N, Hq, Dk], buf [rows, Hkv, Dv + Dk] (rows ``[v | k]``), block_table [S, blocks] int32, cu_q [S + 1] int32,
    ctx [S] int32 (each sequence's keys after the step), sinks [Hq] or None, softcap (0: none) -> [N, Hq, Dv]
    (``reference.varlen_attention_ref``)."""
    if implementation(q) == TRITON:
        return varlen_attention_triton(q, buf, block_table, cu_q, ctx, v_dim, block_size, window, scale, sinks,
                                       softcap)
    return varlen_attention_ref(q, buf, block_table, cu_q, ctx, v_dim, block_size, window, scale, sinks, softcap)


@varlen_attention.register_fake
def _(q, buf, block_table, cu_q, ctx, v_dim, block_size, window, scale, sinks=None, softcap=0.0):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)
