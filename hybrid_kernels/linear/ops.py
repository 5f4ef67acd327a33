"""``hybrid::linear``, ``hybrid::linear_group``, ``hybrid::norm_linear``: opaque custom ops that pick their kernel
per call.

The row count is only known per call (one graph serves every batch size), so the choice is made at run time by
``implementation``: one row on CUDA in fp16/bf16 (or up to 16 rows times an lm_head-sized weight) -> the Triton
kernels (triton_gemv.py, ``pick_config``); anything else -> ``F.linear`` (cuBLAS, or the CPU).
The fake implementations give shapes only. ``linear_group`` computes 1-3 linears of one input in one launch;
``norm_linear`` an RMSNorm (with the residual add before it) and the linears that read it. Mamba2's fused decode
projections (``hybrid::gated_norm_linear``, ``hybrid::linear_conv``) are SSM ops built on these kernels
(hybrid_kernels/ssm/ops.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from hybrid_kernels.library import op_name, use_triton

from .reference import add_rms_norm_ref
from .triton_gemv import DTYPES, MAX_K, linear_triton, pick_config, silu_mul_triton
from .triton_norm import add_rms_norm_triton


def rows_of(t: Tensor) -> Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def implementation(x: Tensor, weights: list[Tensor], bias: Optional[Tensor], prologue: str = "") -> Optional[Tensor]:
    """The linear family's choice for a call: x as [M, K] rows when the Triton kernels take it, else None (F.linear,
    or the norm then F.linear). prologue ("gated" / "norm"): x is a norm's input, of any float dtype."""
    if not use_triton(x) or x.dim() == 0 or not (x.dtype in DTYPES or prologue and x.is_floating_point()):
        return None
    dtype = weights[0].dtype if prologue else x.dtype
    if dtype not in DTYPES:
        return None
    if any(w.dtype != dtype or w.dim() != 2 or w.stride(1) != 1 or w.device != x.device for w in weights):
        return None
    if bias is not None and (bias.dtype != dtype or bias.shape != weights[0].shape[:1] or bias.stride(0) != 1):
        return None
    K = x.shape[-1]
    if K == 0 or pick_config(x.numel() // K, [w.shape[0] for w in weights], K, prologue == "gated",
                             prologue == "norm") is None:
        return None
    return rows_of(x)


@torch.library.custom_op(op_name("linear"), mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)``."""
    rows = implementation(x, [weight], bias)
    if rows is None:
        return F.linear(x, weight, bias).contiguous()
    return linear_triton(rows, [weight], bias)[0].view(*x.shape[:-1], weight.shape[0])


@linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(op_name("linear_group"), mutates_args=())
def linear_group(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """``[F.linear(x, w) for w in weights]``, in one launch where the Triton kernels take it."""
    rows = implementation(x, weights, None)
    if rows is None:
        return [F.linear(x, w).contiguous() for w in weights]
    return [y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(linear_triton(rows, weights), weights)]


@linear_group.register_fake
def _(x, weights):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


@torch.library.custom_op(op_name("norm_linear"), mutates_args=())
def norm_linear(x: Tensor, residual: Optional[Tensor], norm_weight: Tensor, eps: float, round_input: bool,
                weights: list[Tensor], bias: Optional[Tensor] = None, return_normed: bool = False,
                glu: bool = False) -> list[Tensor]:
    """HF's RMSNorm of x (or of the residual add s = x + residual), then the linears that read it (1-3 weights
    sharing the input; bias only with one): ``[F.linear(h, w_i, bias) ...]``, then s when residual is given, then h
    when return_normed (for other readers of the norm).
    h = norm_weight * (t * rsqrt(mean(t^2) + eps)).to(t.dtype) in the weights' dtype, t = s or x in the weights'
    dtype when round_input, else in fp32 (reference.py). One row on CUDA: one launch, the norm (and the add) as the gemv
    kernel's prologue; otherwise the norm kernel, then ``hybrid::linear`` / ``hybrid::linear_group``.
    glu (weights = [gate, up] of one shape, no bias): the first output is a gated MLP's ``silu(h @ gate^T) * (h @
    up^T)`` instead of the two linears (the gemv kernel's epilogue at one row; one more launch otherwise)."""
    K = x.shape[-1]
    wdtype = weights[0].dtype
    if glu and (len(weights) != 2 or weights[0].shape != weights[1].shape or bias is not None):
        raise ValueError("norm_linear(glu=True) takes two weights of one shape (gate, up) and no bias")
    rows = None
    if norm_weight.shape == (K,) and norm_weight.stride(0) == 1 and (residual is None or residual.shape == x.shape):
        rows = implementation(x, weights, bias, "norm")
    if rows is not None:
        r = None if residual is None else rows_of(residual)
        s = None if r is None else torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, r.dtype), device=x.device)
        h = torch.empty(rows.shape, dtype=wdtype, device=x.device) if return_normed else None
        ys = linear_triton(rows, weights, bias, norm=(norm_weight, eps, r, s, round_input, h), glu=glu)
        ys = [y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, weights)]
        return ys + [t.view(x.shape) for t in (s, h) if t is not None]
    if use_triton(x) and norm_weight.stride(0) == 1 and K <= MAX_K:  # the row kernel holds the row in registers
        h, s = add_rms_norm_triton(rows_of(x), None if residual is None else rows_of(residual), norm_weight, eps,
                                   round_input, wdtype)
        h = h.view(x.shape)
        s = None if s is None else s.view(x.shape)
    else:
        h, s = add_rms_norm_ref(x, residual, norm_weight, eps, round_input, wdtype)
    if len(weights) == 1:
        ys = [torch.ops.hybrid.linear(h, weights[0], bias)]
    else:
        assert bias is None, "bias only with one weight"
        ys = list(torch.ops.hybrid.linear_group(h, weights))
    if glu:
        g, u = ys
        ys = [silu_mul_triton(g, u) if use_triton(g) and g.dtype in DTYPES else F.silu(g) * u]
    return ys + ([] if s is None else [s.contiguous()]) + ([h.contiguous()] if return_normed else [])


@norm_linear.register_fake
def _(x, residual, norm_weight, eps, round_input, weights, bias=None, return_normed=False, glu=False):
    ys = [x.new_empty((*x.shape[:-1], w.shape[0]), dtype=w.dtype) for w in weights[:1 if glu else None]]
    if residual is not None:
        ys.append(x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype)))
    return ys + ([x.new_empty(x.shape, dtype=weights[0].dtype)] if return_normed else [])
