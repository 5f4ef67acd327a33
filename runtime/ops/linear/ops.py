"""``hybrid::linear``, ``hybrid::linear_group``, ``hybrid::gated_norm_linear``, ``hybrid::norm_linear``,
``hybrid::linear_conv``: opaque custom ops that pick their kernel per call.

The row count is only known per call (one graph serves every batch size), so the choice is made at run time:
one row on CUDA in fp16/bf16 (or up to 16 rows times an lm_head-sized weight) -> the Triton kernels (kernels.py,
``pick_config``); anything else -> ``F.linear`` (cuBLAS, or the CPU).
The fake implementations give shapes only. ``linear_group`` computes 1-3 linears of one input in one launch;
``gated_norm_linear`` is Mamba2's gated RMSNorm and out projection in one launch, ``norm_linear`` an RMSNorm (with
the residual add before it) and the linears that read it, ``linear_conv`` Mamba2's decode in projection and conv
update.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..library import op_name, use_triton
from .kernels import DTYPES, MAX_K, conv_config, linear_conv_triton, linear_triton, pick_config, silu_mul_triton
from .norm import add_rms_norm_ref, add_rms_norm_triton


def _rows(t: Tensor) -> Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _triton_rows(x: Tensor, weights: list[Tensor], bias: Optional[Tensor], prologue: str = "") -> Optional[Tensor]:
    """x as [M, K] rows when the Triton kernels take this call, else None. prologue ("gated" / "norm"): x is a norm's
    input, of any float dtype."""
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
    return _rows(x)


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


@torch.library.custom_op(op_name("gated_norm_linear"), mutates_args=())
def gated_norm_linear(x: Tensor, z: Tensor, norm_weight: Tensor, eps: float, group_size: int, weight: Tensor,
                      bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(gated_rms_norm(x, z, norm_weight, eps, group_size).to(weight.dtype), weight, bias)``: HF's
    MambaRMSNormGated then the out projection. One kernel (the norm as the linear's prologue) where the Triton
    kernels take the shape and the norm has one group; the norm op then ``hybrid::linear`` otherwise."""
    K = x.shape[-1]
    rows = None
    if group_size == K and z.shape == x.shape and norm_weight.shape == (K,) and norm_weight.stride(0) == 1:
        rows = _triton_rows(x, [weight], bias, "gated")
    if rows is None:
        from ..ssm import ops as _ssm  # noqa: F401  (registers hybrid::gated_rms_norm; ssm imports this module)
        y = torch.ops.hybrid.gated_rms_norm(x, z, norm_weight, eps, group_size)
        return torch.ops.hybrid.linear(y.to(weight.dtype), weight, bias)
    out = linear_triton(rows, [weight], bias, gate=(_rows(z), norm_weight, eps))[0]
    return out.view(*x.shape[:-1], weight.shape[0])


@gated_norm_linear.register_fake
def _(x, z, norm_weight, eps, group_size, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=weight.dtype)


@torch.library.custom_op(op_name("linear_conv"), mutates_args={"conv_state"})
def linear_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_state: Tensor, conv_weight: Tensor,
                conv_bias: Optional[Tensor], c0: int) -> tuple[Tensor, Tensor]:
    """Mamba2's decode in projection and conv update: ``y = F.linear(x, weight, bias)`` ([B, 1, N]) and
    ``causal_conv1d_update(y[..., c0:c0 + C], conv_state, conv_weight, conv_bias, "silu")`` ([B, C], conv_state
    [B, C, W] in place). One launch where the dot kernel takes the projection (the conv is its epilogue); the two
    ops otherwise."""
    C = conv_weight.shape[0]
    rows = _triton_rows(x, [weight], bias)
    cfg = None if rows is None else conv_config(rows.shape[0], weight.shape[0], rows.shape[1])
    fits = (conv_weight.dim() == 2 and conv_state.dim() == 3 and conv_state.shape[:2] == (x.numel() // x.shape[-1], C)
            and conv_weight.shape[1] <= conv_state.shape[2] and 0 <= c0 and c0 + C <= weight.shape[0]
            and conv_state.device == x.device and conv_weight.device == x.device
            and (conv_bias is None or (conv_bias.shape == (C,) and conv_bias.stride(0) == 1)))
    if cfg is not None and fits:
        y, c = linear_conv_triton(rows, weight, bias, conv_state, conv_weight, conv_bias, c0, config=cfg)
        return y.view(*x.shape[:-1], -1), c
    from ..ssm import ops as _ssm  # noqa: F401  (registers hybrid::causal_conv1d_update)
    y = torch.ops.hybrid.linear(x, weight, bias)
    xbc = y.reshape(-1, y.shape[-1])[:, c0:c0 + C]
    return y, torch.ops.hybrid.causal_conv1d_update(xbc, conv_state, conv_weight, conv_bias, "silu", None)


@linear_conv.register_fake
def _(x, weight, bias, conv_state, conv_weight, conv_bias, c0):
    rows = x.numel() // x.shape[-1]
    return (x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=weight.dtype),
            x.new_empty((rows, conv_weight.shape[0]), dtype=weight.dtype))


@torch.library.custom_op(op_name("norm_linear"), mutates_args=())
def norm_linear(x: Tensor, residual: Optional[Tensor], norm_weight: Tensor, eps: float, round_input: bool,
                weights: list[Tensor], bias: Optional[Tensor] = None, return_normed: bool = False,
                glu: bool = False) -> list[Tensor]:
    """HF's RMSNorm of x (or of the residual add s = x + residual), then the linears that read it (1-3 weights
    sharing the input; bias only with one): ``[F.linear(h, w_i, bias) ...]``, then s when residual is given, then h
    when return_normed (for other readers of the norm).
    h = norm_weight * (t * rsqrt(mean(t^2) + eps)).to(t.dtype) in the weights' dtype, t = s or x in the weights'
    dtype when round_input, else in fp32 (norm.py). One row on CUDA: one launch, the norm (and the add) as the gemv
    kernel's prologue; otherwise the norm kernel, then ``hybrid::linear`` / ``hybrid::linear_group``.
    glu (weights = [gate, up] of one shape, no bias): the first output is a gated MLP's ``silu(h @ gate^T) * (h @
    up^T)`` instead of the two linears (the gemv kernel's epilogue at one row; one more launch otherwise)."""
    K = x.shape[-1]
    wdtype = weights[0].dtype
    if glu and (len(weights) != 2 or weights[0].shape != weights[1].shape or bias is not None):
        raise ValueError("norm_linear(glu=True) takes two weights of one shape (gate, up) and no bias")
    rows = None
    if norm_weight.shape == (K,) and norm_weight.stride(0) == 1 and (residual is None or residual.shape == x.shape):
        rows = _triton_rows(x, weights, bias, "norm")
    if rows is not None:
        r = None if residual is None else _rows(residual)
        s = None if r is None else torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, r.dtype), device=x.device)
        h = torch.empty(rows.shape, dtype=wdtype, device=x.device) if return_normed else None
        ys = linear_triton(rows, weights, bias, norm=(norm_weight, eps, r, s, round_input, h), glu=glu)
        ys = [y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, weights)]
        return ys + [t.view(x.shape) for t in (s, h) if t is not None]
    if use_triton(x) and norm_weight.stride(0) == 1 and K <= MAX_K:  # the row kernel holds the row in registers
        h, s = add_rms_norm_triton(_rows(x), None if residual is None else _rows(residual), norm_weight, eps,
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
