"""``hybrid::moe_route``, ``hybrid::moe_experts``, ``hybrid::moe``: torch.library.triton_op definitions.

Bodies run the Triton launchers on CUDA (kernels called through ``wrap_triton``, so torch.compile sees them)
and the plain torch reference elsewhere. A body is also the fake implementation: shapes only, no values.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from ..library import op_name, use_triton
from . import experts, reference, routing


@triton_op(op_name("moe_route"), mutates_args={})
def _moe_route(logits: Tensor, bias: Optional[Tensor], method: str, top_k: int, renormalize: bool, scale: float,
               n_group: int, topk_group: int) -> tuple[Tensor, Tensor]:
    """logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k])."""
    fn = routing.route_triton if use_triton(logits) else reference.route
    return fn(logits, bias, method=method, top_k=top_k, renormalize=renormalize, scale=scale, n_group=n_group,
              topk_group=topk_group)


@triton_op(op_name("moe_experts"), mutates_args={})
def _moe_experts(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, gated: bool, interleaved: bool,
                 activation: str) -> Tensor:
    """x [T, H], w13 [E, 2I|I, H], w2 [E, H, I], weights/ids [T, k] -> [T, H] x.dtype."""
    fn = experts.experts_triton if use_triton(x) else reference.experts
    return fn(x, w13, w2, weights, ids, gated=gated, interleaved=interleaved, activation=activation)


@triton_op(op_name("moe"), mutates_args={})
def _moe(x: Tensor, router_w: Tensor, router_bias: Optional[Tensor], w13: Tensor, w2: Tensor, method: str,
         top_k: int, renormalize: bool, scale: float, n_group: int, topk_group: int, gated: bool, interleaved: bool,
         activation: str, router_fp32: bool) -> Tensor:
    """Routed experts of one MoE block: x [T, H] -> [T, H] x.dtype (shared experts excluded)."""
    fn = experts.moe_triton if use_triton(x) else reference.moe
    return fn(x, router_w, router_bias, w13, w2, method=method, top_k=top_k, renormalize=renormalize, scale=scale,
              n_group=n_group, topk_group=topk_group, gated=gated, interleaved=interleaved, activation=activation,
              router_fp32=router_fp32)


def moe_route(logits: Tensor, bias: Optional[Tensor] = None, *, method: str, top_k: int, renormalize: bool = False,
              scale: float = 1.0, n_group: int = 1, topk_group: int = 1) -> tuple[Tensor, Tensor]:
    return torch.ops.hybrid.moe_route(logits, bias, method, top_k, renormalize, float(scale), n_group, topk_group)


def moe_experts(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, *, gated: bool = True,
                interleaved: bool = False, activation: str = "silu") -> Tensor:
    return torch.ops.hybrid.moe_experts(x, w13, w2, weights, ids, gated, interleaved, activation)


def moe(x: Tensor, router_w: Tensor, router_bias: Optional[Tensor], w13: Tensor, w2: Tensor, *, method: str,
        top_k: int, renormalize: bool = False, scale: float = 1.0, n_group: int = 1, topk_group: int = 1,
        gated: bool = True, interleaved: bool = False, activation: str = "silu", router_fp32: bool = False) -> Tensor:
    return torch.ops.hybrid.moe(x, router_w, router_bias, w13, w2, method, top_k, renormalize, float(scale),
                                n_group, topk_group, gated, interleaved, activation, router_fp32)
