"""Plain torch references for the SSM ops: the CPU path of every ``hybrid::`` SSM op and the test oracle.

All math is fp32; every function is shape-static and loop-free over time (the Mamba1 scan is log-depth
doubling inside one opaque op, ``hybrid::linear_scan_ref``; SSD uses the chunked form), so the op bodies trace
into small graphs under torch.compile, with the length symbolic.
Semantics follow Hugging Face's torch paths (``modeling_mamba.py`` / ``modeling_mamba2.py``), extended
with initial states, slot indices (``state_indices``, -1 = pad row: no state write, output row 0) and
arbitrary strides. Shapes: B batch rows, S state slots, C conv channels, K conv taps, W conv-state width,
T time, D Mamba1 channels, N state size, H heads, P head dim, G groups.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus default: x > 20 -> x


def _act(y: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(y)
    if activation in ("none", "identity", ""):
        return y
    raise ValueError(f"activation must be 'silu' or 'none', got {activation!r}")


def _dt(dt: torch.Tensor, bias: torch.Tensor | None, softplus: bool) -> torch.Tensor:
    dt = dt.float()
    if bias is not None:
        dt = dt + bias.float()
    if softplus:
        dt = F.softplus(dt)
    return dt


def _slots(state_indices: torch.Tensor | None, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot of every batch row (clamped to >= 0 for gathers) and whether the row is a real one."""
    if state_indices is None:
        slots = torch.arange(batch, device=device)
        return slots, torch.ones(batch, dtype=torch.bool, device=device)
    slots = state_indices.long()
    return slots.clamp(min=0), slots >= 0


def _scatter_rows(state: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, new: torch.Tensor) -> None:
    """state[slots[b]] = new[b] for valid rows, value-independently (no nonzero, no sync).

    Pad rows are redirected to the slot of the first valid row and write that row's value, so every
    duplicate index carries the same value and ``index_copy_`` stays deterministic. With no valid row
    at all they rewrite slot 0 with its own old value.
    """
    new = new.to(state.dtype)
    first = torch.argmax(valid.to(torch.int32)).view(1)  # index_select, not [first]: that would be .item()
    any_valid = valid.any()
    fill_slot = torch.where(any_valid, slots.index_select(0, first), torch.zeros_like(first))  # [1]
    fill_val = torch.where(any_valid, new.index_select(0, first), state[:1])  # [1, ...]
    target = torch.where(valid, slots, fill_slot)
    vmask = valid.view(-1, *([1] * (new.dim() - 1)))
    state.index_copy_(0, target, torch.where(vmask, new, fill_val))


def linear_scan_doubling(a: torch.Tensor, b: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of h_t = a_t * h_{t-1} + b_t along ``dim`` (h_{-1} = 0) by log-depth doubling.

    Returns (prod_{s<=t} a_s, h_t). Only products of decays (no divisions): stable. The references call it through
    the opaque ``hybrid::linear_scan_ref`` (ops.py), so a traced graph does not specialise on T."""
    n = a.shape[dim]
    shift = 1
    while shift < n:
        a_prev = a.narrow(dim, 0, n - shift)
        b_prev = b.narrow(dim, 0, n - shift)
        a_cur = a.narrow(dim, shift, n - shift)
        b_cur = b.narrow(dim, shift, n - shift)
        new_b = torch.cat([b.narrow(dim, 0, shift), a_cur * b_prev + b_cur], dim)
        new_a = torch.cat([a.narrow(dim, 0, shift), a_cur * a_prev], dim)
        a, b = new_a, new_b
        shift *= 2
    return (a.clone(), b.clone()) if n <= 1 else (a, b)  # after a round both are fresh (cat): no alias


def _linear_scan(a: torch.Tensor, b: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.hybrid.linear_scan_ref(a, b, dim)


# ---------------------------------------------------------------------------------------------------------
# causal conv1d


def causal_conv1d_ref(
    x: torch.Tensor,  # [B, C, T]
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    initial_state: torch.Tensor | None,  # [B, C, W]: the W inputs before x, oldest first
    activation: str,
    state_width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    bsz, chans, _ = x.shape
    k = weight.shape[1]
    w = state_width
    if initial_state is None:
        init = x.new_zeros(bsz, chans, w, dtype=torch.float32)
    else:
        init = initial_state.float()
    xx = torch.cat([init, x.float()], dim=-1)  # [B, C, W + T]
    pad = max(k - 1 - w, 0)  # history older than the state is zero
    xx_p = F.pad(xx, (pad, 0)) if pad else xx  # (F.pad by 0 specialises a symbolic length)
    y = F.conv1d(xx_p[..., pad + w - (k - 1):], weight.float().unsqueeze(1),
                 None if bias is None else bias.float(), groups=chans)
    y = _act(y, activation)
    return y.to(x.dtype), xx[..., xx.shape[-1] - w:].to(x.dtype)


def causal_conv1d_update_ref(
    x: torch.Tensor,  # [B, C]
    conv_state: torch.Tensor,  # [S, C, W], mutated
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,
    activation: str,
    state_indices: torch.Tensor | None,  # [B] int32, -1 = pad row
) -> torch.Tensor:
    k = weight.shape[1]
    slots, valid = _slots(state_indices, x.shape[0], x.device)
    old = conv_state[slots]  # [B, C, W]
    new = torch.cat([old[..., 1:], x.unsqueeze(-1).to(old.dtype)], dim=-1)
    # the taps see the stored state and the unrounded new input (HF concatenates before casting)
    taps = torch.cat([new[..., new.shape[-1] - k:-1].float(), x.float().unsqueeze(-1)], dim=-1)
    y = (taps * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    y = torch.where(valid[:, None], _act(y, activation), torch.zeros_like(y))
    _scatter_rows(conv_state, slots, valid, new)
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Mamba1 selective scan


def selective_scan_ref(
    u: torch.Tensor,  # [B, D, T]
    delta: torch.Tensor,  # [B, D, T]
    A: torch.Tensor,  # [D, N]
    Bm: torch.Tensor,  # [B, N, T]
    Cm: torch.Tensor,  # [B, N, T]
    D: torch.Tensor | None,  # [D]
    z: torch.Tensor | None,  # [B, D, T]
    delta_bias: torch.Tensor | None,  # [D]
    delta_softplus: bool,
    initial_state: torch.Tensor | None,  # [B, D, N]
) -> tuple[torch.Tensor, torch.Tensor]:
    dt = _dt(delta, None if delta_bias is None else delta_bias[:, None], delta_softplus)  # [B, D, T]
    uf = u.float()
    dA = torch.exp(dt[..., None] * A.float()[:, None, :])  # [B, D, T, N]
    dBu = (dt * uf)[..., None] * Bm.float().transpose(1, 2)[:, None]  # [B, D, T, N]
    a_cum, h = _linear_scan(dA, dBu, dim=2)
    if initial_state is not None:
        h = h + a_cum * initial_state.float()[:, :, None, :]
    y = (h * Cm.float().transpose(1, 2)[:, None]).sum(-1)  # [B, D, T]
    if D is not None:
        y = y + D.float()[:, None] * uf
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(u.dtype), h[:, :, -1].contiguous()


def selective_state_update_ref(
    state: torch.Tensor,  # [S, D, N], mutated
    x: torch.Tensor,  # [B, D]
    dt: torch.Tensor,  # [B, D]
    A: torch.Tensor,  # [D, N]
    Bm: torch.Tensor,  # [B, N]
    Cm: torch.Tensor,  # [B, N]
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    state_indices: torch.Tensor | None,
) -> torch.Tensor:
    slots, valid = _slots(state_indices, x.shape[0], x.device)
    dtf = _dt(dt, dt_bias, dt_softplus)  # [B, D]
    xf = x.float()
    h = state[slots].float() * torch.exp(dtf[..., None] * A.float()) \
        + (dtf[..., None] * Bm.float()[:, None, :]) * xf[..., None]
    y = (h * Cm.float()[:, None, :]).sum(-1)
    if D is not None:
        y = y + D.float() * xf
    if z is not None:
        y = y * F.silu(z.float())
    y = torch.where(valid[:, None], y, torch.zeros_like(y))
    _scatter_rows(state, slots, valid, h)
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Mamba2 / SSD


def _segsum_exp(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> exp(sum_{s < j <= l} a_j) as [..., L(l), L(s)], 0 above the diagonal (stable form)."""
    n = a.shape[-1]
    ones = torch.ones(n, n, dtype=torch.bool, device=a.device)
    terms = a[..., :, None].expand(*a.shape, n).masked_fill(~torch.tril(ones, diagonal=-1), 0.0)  # [j, s]
    seg = torch.cumsum(terms, dim=-2)  # [l, s] = sum_{s < j <= l} a_j
    return torch.exp(seg.masked_fill(~torch.tril(ones), float("-inf")))


def ssd_scan_ref(
    x: torch.Tensor,  # [B, T, H, P]
    dt: torch.Tensor,  # [B, T, H]
    A: torch.Tensor,  # [H]
    Bm: torch.Tensor,  # [B, T, G, N]
    Cm: torch.Tensor,  # [B, T, G, N]
    chunk_size: int,
    D: torch.Tensor | None,  # [H]
    z: torch.Tensor | None,  # [B, T, H, P]
    dt_bias: torch.Tensor | None,  # [H]
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    initial_states: torch.Tensor | None,  # [B, H, P, N]
) -> tuple[torch.Tensor, torch.Tensor]:
    bsz, seqlen, nheads, hdim = x.shape
    ngroups, dstate = Bm.shape[2], Bm.shape[3]
    rep = nheads // ngroups
    L = chunk_size
    nch = (seqlen + L - 1) // L
    pad = nch * L - seqlen

    dtp = _dt(dt, dt_bias, dt_softplus).clamp(min=dt_min, max=dt_max)  # [B, T, H]
    xf = x.float()
    Bf = Bm.float().repeat_interleave(rep, dim=2)  # [B, T, H, N]
    Cf = Cm.float().repeat_interleave(rep, dim=2)

    def chunks(t):  # [B, T, ...] -> [B, c, L, ...] (zero padded; cat, as F.pad cannot take a symbolic pad)
        t = torch.cat([t, t.new_zeros(bsz, pad, *t.shape[2:])], dim=1)
        return t.reshape(bsz, nch, L, *t.shape[2:])

    xdt = chunks(xf * dtp[..., None])  # [B, c, L, H, P]
    Bc, Cc = chunks(Bf), chunks(Cf)  # [B, c, L, H, N]
    dA = chunks(dtp * A.float()).permute(0, 3, 1, 2)  # [B, H, c, L]
    cum = torch.cumsum(dA, dim=-1)

    # intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s
    decay = _segsum_exp(dA)  # [B, H, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc) * decay
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)

    # per-chunk end states from zero, then the chunk-to-chunk recurrence (log-depth scan over chunks)
    to_end = torch.exp(cum[..., -1:] - cum)  # [B, H, c, L]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bc, to_end, xdt)
    # state at the end of chunk c = sum_{z<=c} exp(sum_{z<j<=c} log-decay_j) states_z (+ the initial state
    # decayed through chunks 0..c): a [c, c] lower-triangular decay matrix, no loop over the chunk count
    chunk_log = cum[..., -1]  # [B, H, c]
    ends = torch.einsum("bhcz,bzhpn->bchpn", _segsum_exp(chunk_log), states)
    if initial_states is not None:
        a_cum = torch.exp(torch.cumsum(chunk_log, dim=-1)).permute(0, 2, 1)  # [B, c, H]
        ends = ends + a_cum[..., None, None] * initial_states.float()[:, None]
    init = initial_states.float() if initial_states is not None else states.new_zeros(states[:, 0].shape)
    starts = torch.cat([init[:, None], ends[:, :-1]], dim=1)  # state entering each chunk

    # inter-chunk (off-diagonal): y_l += exp(cum_l) C_l . start_state
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, starts, torch.exp(cum))
    y = y.reshape(bsz, nch * L, nheads, hdim)[:, :seqlen]
    if D is not None:
        y = y + D.float()[:, None] * xf
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype).contiguous(), ends[:, -1].contiguous()


def ssd_state_update_ref(
    state: torch.Tensor,  # [S, H, P, N], mutated
    x: torch.Tensor,  # [B, H, P]
    dt: torch.Tensor,  # [B, H]
    A: torch.Tensor,  # [H]
    Bm: torch.Tensor,  # [B, G, N]
    Cm: torch.Tensor,  # [B, G, N]
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    state_indices: torch.Tensor | None,
    A_is_log: bool = False,  # A holds A_log: A = -exp(A_log)
) -> torch.Tensor:
    nheads = x.shape[1]
    rep = nheads // Bm.shape[1]
    A = -torch.exp(A.float()) if A_is_log else A
    slots, valid = _slots(state_indices, x.shape[0], x.device)
    dtf = _dt(dt, dt_bias, dt_softplus).clamp(min=dt_min, max=dt_max)  # [B, H]
    xf = x.float()
    Bf = Bm.float().repeat_interleave(rep, dim=1)  # [B, H, N]
    Cf = Cm.float().repeat_interleave(rep, dim=1)
    dA = torch.exp(dtf * A.float())  # [B, H]
    h = state[slots].float() * dA[..., None, None] + (dtf[..., None] * Bf)[:, :, None, :] * xf[..., None]
    y = (h * Cf[:, :, None, :]).sum(-1)  # [B, H, P]
    if D is not None:
        y = y + D.float()[:, None] * xf
    if z is not None:
        y = y * F.silu(z.float())
    y = torch.where(valid[:, None, None], y, torch.zeros_like(y))
    _scatter_rows(state, slots, valid, h)
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# gated RMSNorm


def gated_rms_norm_ref(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor | None,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    group_size: int,
) -> torch.Tensor:
    """HF MambaRMSNormGated: weight * (normalized in fp32, cast to x.dtype); dtype = promote(weight, x)."""
    h = x.float()
    if z is not None:
        h = h * F.silu(z.float())
    shape = h.shape
    hg = h.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hg.reshape(shape).to(x.dtype)
