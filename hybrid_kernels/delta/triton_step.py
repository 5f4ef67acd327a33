"""The gated delta rule token by token in Triton (the math of reference.delta_rule_recurrent): the decode step.

One program per (batch row, value head, block of BV value columns) keeps its state block [K, BV] in registers
(fp32) over the row's T tokens (T = 1 at decode) and writes it back: in place into the row's slot of a state
table (``state_indices``, -1 = pad row: nothing written, output zeros) or into a separate final-state tensor. The
state is read once and written once, so the step runs at the state's copy bandwidth.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_config import CONFIG


@triton.jit(do_not_specialize=["T"])
def _delta_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, ht_ptr, idx_ptr,
                stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_gb, stride_gt, stride_gh, stride_bb, stride_bt, stride_bh, stride_ob, stride_ot, stride_oh,
                T, HV, REP, K, V, scale,
                BK: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, L2: tl.constexpr,
                HAS_IDX: tl.constexpr, HAS_H0: tl.constexpr):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // REP
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    slot = b
    if HAS_IDX:
        slot = tl.load(idx_ptr + b)
    state_off = (slot * HV + hv) * K * V + ck[:, None] * V + cv[None, :]
    hmask = mk[:, None] & mv[None, :]
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0 and slot >= 0:
        h = tl.load(h0_ptr + state_off, mask=hmask, other=0.0)
    for t in range(T):
        q = tl.load(q_ptr + b * stride_qb + t * stride_qt + hk * stride_qh + ck, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * stride_kb + t * stride_kt + hk * stride_kh + ck, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * stride_vb + t * stride_vt + hv * stride_vh + cv, mask=mv, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + b * stride_bb + t * stride_bt + hv * stride_bh).to(tl.float32)
        if L2:
            q = q * tl.rsqrt(tl.sum(q * q) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
        if PER_CHANNEL:
            g = tl.load(g_ptr + b * stride_gb + t * stride_gt + hv * stride_gh + ck, mask=mk, other=0.0)
            h = h * tl.exp(g.to(tl.float32))[:, None]
        else:
            g = tl.load(g_ptr + b * stride_gb + t * stride_gt + hv * stride_gh)
            h = h * tl.exp(g.to(tl.float32))
        delta = (v - tl.sum(h * k[:, None], axis=0)) * beta
        h = h + k[:, None] * delta[None, :]
        o = tl.sum(h * q[:, None], axis=0) * scale
        if slot < 0:
            o = tl.zeros([BV], dtype=tl.float32)
        tl.store(o_ptr + b * stride_ob + t * stride_ot + hv * stride_oh + cv, o.to(o_ptr.dtype.element_ty),
                 mask=mv)
    if slot >= 0:
        tl.store(ht_ptr + state_off, h, mask=hmask)


def delta_rule_step_triton(q, k, v, g, beta, scale: float, h0, ht, state_indices=None, use_l2norm: bool = True):
    """q, k [B, T, HK, K], v [B, T, HV, V], g [B, T, HV(, K)], beta [B, T, HV]; reads the state of every row from
    ``h0`` ([S, HV, K, V] fp32, None = zeros) at its slot and writes the state after the T tokens into ``ht`` (the
    same tensor for an in-place update). -> o [B, T, HV, V] in v's dtype."""
    B, T, HV, V = v.shape
    HK, K = k.shape[2], k.shape[3]
    if ht.dtype != torch.float32 or not ht.is_contiguous() or (h0 is not None and not h0.is_contiguous()):
        raise ValueError("delta-rule states must be contiguous fp32 [S, HV, K, V]")
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    per_channel = g.dim() == 4
    cfg = CONFIG["step"]
    BK = max(16, triton.next_power_of_2(K))
    BV = min(max(16, triton.next_power_of_2(V)), cfg["BV"])
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    gs = g.stride() if per_channel else (*g.stride(), 0)
    idx = state_indices if state_indices is not None else ht
    _delta_step[(B, HV, triton.cdiv(V, BV))](
        q, k, v, g, beta, o, h0 if h0 is not None else ht, ht, idx,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), gs[0], gs[1], gs[2], beta.stride(0), beta.stride(1), beta.stride(2),
        o.stride(0), o.stride(1), o.stride(2), T, HV, HV // HK, K, V, scale,
        BK=BK, BV=BV, PER_CHANNEL=per_channel, L2=use_l2norm, HAS_IDX=state_indices is not None,
        HAS_H0=h0 is not None, num_warps=cfg["warps"])
    return o
