"""The bodies of the whole-mixer ops (kernels/ssm/ops.py registers them), as the SSM pass emits them with HF's
drop-in cache semantics.

``mamba1_prefill`` / ``mamba2_prefill``: hidden [B, T, Hd] -> (out [B, T, Hd], conv_state [B, C, W], ssm_state fp32)
with the states HF's cache keeps after a fresh prefill (W = conv kernel, the last W conv inputs, zero-padded on the
left); Mamba2's also continues from given states (a prefill chunk after the first). ``mamba1_step`` /
``mamba2_step``: decode (T=1), the HF cache's conv and ssm states updated in place.
The projections are ``F.linear`` at prefill (cuBLAS through Inductor) and ``hybrid::linear`` at decode (Triton
one-row kernels at batch 1, cuBLAS otherwise: kernels/linear); conv, scan, state update and gated norm are the SSM
kernels. At decode Mamba2's conv update runs as the in projection's epilogue (``hybrid::linear_conv``) and the gated
norm as the out projection's prologue (``hybrid::gated_norm_linear``) where the Triton kernels take them.
``mask`` is HF's 2-D attention mask, applied where HF applies it (before in_proj and after the conv).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .spec import Mamba1Weights, Mamba2Weights


def _masked(h: Tensor, mask: Optional[Tensor]) -> Tensor:
    return h if mask is None else (h * mask[:, :, None]).to(h.dtype)


def _rms(x: Tensor, w: Optional[Tensor], eps: float) -> Tensor:
    if w is None:
        return x
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _mamba1_params(xdbl: Tensor, w: Mamba1Weights, n: int, norm_eps: float):
    dt, b, c = torch.split(xdbl, [w.dt_proj_w.shape[1], n, n], dim=-1)
    dt, b, c = _rms(dt, w.dt_norm_w, norm_eps), _rms(b, w.b_norm_w, norm_eps), _rms(c, w.c_norm_w, norm_eps)
    return w.dt_proj_w @ dt.transpose(-1, -2), b, c  # dt [.., D, T]


def mamba1_prefill(hidden: Tensor, mask: Optional[Tensor], w: Mamba1Weights, norm_eps: float,
                   state_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mamba1 mixer prefill: hidden [B, T, Hd] -> (out, conv_state [B, D, W], ssm_state [B, D, N] fp32)."""
    n = w.A_log.shape[1]
    proj = F.linear(_masked(hidden, mask), w.in_proj_w, w.in_proj_b).transpose(1, 2)  # [B, 2D, T]
    x, z = proj.chunk(2, dim=1)
    xc, conv_state = torch.ops.hybrid.causal_conv1d(x, w.conv_w.reshape(w.conv_w.shape[0], -1), w.conv_b, None,
                                                    "silu", state_width)
    xc = _masked(xc.transpose(1, 2), mask)  # [B, T, D]
    dt, b, c = _mamba1_params(F.linear(xc, w.x_proj_w), w, n, norm_eps)
    A = -torch.exp(w.A_log.float())
    y, ssm_state = torch.ops.hybrid.selective_scan(
        xc.transpose(1, 2), dt, A, b.transpose(1, 2), c.transpose(1, 2), w.D.float(), z,
        None if w.dt_proj_b is None else w.dt_proj_b.float(), True, None)
    out = F.linear(y.transpose(1, 2).to(hidden.dtype), w.out_proj_w, w.out_proj_b)
    return out, conv_state, ssm_state


def mamba1_step(hidden: Tensor, mask: Optional[Tensor], w: Mamba1Weights, norm_eps: float, conv_state: Tensor,
                ssm_state: Tensor) -> Tensor:
    """Mamba1 mixer decode: hidden [B, 1, Hd]; conv_state [B, D, W] and ssm_state [B, D, N] updated in place."""
    n = w.A_log.shape[1]
    proj = torch.ops.hybrid.linear(_masked(hidden, mask), w.in_proj_w, w.in_proj_b)[:, 0]  # [B, 2D]
    x, z = proj.chunk(2, dim=-1)
    xc = torch.ops.hybrid.causal_conv1d_update(x, conv_state, w.conv_w.reshape(w.conv_w.shape[0], -1), w.conv_b,
                                               "silu", None)
    xc = _masked(xc[:, None], mask)[:, 0]
    dt, b, c = _mamba1_params(torch.ops.hybrid.linear(xc, w.x_proj_w)[:, None], w, n, norm_eps)
    A = -torch.exp(w.A_log.float())
    y = torch.ops.hybrid.selective_state_update(ssm_state, xc, dt[..., 0], A, b[:, 0], c[:, 0], w.D, z,
                                                None if w.dt_proj_b is None else w.dt_proj_b.float(), True, None)
    return torch.ops.hybrid.linear(y[:, None].to(hidden.dtype), w.out_proj_w, w.out_proj_b)


def _mamba2_split(proj: Tensor, d_inner: int, conv_dim: int):
    return torch.split(proj, [d_inner, conv_dim, proj.shape[-1] - d_inner - conv_dim], dim=-1)


def _mamba2_dims(w: Mamba2Weights, head_dim: int, groups: int) -> tuple[int, int, int, int]:
    """(heads, d_inner, conv_dim, state size N) from the weights."""
    heads = w.A_log.shape[0]
    d_inner = heads * head_dim
    conv_dim = w.conv_w.shape[0]
    return heads, d_inner, conv_dim, (conv_dim - d_inner) // (2 * groups)


def mamba2_prefill(hidden: Tensor, mask: Optional[Tensor], w: Mamba2Weights, head_dim: int, groups: int,
                   chunk_size: int, eps: float, norm_group: int, dt_min: float, dt_max: float, state_width: int,
                   conv_init: Optional[Tensor] = None, ssm_init: Optional[Tensor] = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Mamba2 mixer over T tokens that follow ``conv_init`` / ``ssm_init`` (None: a fresh start): hidden [B, T, Hd]
    -> (out, conv_state [B, C, W], ssm_state [B, H, P, N] fp32)."""
    bsz, t = hidden.shape[0], hidden.shape[1]
    heads, d_inner, conv_dim, n = _mamba2_dims(w, head_dim, groups)
    gate, xbc, dt = _mamba2_split(F.linear(_masked(hidden, mask), w.in_proj_w, w.in_proj_b), d_inner, conv_dim)
    xbc, conv_state = torch.ops.hybrid.causal_conv1d(xbc.transpose(1, 2), w.conv_w.reshape(conv_dim, -1), w.conv_b,
                                                     conv_init, "silu", state_width)
    xbc = _masked(xbc.transpose(1, 2), mask)
    x, b, c = torch.split(xbc, [d_inner, groups * n, groups * n], dim=-1)
    y, ssm_state = torch.ops.hybrid.ssd_scan(
        x.reshape(bsz, t, heads, head_dim), dt, -torch.exp(w.A_log.float()), b.reshape(bsz, t, groups, n),
        c.reshape(bsz, t, groups, n), chunk_size, w.D, None, w.dt_bias, True, dt_min, dt_max, ssm_init)
    y = torch.ops.hybrid.gated_rms_norm(y.reshape(bsz, t, d_inner), gate, w.norm_w, eps, norm_group)
    return F.linear(y.to(hidden.dtype), w.out_proj_w, w.out_proj_b), conv_state, ssm_state


def mamba2_step(hidden: Tensor, mask: Optional[Tensor], w: Mamba2Weights, head_dim: int, groups: int, eps: float,
                norm_group: int, conv_state: Tensor, ssm_state: Tensor) -> Tensor:
    """Mamba2 mixer decode: hidden [B, 1, Hd]; conv_state [B, C, W] and ssm_state [B, H, P, N] in place.
    Like HF's decode path, dt is not clamped to the time-step limit."""
    bsz = hidden.shape[0]
    heads, d_inner, conv_dim, n = _mamba2_dims(w, head_dim, groups)
    proj, xbc = torch.ops.hybrid.linear_conv(_masked(hidden, mask), w.in_proj_w, w.in_proj_b, conv_state,
                                             w.conv_w.reshape(conv_dim, -1), w.conv_b, d_inner)
    gate, _, dt = _mamba2_split(proj[:, 0], d_inner, conv_dim)
    xbc = _masked(xbc[:, None], mask)[:, 0]
    x, b, c = torch.split(xbc, [d_inner, groups * n, groups * n], dim=-1)
    y = torch.ops.hybrid.ssd_state_update(ssm_state, x.reshape(bsz, heads, head_dim), dt, w.A_log,
                                          b.reshape(bsz, groups, n), c.reshape(bsz, groups, n), w.D, None, w.dt_bias,
                                          True, 0.0, float("inf"), None, True)
    return torch.ops.hybrid.gated_norm_linear(y.reshape(bsz, 1, d_inner), gate[:, None], w.norm_w, eps, norm_group,
                                              w.out_proj_w, w.out_proj_b)
