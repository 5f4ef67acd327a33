"""``hybrid::`` SSM ops (torch.library.triton_op) and their Python wrappers.

Each body runs the Triton launcher when ``use_triton`` says so (CUDA, or the interpreter on CPU with
HYBRID_TRITON_ON_CPU=1) and the torch reference otherwise. Bodies only allocate and launch, so they double
as the fake implementation. State updates mutate their state argument (declared in ``mutates_args``).
"""
from typing import Optional

import torch
from torch import Tensor

from ..library import op_name, use_triton
from . import kernels, reference


@torch.library.triton_op(op_name("causal_conv1d"), mutates_args=())
def _causal_conv1d(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor], activation: str,
    state_width: int,
) -> tuple[Tensor, Tensor]:
    if use_triton(x):
        return kernels.causal_conv1d_triton(x, weight, bias, initial_state, activation, state_width)
    return reference.causal_conv1d_ref(x, weight, bias, initial_state, activation, state_width)


@torch.library.triton_op(op_name("causal_conv1d_update"), mutates_args={"conv_state"})
def _causal_conv1d_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
    state_indices: Optional[Tensor],
) -> Tensor:
    if use_triton(x):
        return kernels.causal_conv1d_update_triton(x, conv_state, weight, bias, activation, state_indices)
    return reference.causal_conv1d_update_ref(x, conv_state, weight, bias, activation, state_indices)


@torch.library.triton_op(op_name("selective_scan"), mutates_args=())
def _selective_scan(
    u: Tensor, delta: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    delta_bias: Optional[Tensor], delta_softplus: bool, initial_state: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    fn = kernels.selective_scan_triton if use_triton(u) else reference.selective_scan_ref
    return fn(u, delta, A, Bm, Cm, D, z, delta_bias, delta_softplus, initial_state)


@torch.library.triton_op(op_name("selective_state_update"), mutates_args={"state"})
def _selective_state_update(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, state_indices: Optional[Tensor],
) -> Tensor:
    fn = kernels.selective_state_update_triton if use_triton(x) else reference.selective_state_update_ref
    return fn(state, x, dt, A, Bm, Cm, D, z, dt_bias, dt_softplus, state_indices)


@torch.library.triton_op(op_name("ssd_scan"), mutates_args=())
def _ssd_scan(
    x: Tensor, dt: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, chunk_size: int, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, dt_min: float, dt_max: float,
    initial_states: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    fn = kernels.ssd_scan_triton if use_triton(x) else reference.ssd_scan_ref
    return fn(x, dt, A, Bm, Cm, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states)


@torch.library.triton_op(op_name("ssd_state_update"), mutates_args={"state"})
def _ssd_state_update(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, dt_min: float, dt_max: float,
    state_indices: Optional[Tensor], A_is_log: bool = False,
) -> Tensor:
    fn = kernels.ssd_state_update_triton if use_triton(x) else reference.ssd_state_update_ref
    return fn(state, x, dt, A, Bm, Cm, D, z, dt_bias, dt_softplus, dt_min, dt_max, state_indices, A_is_log)


@torch.library.triton_op(op_name("gated_rms_norm"), mutates_args=())
def _gated_rms_norm(x: Tensor, z: Optional[Tensor], weight: Tensor, eps: float, group_size: int) -> Tensor:
    if use_triton(x):
        return kernels.gated_rms_norm_triton(x, z, weight, eps, group_size)
    return reference.gated_rms_norm_ref(x, z, weight, eps, group_size)


# ---------------------------------------------------------------------------------------------------------
# Python wrappers (keyword defaults; the graph pass may call torch.ops.hybrid.* directly)


def causal_conv1d(x, weight, bias=None, initial_state=None, activation="silu", state_width=None):
    """x [B, C, T], weight [C, K] -> (y [B, C, T], final_state [B, C, W]); W defaults to K (HF's cache)."""
    w = weight.shape[1] if state_width is None else state_width
    return torch.ops.hybrid.causal_conv1d(x, weight, bias, initial_state, activation, w)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation="silu", state_indices=None):
    """x [B, C]; conv_state [S, C, W] updated in place -> y [B, C]."""
    return torch.ops.hybrid.causal_conv1d_update(x, conv_state, weight, bias, activation, state_indices)


def selective_scan(u, delta, A, Bm, Cm, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None):
    """Mamba1 scan: u/delta/z [B, D, T], A [D, N], B/C [B, N, T] -> (y [B, D, T], final [B, D, N] fp32)."""
    return torch.ops.hybrid.selective_scan(u, delta, A, Bm, Cm, D, z, delta_bias, delta_softplus, initial_state)


def selective_state_update(state, x, dt, A, Bm, Cm, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_indices=None):
    """Mamba1 decode: state [S, D, N] updated in place; x/dt/z [B, D], B/C [B, N] -> y [B, D]."""
    return torch.ops.hybrid.selective_state_update(state, x, dt, A, Bm, Cm, D, z, dt_bias, dt_softplus,
                                                   state_indices)


def ssd_scan(x, dt, A, Bm, Cm, chunk_size=256, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_min=0.0, dt_max=float("inf"), initial_states=None):
    """Mamba2 SSD: x [B, T, H, P], dt [B, T, H], B/C [B, T, G, N] -> (y [B, T, H, P], final [B, H, P, N])."""
    return torch.ops.hybrid.ssd_scan(x, dt, A, Bm, Cm, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max,
                                     initial_states)


def ssd_state_update(state, x, dt, A, Bm, Cm, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=0.0,
                     dt_max=float("inf"), state_indices=None, A_is_log=False):
    """Mamba2 decode: state [S, H, P, N] updated in place; x [B, H, P], dt [B, H], B/C [B, G, N]; A [H] (or
    HF's A_log with A_is_log: A = -exp(A_log))."""
    return torch.ops.hybrid.ssd_state_update(state, x, dt, A, Bm, Cm, D, z, dt_bias, dt_softplus, dt_min,
                                             dt_max, state_indices, A_is_log)


def gated_rms_norm(x, z, weight, eps=1e-6, group_size=None):
    """HF MambaRMSNormGated; group_size defaults to the whole last dim."""
    gs = x.shape[-1] if group_size is None else group_size
    return torch.ops.hybrid.gated_rms_norm(x, z, weight, eps, gs)
