"""The MoE family's ops: ``hybrid::moe_route``, ``hybrid::moe_experts``, ``hybrid::moe`` (the routed experts of one
block) and ``hybrid::moe_block`` (a whole HF MoE block as the MoE pass emits it), their run-time twins, and Python
wrappers.

Bodies run the Triton launchers where ``implementation`` says so (kernels called through ``wrap_triton``, so
torch.compile sees them) and the plain torch reference elsewhere. A body is also the fake implementation: shapes
only, no values. Argument order: spec.py.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from hybrid_kernels.library import TRITON, define_twin, implementation, op_name

from . import reference
from .spec import ExpertsSpec, MoESpec, MoEWeights
from .triton_experts import experts_triton, moe_triton
from .triton_routing import route_triton


@triton_op(op_name("moe_route"), mutates_args={})
def _moe_route(logits: Tensor, bias: Optional[Tensor], method: str, top_k: int, renormalize: bool, scale: float,
               n_group: int, topk_group: int, jitter_eps: float) -> tuple[Tensor, Tensor]:
    """logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k])."""
    fn = route_triton if implementation(logits) == TRITON else reference.route
    return fn(logits, bias, method=method, top_k=top_k, renormalize=renormalize, scale=scale, n_group=n_group,
              topk_group=topk_group, jitter_eps=jitter_eps)


@triton_op(op_name("moe_experts"), mutates_args={})
def _moe_experts(x: Tensor, w13: Tensor, w2: Tensor, b13: Optional[Tensor], b2: Optional[Tensor], weights: Tensor,
                 ids: Tensor, gated: bool, interleaved: bool, activation: str, transposed: bool, alpha: float,
                 limit: float) -> Tensor:
    """x [T, H], w13 [E, 2I|I, H], w2 [E, H, I] (transposed: [E, H, 2I|I], [E, I, H]), biases b13 [E, 2I|I] / b2
    [E, H] or None, weights/ids [T, k] -> [T, H] x.dtype."""
    w13, w2 = _layout(w13, w2, transposed)
    fn = experts_triton if implementation(x) == TRITON else reference.experts
    return fn(x, w13, w2, weights, ids, gated=gated, interleaved=interleaved, activation=activation, b13=b13, b2=b2,
              alpha=alpha, limit=limit)


@triton_op(op_name("moe"), mutates_args={})
def _moe(x: Tensor, router_w: Tensor, router_logit_bias: Optional[Tensor], router_bias: Optional[Tensor], w13: Tensor,
         w2: Tensor, b13: Optional[Tensor], b2: Optional[Tensor], method: str, top_k: int, renormalize: bool,
         scale: float, n_group: int, topk_group: int, router_fp32: bool, jitter_eps: float, gated: bool,
         interleaved: bool, activation: str, transposed: bool, alpha: float, limit: float) -> Tensor:
    """Routed experts of one MoE block: x [T, H] -> [T, H] x.dtype (shared experts excluded). Tensors: spec.MoEWeights."""
    spec = MoESpec.from_args(method, top_k, renormalize, scale, n_group, topk_group, router_fp32, jitter_eps,
                             gated, interleaved, activation, transposed, alpha, limit)
    w13, w2 = _layout(w13, w2, transposed)
    router_bias = None if router_bias is None else router_bias.reshape(-1)  # [E] (some routers keep [1, E])
    fn = moe_triton if implementation(x) == TRITON else reference.moe
    return fn(x, router_w, router_bias, w13, w2, **spec.kwargs(), router_logit_bias=router_logit_bias, b13=b13, b2=b2)


@triton_op(op_name("moe_block"), mutates_args={})
def _moe_block(x: Tensor, router_w: Tensor, router_logit_bias: Optional[Tensor], router_bias: Optional[Tensor],
               w13: Tensor, w2: Tensor, b13: Optional[Tensor], b2: Optional[Tensor], shared: Optional[Tensor],
               shared_gate: Optional[Tensor], method: str, top_k: int, renormalize: bool, scale: float, n_group: int,
               topk_group: int, router_fp32: bool, jitter_eps: float, gated: bool, interleaved: bool, activation: str,
               transposed: bool, alpha: float, limit: float) -> Tensor:
    """A whole block: x [..., H] -> [..., H] x.dtype; shared [..., H] | None (the block's shared expert output,
    computed in the graph: a plain dense MLP is Inductor's job); shared_gate [..., 1] | None (``sigmoid(gate) *
    shared``, Qwen2-MoE style). On the GPU the shared add runs in the experts' combine kernel, rounded once."""
    spec = MoESpec.from_args(method, top_k, renormalize, scale, n_group, topk_group, router_fp32, jitter_eps,
                             gated, interleaved, activation, transposed, alpha, limit)
    flat = x.reshape(-1, x.shape[-1])
    weights = MoEWeights(router_w, router_logit_bias, router_bias, w13, w2, b13, b2)
    if implementation(x) == TRITON and (shared is None or shared.dtype == x.dtype):
        sh = None if shared is None else (shared.reshape(flat.shape).contiguous(),
                                          None if shared_gate is None else shared_gate.reshape(-1, 1))
        lw13, lw2 = _layout(w13, w2, transposed)
        return moe_triton(flat, router_w, None if router_bias is None else router_bias.reshape(-1), lw13, lw2, **spec.kwargs(), router_logit_bias=router_logit_bias,
                          b13=b13, b2=b2, shared=sh).view(x.shape)
    out = torch.ops.hybrid.moe(*spec.moe_args(flat, weights)).view(x.shape)
    if shared is not None:  # may come flattened ([T, H]) when the block reshaped x before the shared expert
        shared = shared.reshape(x.shape)
        if shared_gate is not None:
            shared = torch.sigmoid(shared_gate.reshape(*x.shape[:-1], 1)) * shared
        out = out + shared
    return out


def _layout(w13: Tensor, w2: Tensor, transposed: bool) -> tuple[Tensor, Tensor]:
    """The expert weights as [E, out, in] (views: the kernels read them through strides)."""
    return (w13.transpose(1, 2), w2.transpose(1, 2)) if transposed else (w13, w2)


def _same_as_x_fake(x, *args):
    return x.new_empty(x.shape)


# launch configs per token bucket: the twins keep one graph for every batch size
define_twin(torch.ops.hybrid.moe_block.default, _same_as_x_fake)
define_twin(torch.ops.hybrid.moe_experts.default, _same_as_x_fake)


def moe_route(logits: Tensor, bias: Optional[Tensor] = None, *, method: str, top_k: int, renormalize: bool = False,
              scale: float = 1.0, n_group: int = 1, topk_group: int = 1,
              jitter_eps: float = 0.0) -> tuple[Tensor, Tensor]:
    return torch.ops.hybrid.moe_route(logits, bias, method, top_k, renormalize, float(scale), n_group, topk_group,
                                      float(jitter_eps))


def moe_experts(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, experts: ExpertsSpec | None = None,
                b13: Optional[Tensor] = None, b2: Optional[Tensor] = None) -> Tensor:
    return torch.ops.hybrid.moe_experts(x, w13, w2, b13, b2, weights, ids, *(experts or ExpertsSpec()).static())


def moe(x: Tensor, weights: MoEWeights, spec: MoESpec) -> Tensor:
    return torch.ops.hybrid.moe(*spec.moe_args(x, weights))


def moe_block(x: Tensor, weights: MoEWeights, spec: MoESpec, shared: Optional[Tensor] = None,
              shared_gate: Optional[Tensor] = None) -> Tensor:
    return torch.ops.hybrid.moe_block(*spec.block_args(x, weights, shared, shared_gate))
