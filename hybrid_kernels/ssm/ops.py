"""The SSM family's ``hybrid::`` ops and their Python wrappers: causal conv1d, the Mamba1 selective scan, the Mamba2
SSD chunked scan, their decode updates, the gated RMSNorm, Mamba2's fused decode projections, and whole mixers.

Each primitive's body runs the Triton launcher when ``implementation`` says so (CUDA, or the interpreter on CPU with
HYBRID_TRITON_ON_CPU=1) and the torch reference otherwise. Bodies only allocate and launch, so they double as the
fake implementation. State updates mutate their state argument (declared in ``mutates_args``). The mixer ops'
bodies are in mixer.py; their argument order is built by spec.py.
"""
from typing import Optional

import torch
from torch import Tensor

from hybrid_kernels.library import TRITON, define_twin, implementation, op_name
from hybrid_kernels.linear.ops import implementation as linear_rows
from hybrid_kernels.linear.ops import rows_of
from hybrid_kernels.linear.triton_gemv import conv_config, linear_conv_triton, linear_triton

from . import mixer, reference
from .spec import Mamba1Weights, Mamba2Weights
from .triton_conv import causal_conv1d_triton, causal_conv1d_update_triton
from .triton_norm import gated_rms_norm_triton
from .triton_scan import selective_scan_triton, selective_state_update_triton
from .triton_ssd import ssd_scan_triton, ssd_state_update_triton


def _triton(t: Tensor) -> bool:
    return implementation(t) == TRITON


@torch.library.custom_op(op_name("linear_scan_ref"), mutates_args=())
def _linear_scan_ref(a: Tensor, b: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """The references' inclusive scan h_t = a_t * h_{t-1} + b_t (reference.linear_scan_doubling). Opaque with a
    shape-only fake: the doubling loop runs log2(T) times, and traced into a graph (an op body that calls the
    reference under torch.compile) it would make the graph specialise on T."""
    return reference.linear_scan_doubling(a, b, dim)


@_linear_scan_ref.register_fake
def _(a, b, dim):
    return torch.empty_like(a), torch.empty_like(b)


@torch.library.triton_op(op_name("causal_conv1d"), mutates_args=())
def _causal_conv1d(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor], activation: str,
    state_width: int,
) -> tuple[Tensor, Tensor]:
    if _triton(x):
        return causal_conv1d_triton(x, weight, bias, initial_state, activation, state_width)
    return reference.causal_conv1d_ref(x, weight, bias, initial_state, activation, state_width)


@torch.library.triton_op(op_name("causal_conv1d_update"), mutates_args={"conv_state"})
def _causal_conv1d_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
    state_indices: Optional[Tensor],
) -> Tensor:
    if _triton(x):
        return causal_conv1d_update_triton(x, conv_state, weight, bias, activation, state_indices)
    return reference.causal_conv1d_update_ref(x, conv_state, weight, bias, activation, state_indices)


@torch.library.triton_op(op_name("selective_scan"), mutates_args=())
def _selective_scan(
    u: Tensor, delta: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    delta_bias: Optional[Tensor], delta_softplus: bool, initial_state: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    fn = selective_scan_triton if _triton(u) else reference.selective_scan_ref
    return fn(u, delta, A, Bm, Cm, D, z, delta_bias, delta_softplus, initial_state)


@torch.library.triton_op(op_name("selective_state_update"), mutates_args={"state"})
def _selective_state_update(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, state_indices: Optional[Tensor],
) -> Tensor:
    fn = selective_state_update_triton if _triton(x) else reference.selective_state_update_ref
    return fn(state, x, dt, A, Bm, Cm, D, z, dt_bias, dt_softplus, state_indices)


@torch.library.triton_op(op_name("ssd_scan"), mutates_args=())
def _ssd_scan(
    x: Tensor, dt: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, chunk_size: int, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, dt_min: float, dt_max: float,
    initial_states: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    fn = ssd_scan_triton if _triton(x) else reference.ssd_scan_ref
    return fn(x, dt, A, Bm, Cm, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states)


@_ssd_scan.register_fake
def _(x, dt, A, Bm, Cm, chunk_size, *args):
    # shapes only: the body (the reference on the CPU) would trace the chunked scan's einsums on symbolic sizes,
    # seconds per graph; Inductor still lowers the op through the body
    b, t, h, p = x.shape
    return x.new_empty((b, t, h, p)), x.new_empty((b, h, p, Bm.shape[-1]), dtype=torch.float32)


@torch.library.triton_op(op_name("ssd_state_update"), mutates_args={"state"})
def _ssd_state_update(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, dt_min: float, dt_max: float,
    state_indices: Optional[Tensor], A_is_log: bool = False,
) -> Tensor:
    fn = ssd_state_update_triton if _triton(x) else reference.ssd_state_update_ref
    return fn(state, x, dt, A, Bm, Cm, D, z, dt_bias, dt_softplus, dt_min, dt_max, state_indices, A_is_log)


@torch.library.triton_op(op_name("gated_rms_norm"), mutates_args=())
def _gated_rms_norm(x: Tensor, z: Optional[Tensor], weight: Tensor, eps: float, group_size: int) -> Tensor:
    if _triton(x):
        return gated_rms_norm_triton(x, z, weight, eps, group_size)
    return reference.gated_rms_norm_ref(x, z, weight, eps, group_size)


@torch.library.custom_op(op_name("gated_norm_linear"), mutates_args=())
def gated_norm_linear(x: Tensor, z: Tensor, norm_weight: Tensor, eps: float, group_size: int, weight: Tensor,
                      bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(gated_rms_norm(x, z, norm_weight, eps, group_size).to(weight.dtype), weight, bias)``: HF's
    MambaRMSNormGated then the out projection. One kernel (the norm as the linear's prologue) where the Triton
    kernels take the shape and the norm has one group; the norm op then ``hybrid::linear`` otherwise."""
    K = x.shape[-1]
    rows = None
    if group_size == K and z.shape == x.shape and norm_weight.shape == (K,) and norm_weight.stride(0) == 1:
        rows = linear_rows(x, [weight], bias, "gated")
    if rows is None:
        y = torch.ops.hybrid.gated_rms_norm(x, z, norm_weight, eps, group_size)
        return torch.ops.hybrid.linear(y.to(weight.dtype), weight, bias)
    out = linear_triton(rows, [weight], bias, gate=(rows_of(z), norm_weight, eps))[0]
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
    rows = linear_rows(x, [weight], bias)
    cfg = None if rows is None else conv_config(rows.shape[0], weight.shape[0], rows.shape[1])
    fits = (conv_weight.dim() == 2 and conv_state.dim() == 3 and conv_state.shape[:2] == (x.numel() // x.shape[-1], C)
            and conv_weight.shape[1] <= conv_state.shape[2] and 0 <= c0 and c0 + C <= weight.shape[0]
            and conv_state.device == x.device and conv_weight.device == x.device
            and (conv_bias is None or (conv_bias.shape == (C,) and conv_bias.stride(0) == 1)))
    if cfg is not None and fits:
        y, c = linear_conv_triton(rows, weight, bias, conv_state, conv_weight, conv_bias, c0, config=cfg)
        return y.view(*x.shape[:-1], -1), c
    y = torch.ops.hybrid.linear(x, weight, bias)
    xbc = y.reshape(-1, y.shape[-1])[:, c0:c0 + C]
    return y, torch.ops.hybrid.causal_conv1d_update(xbc, conv_state, conv_weight, conv_bias, "silu", None)


@linear_conv.register_fake
def _(x, weight, bias, conv_state, conv_weight, conv_bias, c0):
    rows = x.numel() // x.shape[-1]
    return (x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=weight.dtype),
            x.new_empty((rows, conv_weight.shape[0]), dtype=weight.dtype))



# ---------------------------------------------------------------------------------------------------------
# Whole mixers (bodies in mixer.py; argument order built by spec.py)


@torch.library.triton_op(op_name("mamba_mixer"), mutates_args={})
def _mamba_mixer(hidden: Tensor, mask: Optional[Tensor], in_proj_w: Tensor, in_proj_b: Optional[Tensor],
                 conv_w: Tensor, conv_b: Optional[Tensor], x_proj_w: Tensor, dt_proj_w: Tensor,
                 dt_proj_b: Optional[Tensor], A_log: Tensor, D: Tensor, out_proj_w: Tensor,
                 out_proj_b: Optional[Tensor], dt_norm_w: Optional[Tensor], b_norm_w: Optional[Tensor],
                 c_norm_w: Optional[Tensor], norm_eps: float, bcdt_norm: bool, state_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mamba1 mixer prefill: hidden [B, T, Hd] -> (out, conv_state [B, D, W], ssm_state [B, D, N] fp32)."""
    w = Mamba1Weights(in_proj_w, in_proj_b, conv_w, conv_b, x_proj_w, dt_proj_w, dt_proj_b, A_log, D, out_proj_w,
                      out_proj_b, dt_norm_w, b_norm_w, c_norm_w)
    return mixer.mamba1_prefill(hidden, mask, w, norm_eps if bcdt_norm else None, state_width)


@torch.library.triton_op(op_name("mamba_mixer_step"), mutates_args={"conv_state", "ssm_state"})
def _mamba_mixer_step(hidden: Tensor, mask: Optional[Tensor], in_proj_w: Tensor, in_proj_b: Optional[Tensor],
                      conv_w: Tensor, conv_b: Optional[Tensor], x_proj_w: Tensor, dt_proj_w: Tensor,
                      dt_proj_b: Optional[Tensor], A_log: Tensor, D: Tensor, out_proj_w: Tensor,
                      out_proj_b: Optional[Tensor], dt_norm_w: Optional[Tensor], b_norm_w: Optional[Tensor],
                      c_norm_w: Optional[Tensor], norm_eps: float, bcdt_norm: bool, conv_state: Tensor,
                      ssm_state: Tensor) -> Tensor:
    """Mamba1 mixer decode: hidden [B, 1, Hd]; conv_state [B, D, W] and ssm_state [B, D, N] updated in place."""
    w = Mamba1Weights(in_proj_w, in_proj_b, conv_w, conv_b, x_proj_w, dt_proj_w, dt_proj_b, A_log, D, out_proj_w,
                      out_proj_b, dt_norm_w, b_norm_w, c_norm_w)
    return mixer.mamba1_step(hidden, mask, w, norm_eps if bcdt_norm else None, conv_state, ssm_state)


@torch.library.triton_op(op_name("mamba2_mixer"), mutates_args={})
def _mamba2_mixer(hidden: Tensor, mask: Optional[Tensor], in_proj_w: Tensor, in_proj_b: Optional[Tensor],
                  conv_w: Tensor, conv_b: Optional[Tensor], dt_bias: Tensor, A_log: Tensor, D: Tensor,
                  norm_w: Optional[Tensor], out_proj_w: Tensor, out_proj_b: Optional[Tensor],
                  proj_mult: Optional[Tensor], head_dim: int, groups: int, in_mult: float, chunk_size: int, eps: float,
                  norm_group: int, dt_min: float, dt_max: float, state_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mamba2 mixer prefill: hidden [B, T, Hd] -> (out, conv_state [B, C, W], ssm_state [B, H, P, N] fp32)."""
    w = Mamba2Weights(in_proj_w, in_proj_b, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj_w, out_proj_b,
                      proj_mult)
    return mixer.mamba2_prefill(hidden, mask, w, head_dim, groups, in_mult, chunk_size, eps, norm_group, dt_min,
                                dt_max, state_width)


@torch.library.triton_op(op_name("mamba2_mixer_chunk"), mutates_args={"conv_state", "ssm_state"})
def _mamba2_mixer_chunk(hidden: Tensor, mask: Optional[Tensor], in_proj_w: Tensor, in_proj_b: Optional[Tensor],
                        conv_w: Tensor, conv_b: Optional[Tensor], dt_bias: Tensor, A_log: Tensor, D: Tensor,
                        norm_w: Optional[Tensor], out_proj_w: Tensor, out_proj_b: Optional[Tensor],
                        proj_mult: Optional[Tensor], head_dim: int, groups: int, in_mult: float, chunk_size: int,
                        eps: float, norm_group: int, dt_min: float, dt_max: float, conv_state: Tensor,
                        ssm_state: Tensor) -> Tensor:
    """Mamba2 mixer over T tokens that continue a cached sequence (a prefill chunk after the first): hidden
    [B, T, Hd] -> out; conv_state [B, C, W] and ssm_state [B, H, P, N] hold the states before the chunk and are
    updated in place to the states after it, as HF's cache does."""
    w = Mamba2Weights(in_proj_w, in_proj_b, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj_w, out_proj_b,
                      proj_mult)
    out, conv, ssm = mixer.mamba2_prefill(hidden, mask, w, head_dim, groups, in_mult, chunk_size, eps, norm_group,
                                          dt_min, dt_max, conv_state.shape[-1], conv_state, ssm_state)
    conv_state.copy_(conv)
    ssm_state.copy_(ssm)
    return out


@torch.library.triton_op(op_name("mamba2_mixer_step"), mutates_args={"conv_state", "ssm_state"})
def _mamba2_mixer_step(hidden: Tensor, mask: Optional[Tensor], in_proj_w: Tensor, in_proj_b: Optional[Tensor],
                       conv_w: Tensor, conv_b: Optional[Tensor], dt_bias: Tensor, A_log: Tensor, D: Tensor,
                       norm_w: Optional[Tensor], out_proj_w: Tensor, out_proj_b: Optional[Tensor],
                       proj_mult: Optional[Tensor], head_dim: int, groups: int, in_mult: float, eps: float,
                       norm_group: int, conv_state: Tensor, ssm_state: Tensor) -> Tensor:
    """Mamba2 mixer decode: hidden [B, 1, Hd]; conv_state [B, C, W] and ssm_state [B, H, P, N] in place."""
    w = Mamba2Weights(in_proj_w, in_proj_b, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj_w, out_proj_b,
                      proj_mult)
    return mixer.mamba2_step(hidden, mask, w, head_dim, groups, in_mult, eps, norm_group, conv_state, ssm_state)


@torch.library.custom_op(op_name("mamba2_mixer_packed"), mutates_args={"conv_buf", "ssm_buf"})
def _mamba2_mixer_packed(hidden: Tensor, in_proj_w: Tensor, in_proj_b: Optional[Tensor], conv_w: Tensor,
                         conv_b: Optional[Tensor], dt_bias: Tensor, A_log: Tensor, D: Tensor, norm_w: Optional[Tensor],
                         out_proj_w: Tensor, out_proj_b: Optional[Tensor], proj_mult: Optional[Tensor], head_dim: int,
                         groups: int, in_mult: float, chunk_size: int, eps: float, norm_group: int, dt_min: float,
                         dt_max: float, conv_buf: Tensor, ssm_buf: Tensor, seqs: Tensor, dec_tokens: Optional[Tensor],
                         dec_rows: Optional[Tensor]) -> Tensor:
    """Mamba2 mixer over several sequences' tokens on one axis (hidden [1, N, Hd]), each on its own state row
    (mixer.mamba2_packed). Opaque to torch.compile: its body loops over the prefill chunks listed in the host
    tensor ``seqs``."""
    w = Mamba2Weights(in_proj_w, in_proj_b, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj_w, out_proj_b,
                      proj_mult)
    return mixer.mamba2_packed(hidden, w, head_dim, groups, in_mult, chunk_size, eps, norm_group, dt_min, dt_max,
                               conv_buf, ssm_buf, seqs, dec_tokens, dec_rows)


@_mamba2_mixer_packed.register_fake
def _(hidden, in_proj_w, in_proj_b, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj_w, *args):
    return hidden.new_empty((*hidden.shape[:-1], out_proj_w.shape[0]))


def _selective_scan_fake(u, delta, A, *args):
    b, d, _ = u.shape
    return u.new_empty(u.shape), u.new_empty((b, d, A.shape[-1]), dtype=torch.float32)


# the scan's chunking depends on the length: the run-time twin keeps HF's Mamba1 scan one graph for every length
define_twin(torch.ops.hybrid.selective_scan.default, _selective_scan_fake)


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
