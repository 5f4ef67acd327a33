"""The delta-rule family's ``hybrid::`` ops: the gated delta rule over a prompt (``delta_rule``) and its in-place
decode step (``delta_rule_step``), for a decay per value head (Gated DeltaNet) or per key channel (Kimi Delta
Attention). Shapes and semantics: reference.py.

Both are opaque custom ops with shape-only fakes: the chunk table and the choice of kernel depend on sizes and
values, and none of it may become a guard or a graph of its own. ``implementation`` picks the Triton kernels
(CUDA, or the interpreter with HYBRID_TRITON_ON_CPU=1) or the torch reference.
"""
from typing import Optional

import torch
from torch import Tensor

from hybrid_kernels.library import TRITON, implementation, op_name

from . import reference
from .triton_chunk import delta_rule_chunk_triton
from .triton_step import delta_rule_step_triton

#: prompts up to this many tokens run token by token (one launch, no scratch); longer ones in chunks
RECURRENT_MAX_T = 16


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    B, T, HV, V = v.shape
    HK, K = k.shape[2], k.shape[3]
    if q.shape != k.shape or k.shape[:2] != (B, T) or HV % HK:
        raise ValueError(f"delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not agree")
    if g.shape[:3] != (B, T, HV) or (g.dim() == 4 and g.shape[3] != K) or beta.shape != (B, T, HV):
        raise ValueError(f"delta rule: g {tuple(g.shape)} / beta {tuple(beta.shape)} do not match v {tuple(v.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError("delta rule: cu_seqlens packs sequences along T, so the batch must be 1")


@torch.library.custom_op(op_name("delta_rule"), mutates_args=())
def _delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], use_l2norm: bool
                ) -> tuple[Tensor, Tensor]:
    """-> (o [B, T, HV, V] in v's dtype, final states [N, HV, K, V] fp32)."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    short = cu_seqlens is None and v.shape[1] <= RECURRENT_MAX_T
    if implementation(v) == TRITON:
        if short:
            final = torch.empty(v.shape[0], v.shape[2], k.shape[3], v.shape[3], dtype=torch.float32,
                                device=v.device)
            h0 = None if initial_state is None else initial_state.float().contiguous()
            return delta_rule_step_triton(q, k, v, g, beta, scale, h0, final, None, use_l2norm), final
        return delta_rule_chunk_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_l2norm)
    fn = reference.delta_rule_recurrent if short else reference.delta_rule_chunked
    return fn(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_l2norm)


@_delta_rule.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_l2norm):
    n = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (torch.empty_like(v, memory_format=torch.contiguous_format),
            v.new_empty((n, v.shape[2], k.shape[3], v.shape[3]), dtype=torch.float32))


@torch.library.custom_op(op_name("delta_rule_step"), mutates_args={"state"})
def _delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, state: Tensor,
                     state_indices: Optional[Tensor], use_l2norm: bool) -> Tensor:
    """Decode: T tokens (usually 1) per batch row from the row's state slot, the slot updated in place."""
    _check(q, k, v, g, beta, None, None)
    if implementation(v) == TRITON:
        return delta_rule_step_triton(q, k, v, g, beta, scale, state, state, state_indices, use_l2norm)
    return reference.delta_rule_step_ref(q, k, v, g, beta, scale, state, state_indices, use_l2norm)


@_delta_rule_step.register_fake
def _(q, k, v, g, beta, scale, state, state_indices, use_l2norm):
    return torch.empty_like(v, memory_format=torch.contiguous_format)


def delta_rule(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_l2norm=True):
    """The gated delta rule over whole prompts; ``scale`` defaults to K ** -0.5."""
    s = k.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.hybrid.delta_rule(q, k, v, g, beta, s, initial_state, cu_seqlens, use_l2norm)


def delta_rule_step(q, k, v, g, beta, state, scale=None, state_indices=None, use_l2norm=True):
    """One decode step (or a few tokens) per row; ``state`` [S, HV, K, V] fp32 updated in place."""
    s = k.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.hybrid.delta_rule_step(q, k, v, g, beta, s, state, state_indices, use_l2norm)
