"""The bodies of the whole-mixer ops (hybrid_kernels/ssm/ops.py registers them), as the SSM pass emits them with HF's
drop-in cache semantics.

``mamba1_prefill`` / ``mamba2_prefill``: hidden [B, T, Hd] -> (out [B, T, Hd], conv_state [B, C, W], ssm_state fp32)
with the states HF's cache keeps after a fresh prefill (W = conv kernel, the last W conv inputs, zero-padded on the
left); Mamba2's also continues from given states (a prefill chunk after the first). ``mamba1_step`` /
``mamba2_step``: decode (T=1), the HF cache's conv and ssm states updated in place. ``mamba2_packed``: the tokens of
several sequences on one axis (the engine's packed steps), each continuing from or starting its own state row.
The projections are ``F.linear`` at prefill (cuBLAS through Inductor) and ``hybrid::linear`` at decode (Triton
one-row kernels at batch 1, cuBLAS otherwise: hybrid_kernels/linear); conv, scan, state update and gated norm are the SSM
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


def _rms(x: Tensor, w: Optional[Tensor], eps: Optional[float]) -> Tensor:
    """RMS norm of the last dim scaled by ``w`` (unit scale where None); ``eps`` None: no norm at all."""
    if eps is None:
        return x
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if w is None else w * y


def _mamba1_params(xdbl: Tensor, w: Mamba1Weights, n: int, norm_eps: Optional[float]):
    dt, b, c = torch.split(xdbl, [w.dt_proj_w.shape[1], n, n], dim=-1)
    dt, b, c = _rms(dt, w.dt_norm_w, norm_eps), _rms(b, w.b_norm_w, norm_eps), _rms(c, w.c_norm_w, norm_eps)
    return w.dt_proj_w @ dt.transpose(-1, -2), b, c  # dt [.., D, T]


def mamba1_prefill(hidden: Tensor, mask: Optional[Tensor], w: Mamba1Weights, norm_eps: Optional[float],
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


def mamba1_step(hidden: Tensor, mask: Optional[Tensor], w: Mamba1Weights, norm_eps: Optional[float],
                conv_state: Tensor, ssm_state: Tensor) -> Tensor:
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


def _mamba2_proj(hidden: Tensor, mask: Optional[Tensor], w: Mamba2Weights, in_mult: float) -> Tensor:
    """The in projection of the (masked, scaled) input, times the per-channel multipliers where the mixer has them."""
    h = _masked(hidden, mask)
    proj = F.linear(h if in_mult == 1.0 else h * in_mult, w.in_proj_w, w.in_proj_b)
    return proj if w.proj_mult is None else proj * w.proj_mult


def _gated_output(y: Tensor, gate: Tensor, w: Mamba2Weights, eps: float, norm_group: int) -> Tensor:
    """The gated RMSNorm of the scan's output, or without a norm y * silu(gate)."""
    if w.norm_w is None:
        return y * F.silu(gate.float())
    return torch.ops.hybrid.gated_rms_norm(y, gate, w.norm_w, eps, norm_group)


def mamba2_prefill(hidden: Tensor, mask: Optional[Tensor], w: Mamba2Weights, head_dim: int, groups: int,
                   in_mult: float, chunk_size: int, eps: float, norm_group: int, dt_min: float, dt_max: float,
                   state_width: int, conv_init: Optional[Tensor] = None, ssm_init: Optional[Tensor] = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Mamba2 mixer over T tokens that follow ``conv_init`` / ``ssm_init`` (None: a fresh start): hidden [B, T, Hd]
    -> (out, conv_state [B, C, W], ssm_state [B, H, P, N] fp32)."""
    bsz, t = hidden.shape[0], hidden.shape[1]
    heads, d_inner, conv_dim, n = _mamba2_dims(w, head_dim, groups)
    gate, xbc, dt = _mamba2_split(_mamba2_proj(hidden, mask, w, in_mult), d_inner, conv_dim)
    xbc, conv_state = torch.ops.hybrid.causal_conv1d(xbc.transpose(1, 2), w.conv_w.reshape(conv_dim, -1), w.conv_b,
                                                     conv_init, "silu", state_width)
    xbc = _masked(xbc.transpose(1, 2), mask)
    x, b, c = torch.split(xbc, [d_inner, groups * n, groups * n], dim=-1)
    y, ssm_state = torch.ops.hybrid.ssd_scan(
        x.reshape(bsz, t, heads, head_dim), dt, -torch.exp(w.A_log.float()), b.reshape(bsz, t, groups, n),
        c.reshape(bsz, t, groups, n), chunk_size, w.D, None, w.dt_bias, True, dt_min, dt_max, ssm_init)
    y = _gated_output(y.reshape(bsz, t, d_inner), gate, w, eps, norm_group)
    return F.linear(y.to(hidden.dtype), w.out_proj_w, w.out_proj_b), conv_state, ssm_state


def mamba2_step(hidden: Tensor, mask: Optional[Tensor], w: Mamba2Weights, head_dim: int, groups: int,
                in_mult: float, eps: float, norm_group: int, conv_state: Tensor, ssm_state: Tensor) -> Tensor:
    """Mamba2 mixer decode: hidden [B, 1, Hd]; conv_state [B, C, W] and ssm_state [B, H, P, N] in place.
    Like HF's decode path, dt is not clamped to the time-step limit. The in projection + conv update is one launch
    (``hybrid::linear_conv``) where nothing scales the projection, the gated norm + out projection one launch
    (``hybrid::gated_norm_linear``) where there is a norm."""
    bsz = hidden.shape[0]
    heads, d_inner, conv_dim, n = _mamba2_dims(w, head_dim, groups)
    conv_w = w.conv_w.reshape(conv_dim, -1)
    if w.proj_mult is None and in_mult == 1.0:
        proj, xbc = torch.ops.hybrid.linear_conv(_masked(hidden, mask), w.in_proj_w, w.in_proj_b, conv_state, conv_w,
                                                 w.conv_b, d_inner)
    else:
        h = _masked(hidden, mask)
        proj = torch.ops.hybrid.linear(h if in_mult == 1.0 else h * in_mult, w.in_proj_w, w.in_proj_b)
        proj = proj if w.proj_mult is None else proj * w.proj_mult
        xbc = torch.ops.hybrid.causal_conv1d_update(proj[:, 0, d_inner:d_inner + conv_dim].contiguous(), conv_state, conv_w,
                                                    w.conv_b, "silu", None)
    gate, _, dt = _mamba2_split(proj[:, 0], d_inner, conv_dim)
    xbc = _masked(xbc[:, None], mask)[:, 0]
    x, b, c = torch.split(xbc, [d_inner, groups * n, groups * n], dim=-1)
    z = None if w.norm_w is not None else gate.reshape(bsz, heads, head_dim)
    y = torch.ops.hybrid.ssd_state_update(ssm_state, x.reshape(bsz, heads, head_dim), dt, w.A_log,
                                          b.reshape(bsz, groups, n), c.reshape(bsz, groups, n), w.D, z, w.dt_bias,
                                          True, 0.0, float("inf"), None, True)
    if w.norm_w is None:
        return torch.ops.hybrid.linear(y.reshape(bsz, 1, d_inner).to(hidden.dtype), w.out_proj_w, w.out_proj_b)
    return torch.ops.hybrid.gated_norm_linear(y.reshape(bsz, 1, d_inner), gate[:, None], w.norm_w, eps, norm_group,
                                              w.out_proj_w, w.out_proj_b)


def mamba2_packed(hidden: Tensor, w: Mamba2Weights, head_dim: int, groups: int, in_mult: float, chunk_size: int,
                  eps: float, norm_group: int, dt_min: float, dt_max: float, conv_buf: Tensor, ssm_buf: Tensor,
                  seqs: Tensor, dec_tokens: Optional[Tensor], dec_rows: Optional[Tensor]) -> Tensor:
    """Mamba2 mixer over the tokens of several sequences laid on one axis (hidden [1, N, Hd], no padding), each
    sequence reading and updating its own row of the state buffers conv_buf [R, C, W] and ssm_buf [R, H, P, N]
    (fp32), as HF's mixer would for that sequence alone:
    - ``seqs`` (host int64 [S, 4]: first token, token count, state row, continues 0/1): prefill chunks, the chunked
      form with dt clamped to the time-step limit, from the row's states (continues = 1) or from zero (a fresh
      prompt; the row is overwritten);
    - ``dec_tokens`` / ``dec_rows`` (device int64 / int32, or None): single tokens that continue a cached state, in
      HF's decode form (dt not clamped), all in one conv update and one state update.
    The in and out projections and the gated norm run once over all N tokens; the conv and the scan once per run of
    prefill chunks that can share a batched call (``chunk_runs``: prompts admitted together)."""
    heads, d_inner, conv_dim, nst = _mamba2_dims(w, head_dim, groups)
    conv_w = w.conv_w.reshape(conv_dim, -1)
    proj = _mamba2_proj(hidden, None, w, in_mult)[0]  # [N, d_inner + C + H] (multipliers may be [1, 1, width])
    gate, xbc, dt = _mamba2_split(proj, d_inner, conv_dim)
    y = torch.empty(hidden.shape[1], d_inner, dtype=proj.dtype, device=proj.device)
    A = -torch.exp(w.A_log.float())
    for first, count, row, continues, n in chunk_runs(seqs):  # n sequences of `count` tokens on rows row..row+n-1
        toks, rows = slice(first, first + n * count), slice(row, row + n)
        xs, conv_state = torch.ops.hybrid.causal_conv1d(
            xbc[toks].view(n, count, conv_dim).transpose(1, 2), conv_w, w.conv_b,
            conv_buf[rows] if continues else None, "silu", conv_buf.shape[-1])
        conv_buf[rows].copy_(conv_state)
        x, b, c = torch.split(xs.transpose(1, 2), [d_inner, groups * nst, groups * nst], dim=-1)
        ys, ssm_state = torch.ops.hybrid.ssd_scan(
            x.reshape(n, count, heads, head_dim), dt[toks].view(n, count, heads), A, b.reshape(n, count, groups, nst),
            c.reshape(n, count, groups, nst), chunk_size, w.D, None, w.dt_bias, True, dt_min, dt_max,
            ssm_buf[rows] if continues else None)
        ssm_buf[rows].copy_(ssm_state)
        y[toks] = ys.reshape(n * count, d_inner)
    if dec_tokens is not None:
        nd = dec_tokens.shape[0]
        xd = torch.ops.hybrid.causal_conv1d_update(xbc.index_select(0, dec_tokens), conv_buf, conv_w, w.conv_b, "silu",
                                                   dec_rows)
        x, b, c = torch.split(xd, [d_inner, groups * nst, groups * nst], dim=-1)
        yd = torch.ops.hybrid.ssd_state_update(ssm_buf, x.reshape(nd, heads, head_dim), dt.index_select(0, dec_tokens),
                                               w.A_log, b.reshape(nd, groups, nst), c.reshape(nd, groups, nst), w.D,
                                               None, w.dt_bias, True, 0.0, float("inf"), dec_rows, True)
        y.index_copy_(0, dec_tokens, yd.reshape(nd, d_inner).to(y.dtype))
    out = F.linear(_gated_output(y, gate, w, eps, norm_group).to(hidden.dtype), w.out_proj_w, w.out_proj_b)
    return out[None]


def chunk_runs(seqs: Tensor) -> list[tuple[int, int, int, int, int]]:
    """The prefill chunks of a packed step's map (host [S, 4]: first token, count, state row, continues) as runs that
    one batched call can take without copies: consecutive chunks of one length and kind (fresh or continuing) that lie
    back to back on the token axis and on consecutive state rows, as the chunks of prompts admitted or continued
    together do. Each run: (first token, count, first row, continues, sequences)."""
    runs: list[list[int]] = []
    for first, count, row, continues in seqs.tolist():
        if runs:
            f, c, r, k, n = runs[-1]
            if c == count and k == continues and first == f + n * c and row == r + n:
                runs[-1][4] += 1
                continue
        runs.append([first, count, row, continues, 1])
    return [tuple(r) for r in runs]
