"""``hybrid::linear`` and ``hybrid::linear_group``: opaque custom ops that pick their kernel per call.

The row count is only known per call (one graph serves every batch size), so the choice is made at run time:
one row on CUDA in fp16/bf16 (or up to 16 rows times an lm_head-sized weight) -> the Triton kernels (kernels.py,
``pick_config``); anything else -> ``F.linear`` (cuBLAS, or the CPU).
The fake implementations give shapes only. ``linear_group`` computes 1-3 linears of one input in one launch.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..library import op_name, use_triton
from .kernels import DTYPES, linear_triton, pick_config


def _triton_rows(x: Tensor, weights: list[Tensor], bias: Optional[Tensor]) -> Optional[Tensor]:
    """x as [M, K] rows when the Triton kernels take this call, else None."""
    if not use_triton(x) or x.dtype not in DTYPES or x.dim() == 0:
        return None
    if any(w.dtype != x.dtype or w.dim() != 2 or w.stride(1) != 1 or w.device != x.device for w in weights):
        return None
    if bias is not None and (bias.dtype != x.dtype or bias.shape != weights[0].shape[:1] or bias.stride(0) != 1):
        return None
    K = x.shape[-1]
    if K == 0 or pick_config(x.numel() // K, [w.shape[0] for w in weights], K) is None:
        return None
    rows = x.reshape(-1, K)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@torch.library.custom_op(op_name("linear"), mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)``."""
    rows = _triton_rows(x, [weight], bias)
    if rows is None:
        return F.linear(x, weight, bias).contiguous()
    return linear_triton(rows, [weight], bias)[0].view(*x.shape[:-1], weight.shape[0])


@linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(op_name("linear_group"), mutates_args=())
def linear_group(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """``[F.linear(x, w) for w in weights]``, in one launch where the Triton kernels take it."""
    rows = _triton_rows(x, weights, None)
    if rows is None:
        return [F.linear(x, w).contiguous() for w in weights]
    return [y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(linear_triton(rows, weights), weights)]


@linear_group.register_fake
def _(x, weights):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]
