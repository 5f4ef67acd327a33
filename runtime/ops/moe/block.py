"""``hybrid::moe_block``: one whole HF MoE block as the MoE pass emits it.

routed experts (``hybrid::moe``) on x of any leading shape, plus the block's shared expert output when it
has one, optionally gated by ``sigmoid(shared_gate)`` (Qwen2-MoE / Qwen3-Next style). The shared expert
itself stays in the graph (plain dense MLP: Inductor's job); only its output comes in. On the GPU the add runs
in the experts' combine kernel (no launch of its own), rounded once.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from ..library import op_name, use_triton
from . import experts


@triton_op(op_name("moe_block"), mutates_args={})
def _moe_block(x: Tensor, router_w: Tensor, router_bias: Optional[Tensor], w13: Tensor, w2: Tensor,
               shared: Optional[Tensor], shared_gate: Optional[Tensor], method: str, top_k: int, renormalize: bool,
               scale: float, n_group: int, topk_group: int, gated: bool, interleaved: bool, activation: str,
               router_fp32: bool) -> Tensor:
    """x [..., H] -> [..., H] x.dtype; shared [..., H] | None; shared_gate [..., 1] | None."""
    flat = x.reshape(-1, x.shape[-1])
    if use_triton(x) and (shared is None or shared.dtype == x.dtype):  # the shared add in the experts' combine
        sh = None if shared is None else (shared.reshape(flat.shape).contiguous(),
                                          None if shared_gate is None else shared_gate.reshape(-1, 1))
        return experts.moe_triton(flat, router_w, router_bias, w13, w2, method=method, top_k=top_k,
                                  renormalize=renormalize, scale=scale, n_group=n_group, topk_group=topk_group,
                                  gated=gated, interleaved=interleaved, activation=activation,
                                  router_fp32=router_fp32, shared=sh).view(x.shape)
    out = torch.ops.hybrid.moe(flat, router_w, router_bias, w13, w2, method, top_k, renormalize, scale, n_group,
                               topk_group, gated, interleaved, activation, router_fp32).view(x.shape)
    if shared is not None:  # may come flattened ([T, H]) when the block reshaped x before the shared expert
        shared = shared.reshape(x.shape)
        if shared_gate is not None:
            shared = torch.sigmoid(shared_gate.reshape(*x.shape[:-1], 1)) * shared
        out = out + shared
    return out


def moe_block(x: Tensor, router_w: Tensor, router_bias: Optional[Tensor], w13: Tensor, w2: Tensor,
              shared: Optional[Tensor] = None, shared_gate: Optional[Tensor] = None, *, method: str, top_k: int,
              renormalize: bool = False, scale: float = 1.0, n_group: int = 1, topk_group: int = 1,
              gated: bool = True, interleaved: bool = False, activation: str = "silu",
              router_fp32: bool = False) -> Tensor:
    return torch.ops.hybrid.moe_block(x, router_w, router_bias, w13, w2, shared, shared_gate, method, top_k,
                                      renormalize, float(scale), n_group, topk_group, gated, interleaved, activation,
                                      router_fp32)
