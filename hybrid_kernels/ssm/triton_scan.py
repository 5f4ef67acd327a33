"""Mamba1 selective scan (prefill) and selective state update (decode).

Prefill: one program per (batch row, block of BLOCK_D channels) walks T in chunks of BLOCK_T steps. A
chunk's recurrence h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t is solved for all [BLOCK_D, N, BLOCK_T]
elements at once with ``tl.associative_scan`` (no per-step loads); the fp32 state [BLOCK_D, N] is carried
in registers between chunks. The D skip and the silu(z) gate are fused; the final state is returned.
Traffic (bf16): u, delta, z read and y written once (8 B per channel-step) + B, C (4 B per step-state).

Decode: one program per (row, block of channels) reads its state slot, updates it in place and writes
y; pad rows (slot -1) touch nothing and get y = 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from hybrid_kernels.library import pdl_opts, pdl_start
from hybrid_kernels.triton_shared import silu

from .triton_config import CONFIG, next_pow2


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def _linear_combine(a_l, b_l, a_r, b_r):
    # (a_l, b_l) then (a_r, b_r): h -> a_r * (a_l * h + b_l) + b_r
    return a_l * a_r, a_r * b_l + b_r


@triton.jit(do_not_specialize=["T"])
def _selective_scan_kernel(
    u_ptr, dl_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, db_ptr, h0_ptr, y_ptr, hT_ptr,
    DIM, T, N,
    sub, sud, sut, sdb, sdd, sdt, sAd, sAn, sBb, sBn, sBt, sCb, sCn, sCt, szb, szd, szt,
    shb, shd, shn, syb, syd, syt,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DB: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_T)
    md = offs_d < DIM
    mn = offs_n < N
    mdn = md[:, None] & mn[None, :]

    A = tl.load(A_ptr + offs_d[:, None] * sAd + offs_n[None, :] * sAn, mask=mdn, other=0.0).to(tl.float32)
    h_ptrs = offs_d[:, None] * shd + offs_n[None, :] * shn
    if HAS_H0:
        h = tl.load(h0_ptr + b * shb + h_ptrs, mask=mdn, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    if HAS_DB:
        dbias = tl.load(db_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    if HAS_D:
        dskip = tl.load(D_ptr + offs_d, mask=md, other=0.0).to(tl.float32)

    u_base = u_ptr + b * sub + offs_d[:, None] * sud
    d_base = dl_ptr + b * sdb + offs_d[:, None] * sdd
    z_base = z_ptr + b * szb + offs_d[:, None] * szd
    y_base = y_ptr + b * syb + offs_d[:, None] * syd
    B_base = B_ptr + b * sBb + offs_n[:, None] * sBn
    C_base = C_ptr + b * sCb + offs_n[:, None] * sCn
    for t0 in range(0, T, BLOCK_T):
        offs_t = (t0 + offs_l).to(tl.int64)
        mt = offs_t < T
        mdt = md[:, None] & mt[None, :]
        mnt = mn[:, None] & mt[None, :]
        dt = tl.load(d_base + offs_t[None, :] * sdt, mask=mdt, other=0.0).to(tl.float32)  # [BD, BT]
        if HAS_DB:
            dt += dbias[:, None]
        if SOFTPLUS:
            dt = _softplus(dt)
        u = tl.load(u_base + offs_t[None, :] * sut, mask=mdt, other=0.0).to(tl.float32)
        Bt = tl.load(B_base + offs_t[None, :] * sBt, mask=mnt, other=0.0).to(tl.float32)  # [BN, BT]
        Ct = tl.load(C_base + offs_t[None, :] * sCt, mask=mnt, other=0.0).to(tl.float32)
        # steps past T are identities (a = 1, b = 0) so the last column is the state at T-1
        dA = tl.exp(dt[:, None, :] * A[:, :, None])  # [BD, BN, BT]
        dA = tl.where(mt[None, None, :], dA, 1.0)
        dBu = (dt * u)[:, None, :] * Bt[None, :, :]  # padded steps have B = 0
        a_cum, b_cum = tl.associative_scan((dA, dBu), 2, _linear_combine)
        hs = a_cum * h[:, :, None] + b_cum  # state after each step
        y = tl.sum(hs * Ct[None, :, :], axis=1)  # [BD, BT]
        h = tl.sum(tl.where((offs_l == BLOCK_T - 1)[None, None, :], hs, 0.0), axis=2)
        if HAS_D:
            y += dskip[:, None] * u
        if HAS_Z:
            zz = tl.load(z_base + offs_t[None, :] * szt, mask=mdt, other=0.0).to(tl.float32)
            y = y * silu(zz)
        tl.store(y_base + offs_t[None, :] * syt, y.to(y_ptr.dtype.element_ty), mask=mdt)
    hT_ptrs = hT_ptr + b * DIM * N + offs_d[:, None] * N + offs_n[None, :]
    tl.store(hT_ptrs, h, mask=mdn)


def selective_scan_triton(
    u: torch.Tensor,  # [B, D, T]
    delta: torch.Tensor,  # [B, D, T]
    A: torch.Tensor,  # [D, N] fp32
    Bm: torch.Tensor,  # [B, N, T]
    Cm: torch.Tensor,  # [B, N, T]
    D: torch.Tensor | None,  # [D]
    z: torch.Tensor | None,  # [B, D, T]
    delta_bias: torch.Tensor | None,  # [D]
    delta_softplus: bool,
    initial_state: torch.Tensor | None,  # [B, D, N]
) -> tuple[torch.Tensor, torch.Tensor]:
    bsz, dim, seqlen = u.shape
    dstate = A.shape[1]
    assert delta.shape == u.shape and A.shape[0] == dim, "u/delta/A shapes differ"
    assert Bm.shape == (bsz, dstate, seqlen) and Cm.shape == (bsz, dstate, seqlen), "B/C must be [B, N, T]"
    y = torch.empty(bsz, dim, seqlen, dtype=u.dtype, device=u.device)
    hT = torch.empty(bsz, dim, dstate, dtype=torch.float32, device=u.device)
    cfg = CONFIG["scan"]
    bn = next_pow2(dstate)
    bt = cfg["BLOCK_T"]  # independent of T: no specialisation on the prompt length under torch.compile
    bd = max(1, min(cfg["TILE"] // (bn * bt), next_pow2(dim)))
    grid = (triton.cdiv(dim, bd), bsz)
    zz = z if z is not None else u
    h0 = initial_state if initial_state is not None else hT
    wrap_triton(_selective_scan_kernel)[grid](
        u, delta, A, Bm, Cm, D if D is not None else A, zz, delta_bias if delta_bias is not None else A,
        h0, y, hT,
        dim, seqlen, dstate,
        u.stride(0), u.stride(1), u.stride(2), delta.stride(0), delta.stride(1), delta.stride(2),
        A.stride(0), A.stride(1), Bm.stride(0), Bm.stride(1), Bm.stride(2), Cm.stride(0), Cm.stride(1),
        Cm.stride(2), zz.stride(0), zz.stride(1), zz.stride(2), h0.stride(0), h0.stride(1), h0.stride(2),
        y.stride(0), y.stride(1), y.stride(2),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DB=delta_bias is not None, SOFTPLUS=bool(delta_softplus),
        HAS_H0=initial_state is not None, BLOCK_D=bd, BLOCK_N=bn, BLOCK_T=bt, num_warps=cfg["num_warps"],
    )
    return y, hT


@triton.jit
def _selective_state_update_kernel(
    st_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, db_ptr, idx_ptr, y_ptr,
    DIM, N,
    sss, ssd, ssn, sxb, sxd, sdtb, sdtd, sAd, sAn, sBb, sBn, sCb, sCn, szb, szd, syb, syd,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DB: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_IDX: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid_d = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    if HAS_IDX:
        slot = tl.load(idx_ptr + row).to(tl.int64)
    else:
        slot = row
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    md = offs_d < DIM
    mn = offs_n < N
    valid_d = (offs_d * 0 + slot) >= 0  # a vector: the interpreter rejects vector & scalar masks
    mdn = (md & valid_d)[:, None] & mn[None, :]

    s_ptrs = st_ptr + slot * sss + offs_d[:, None] * ssd + offs_n[None, :] * ssn
    s = tl.load(s_ptrs, mask=mdn, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * sdtb + offs_d * sdtd, mask=md, other=0.0).to(tl.float32)
    if HAS_DB:
        dt += tl.load(db_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = _softplus(dt)
    x = tl.load(x_ptr + row * sxb + offs_d * sxd, mask=md, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + offs_d[:, None] * sAd + offs_n[None, :] * sAn, mask=md[:, None] & mn[None, :],
                other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + row * sBb + offs_n * sBn, mask=mn, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + row * sCb + offs_n * sCn, mask=mn, other=0.0).to(tl.float32)
    s = s * tl.exp(dt[:, None] * A) + (dt[:, None] * Bv[None, :]) * x[:, None]
    tl.store(s_ptrs, s.to(st_ptr.dtype.element_ty), mask=mdn)
    y = tl.sum(s * Cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(D_ptr + offs_d, mask=md, other=0.0).to(tl.float32) * x
    if HAS_Z:
        y = y * silu(tl.load(z_ptr + row * szb + offs_d * szd, mask=md, other=0.0).to(tl.float32))
    y = tl.where(valid_d, y, 0.0)
    tl.store(y_ptr + row * syb + offs_d * syd, y.to(y_ptr.dtype.element_ty), mask=md)


def selective_state_update_triton(
    state: torch.Tensor,  # [S, D, N], updated in place (fp32 / bf16 / fp16)
    x: torch.Tensor,  # [B, D]
    dt: torch.Tensor,  # [B, D]
    A: torch.Tensor,  # [D, N]
    Bm: torch.Tensor,  # [B, N]
    Cm: torch.Tensor,  # [B, N]
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    state_indices: torch.Tensor | None,  # [B] int32, -1 = pad row
) -> torch.Tensor:
    bsz, dim = x.shape
    dstate = state.shape[2]
    assert state.shape[1] == dim and A.shape == (dim, dstate), "state/A shapes differ from x"
    y = torch.empty(bsz, dim, dtype=x.dtype, device=x.device)
    cfg = CONFIG["scan_update"]
    bn = next_pow2(dstate)
    bd = max(1, min(cfg["TILE"] // bn, next_pow2(dim)))
    grid = (triton.cdiv(dim, bd), bsz)
    zz = z if z is not None else x
    wrap_triton(_selective_state_update_kernel)[grid](
        state, x, dt, A, Bm, Cm, D if D is not None else A, zz, dt_bias if dt_bias is not None else A,
        state_indices if state_indices is not None else y, y,
        dim, dstate,
        state.stride(0), state.stride(1), state.stride(2), x.stride(0), x.stride(1), dt.stride(0), dt.stride(1),
        A.stride(0), A.stride(1), Bm.stride(0), Bm.stride(1), Cm.stride(0), Cm.stride(1), zz.stride(0),
        zz.stride(1), y.stride(0), y.stride(1),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DB=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
        HAS_IDX=state_indices is not None, BLOCK_D=bd, BLOCK_N=bn, num_warps=cfg["num_warps"], **pdl_opts(x),
    )
    return y
