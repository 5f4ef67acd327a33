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

import functools
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
    The in and out projections and the gated norm run once over all N tokens; the conv and the scan once per group of
    prefill chunks (``chunk_groups``): chunks of several lengths share one call as right-padded rows."""
    heads, d_inner, conv_dim, nst = _mamba2_dims(w, head_dim, groups)
    conv_w = w.conv_w.reshape(conv_dim, -1)
    proj = _mamba2_proj(hidden, None, w, in_mult)[0]  # [N, d_inner + C + H] (multipliers may be [1, 1, width])
    gate, xbc, dt = _mamba2_split(proj, d_inner, conv_dim)
    A = -torch.exp(w.A_log.float())
    width = conv_buf.shape[-1]
    sets = chunk_groups(seqs, pad=dt_min <= 0.0)
    # one run of chunks over every token (prompts arriving together): its output is the step's, no copy into place
    whole = dec_tokens is None and len(sets) == 1 and sets[0].run == 0 and \
        len(sets[0].rows) * sets[0].length == hidden.shape[1]
    y = None if whole else torch.empty(hidden.shape[1], d_inner, dtype=proj.dtype, device=proj.device)
    for grp in sets:
        n, length = len(grp.rows), grp.length
        if grp.run is not None:  # back to back on tokens and rows: views, no copies
            toks, rows = slice(grp.run, grp.run + n * length), slice(grp.rows[0], grp.rows[0] + n)
            xs_in, dts = xbc[toks].view(n, length, conv_dim), dt[toks].view(n, length, heads)
            conv_init, ssm_init = (conv_buf[rows], ssm_buf[rows]) if grp.continues == n else (None, None)
        else:
            plan = grp.device_plan(proj.device, width)
            xs_in = xbc.index_select(0, plan.src).view(n, length, conv_dim)
            dts = dt.index_select(0, plan.src).view(n, length, heads)
            if plan.pad is not None:  # dt -> softplus(-1e4) = 0 on padding: no decay, no input, the state stands
                dts = dts.masked_fill(plan.pad, -1e4)
            conv_init = ssm_init = None
            if grp.continues:  # fresh rows start from zero
                conv_init = conv_buf.index_select(0, plan.rows) * plan.cont.to(conv_buf.dtype)[:, None, None]
                ssm_init = ssm_buf.index_select(0, plan.rows) * plan.cont.to(ssm_buf.dtype)[:, None, None, None]
        xs, conv_state = torch.ops.hybrid.causal_conv1d(xs_in.transpose(1, 2), conv_w, w.conv_b, conv_init, "silu",
                                                        width)
        if grp.padded:  # the state is the W inputs before each row's own end, not before the padding's
            before = conv_init if conv_init is not None else xs_in.new_zeros(n, conv_dim, width)
            seen = torch.cat([before.to(xs_in.dtype), xs_in.transpose(1, 2)], dim=-1)
            conv_state = seen.gather(-1, plan.tail.expand(n, conv_dim, width))
        x, b, c = torch.split(xs.transpose(1, 2), [d_inner, groups * nst, groups * nst], dim=-1)
        ys, ssm_state = torch.ops.hybrid.ssd_scan(
            x.reshape(n, length, heads, head_dim), dts, A, b.reshape(n, length, groups, nst),
            c.reshape(n, length, groups, nst), chunk_size, w.D, None, w.dt_bias, True, dt_min, dt_max, ssm_init)
        ys = ys.reshape(n * length, d_inner)
        if grp.run is not None:
            conv_buf[rows].copy_(conv_state)
            ssm_buf[rows].copy_(ssm_state)
            if whole:
                y = ys
            else:
                y[toks] = ys
        else:
            conv_buf.index_copy_(0, plan.rows, conv_state.to(conv_buf.dtype))
            ssm_buf.index_copy_(0, plan.rows, ssm_state.to(ssm_buf.dtype))
            y.index_copy_(0, plan.dst, ys if plan.keep is None else ys.index_select(0, plan.keep))
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


#: padding a group of prefill chunks may carry: at most this fraction of its tokens, or PAD_FREE tokens, whichever is more
PAD_SLACK, PAD_FREE = 0.5, 512


class _DevicePlan:
    """A group's index tensors on one device: ``src`` [n * L] token of each padded slot (a padding slot repeats its
    row's first token), ``pad`` [n, L, 1] bool (None: no padding), ``rows`` state rows, ``cont`` [n] 1.0 where the
    row continues, ``dst`` the real tokens and ``keep`` their slots among the n * L (None: all of them), ``tail``
    [n, 1, W] each row's last W inputs within (initial state ++ row)."""

    def __init__(self, grp: "ChunkGroup", device: torch.device, width: int):
        n, length = len(grp.rows), grp.length
        src, keep, dst, tail = [], [], [], []
        for i, (first, count) in enumerate(zip(grp.firsts, grp.counts)):
            src += list(range(first, first + count)) + [first] * (length - count)
            keep += range(i * length, i * length + count)
            dst += range(first, first + count)
            tail.append(list(range(count, count + width)))
        as_long = dict(dtype=torch.long, device=device)
        self.src, self.dst = torch.tensor(src, **as_long), torch.tensor(dst, **as_long)
        self.rows = torch.tensor(grp.rows, **as_long)
        self.cont = torch.tensor(grp.cont, dtype=torch.float32, device=device)
        self.keep = None if not grp.padded else torch.tensor(keep, **as_long)
        self.pad = None if not grp.padded else (torch.arange(length, device=device)[None, :]
                                                 >= torch.tensor(grp.counts, device=device)[:, None])[..., None]
        self.tail = torch.tensor(tail, **as_long)[:, None, :]


class ChunkGroup:
    """Prefill chunks that one conv + scan call takes as n rows of ``length`` tokens: ``run`` the first token where
    they lie back to back on the token axis with equal lengths on consecutive state rows (views suffice), else None
    (gathered, right-padded where lengths differ)."""

    def __init__(self, chunks: list[tuple[int, int, int, int]]):
        self.firsts = [c[0] for c in chunks]
        self.counts = [c[1] for c in chunks]
        self.rows = [c[2] for c in chunks]
        self.cont = [float(c[3]) for c in chunks]
        self.continues = sum(c[3] for c in chunks)
        self.length = max(self.counts)
        self.padded = min(self.counts) != self.length
        n, f0, r0 = len(chunks), self.firsts[0], self.rows[0]
        back_to_back = not self.padded and self.continues in (0, n) and all(
            f == f0 + i * self.length and r == r0 + i for i, (f, r) in enumerate(zip(self.firsts, self.rows)))
        self.run = f0 if back_to_back else None
        self._plans: dict = {}

    def device_plan(self, device: torch.device, width: int) -> _DevicePlan:
        key = (str(device), width)
        if key not in self._plans:
            self._plans[key] = _DevicePlan(self, device, width)
        return self._plans[key]


def chunk_groups(seqs: Tensor, pad: bool) -> list[ChunkGroup]:
    """The prefill chunks of a packed step's map (host [S, 4]: first token, count, state row, continues) in groups that
    one batched conv + scan call takes. ``pad`` (exact only where dt is not clamped from below: a padded slot's dt is
    0): chunks longest first, each group growing while its padding stays within PAD_SLACK of its tokens or PAD_FREE
    tokens; else chunks of one length together. Groups are cached by the map, since every layer of a step reads the
    same one."""
    return _groups(tuple(map(tuple, seqs.tolist())), pad)


@functools.lru_cache(maxsize=16)
def _groups(chunks: tuple[tuple[int, int, int, int], ...], pad: bool) -> list[ChunkGroup]:
    if not pad:
        by_len: dict[int, list] = {}
        for c in chunks:
            by_len.setdefault(c[1], []).append(c)
        return [ChunkGroup(g) for g in by_len.values()]
    groups: list[list] = []
    for c in sorted(chunks, key=lambda c: -c[1]):
        if groups:
            g = groups[-1]
            real = sum(x[1] for x in g) + c[1]
            if g[0][1] * (len(g) + 1) - real <= max(PAD_SLACK * real, PAD_FREE):
                g.append(c)
                continue
        groups.append([c])
    for g in groups:  # back to back where they were (prompts admitted together): views instead of gathers
        g.sort(key=lambda c: c[0])
    return [ChunkGroup(g) for g in groups]
