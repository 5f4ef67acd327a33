"""Mamba2 SSD: chunked scan (prefill) and the per-token state update (decode).

Prefill runs in chunks of L steps (L is ours to pick: the result does not depend on it beyond rounding):
  1. ``_ssd_dt_kernel`` per (b, head, chunk): dt = clamp(softplus(dt + bias)) and the within-chunk cumsum of
     dt*A, to two small fp32 workspaces [B, H, nchunks*L].
  2. ``_ssd_states_kernel`` per (b, head, P-block, N-block), sequential over the chunks: stores each chunk's
     start state (x.dtype, for step 4's dot), then s = exp(total) s + x^T (B exp(total - cum) dt) with one
     tl.dot; the final state stays fp32. Chunk states never go to memory in fp32, and the loop body holds
     only loads that do not depend on s, so the pipeliner loads the next chunk while this one is used.
  3. ``_ssd_cb_kernel`` (CONFIG["ssd"]["CB"]) per (b, chunk, group): C.B^T [L, L] once, shared by the
     group's heads instead of recomputed by each head in step 4.
  4. ``_ssd_chunk_scan_kernel`` per (b, chunk, M-block, head, P-block):
     y_m = exp(cum_m) C_m . start_state + sum_{k<=m} (C_m B_k^T * exp(cum_m - cum_k) * dt_k) x_k + D x_m,
     gated by silu(z) if given; source blocks past the diagonal are skipped.
Heads vary fastest in the launch order so programs running together share a chunk's B/C/CB in L2.
Traffic per token (bf16, 128 heads x 64 x 128, L = 128): x read twice + y written (48 KB), start states
written and read in bf16 (2 MB per chunk / L, twice: 32 KB); ~80 KB/token in all.
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
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; exact fp32 products for fp32 inputs (tests), tensor cores otherwise."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _process_dt(dt_raw, db_ptr, h, dt_min, dt_max, HAS_DB: tl.constexpr, SOFTPLUS: tl.constexpr):
    """raw dt values (any shape) -> clamp(softplus(dt + bias[h]), dt_min, dt_max) in fp32."""
    dt = dt_raw.to(tl.float32)
    if HAS_DB:
        dt += tl.load(db_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = _softplus(dt)
    # the bounds may arrive as fp64 scalars (Inductor's wrapper): keep dt fp32 for the loop-carried sums
    return tl.minimum(tl.maximum(dt, tl.cast(dt_min, tl.float32)), tl.cast(dt_max, tl.float32))


@triton.jit(do_not_specialize=["T", "nchunks"])
def _ssd_dt_kernel(
    dt_ptr, A_ptr, db_ptr, dtw_ptr, cum_ptr, T, H, nchunks, dt_min, dt_max, sdb, sdt, sdh,
    HAS_DB: tl.constexpr, SOFTPLUS: tl.constexpr, L: tl.constexpr,
):
    """Per (b, head, chunk): processed dt and the within-chunk cumsum of dt*A, to the [B, H, nchunks*L] workspaces."""
    pid = tl.program_id(0)
    c = pid % nchunks
    bh = (pid // nchunks).to(tl.int64)
    b = bh // H
    h = bh % H
    t = (c * L + tl.arange(0, L)).to(tl.int64)
    mt = t < T
    dt = _process_dt(tl.load(dt_ptr + b * sdb + h * sdh + t * sdt, mask=mt, other=0.0), db_ptr, h, dt_min, dt_max,
                     HAS_DB, SOFTPLUS)
    dt = tl.where(mt, dt, 0.0)
    ws = bh * (nchunks * L) + c * L + tl.arange(0, L)
    tl.store(dtw_ptr + ws, dt)
    tl.store(cum_ptr + ws, tl.cumsum(dt * tl.load(A_ptr + h).to(tl.float32), 0))


@triton.jit(do_not_specialize=["T", "nchunks"])
def _ssd_states_kernel(
    x_ptr, B_ptr, h0_ptr, dtw_ptr, cum_ptr, prev_ptr, fin_ptr,
    T, H, P, N, nchunks, n_pblk, n_nblk, hpg,
    sxb, sxt, sxh, sxp, sBb, sBt, sBg, sBn, shb, shh, shp, shn,
    HAS_H0: tl.constexpr, L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    """Chunk states and state passing in one sweep over the chunks, per (b, head, P-block, N-block):
    store the chunk's start state, then s = exp(total) s + sum_l x_l^T (exp(total - cum_l) dt_l) B_l.
    dt and cum come from the workspaces, so the sequential chain holds only loads, a scale and one dot."""
    pid = tl.program_id(0)
    nb = pid % n_nblk
    rest = pid // n_nblk
    pb = rest % n_pblk
    bh = (rest // n_pblk).to(tl.int64)
    b = bh // H
    h = bh % H
    g = h // hpg
    offs_l = tl.arange(0, L)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    mpn = mp[:, None] & mn[None, :]
    if HAS_H0:
        s = tl.load(h0_ptr + b * shb + h * shh + offs_p[:, None] * shp + offs_n[None, :] * shn, mask=mpn,
                    other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    x_base = x_ptr + b * sxb + h * sxh
    B_base = B_ptr + b * sBb + g * sBg
    ws = bh * (nchunks * L)
    PN = P * N
    for c in range(nchunks):
        t = (c * L + offs_l).to(tl.int64)
        mt = t < T
        dt = tl.load(dtw_ptr + ws + c * L + offs_l)
        cum = tl.load(cum_ptr + ws + c * L + offs_l)
        total = tl.load(cum_ptr + ws + c * L + (L - 1))
        st = prev_ptr + ((b * nchunks + c) * H + h) * PN
        tl.store(st + offs_p[:, None] * N + offs_n[None, :], s.to(prev_ptr.dtype.element_ty), mask=mpn)
        xt = tl.load(x_base + offs_p[:, None] * sxp + t[None, :] * sxt, mask=mp[:, None] & mt[None, :],
                     other=0.0)  # [P, L]
        xw = (xt.to(tl.float32) * (tl.exp(total - cum) * dt)[None, :]).to(xt.dtype)
        Bk = tl.load(B_base + t[:, None] * sBt + offs_n[None, :] * sBn, mask=mt[:, None] & mn[None, :],
                     other=0.0).to(xt.dtype)  # [L, N]
        s = _dot(xw, Bk, s * tl.exp(total), IEEE)
    tl.store(fin_ptr + bh * PN + offs_p[:, None] * N + offs_n[None, :], s, mask=mpn)


@triton.jit(do_not_specialize=["T", "nchunks"])
def _ssd_cb_kernel(
    B_ptr, C_ptr, cb_ptr,
    T, G, N, nchunks, n_mblk,
    sBb, sBt, sBg, sBn, sCb, sCt, sCg, sCn,
    L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    kb = pid % n_mblk
    rest = pid // n_mblk
    mb = rest % n_mblk
    rest = rest // n_mblk
    g = rest % G
    rest = rest // G
    c = rest % nchunks
    b = (rest // nchunks).to(tl.int64)
    if kb <= mb:  # blocks above the diagonal are never read
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = kb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        mn = offs_n < N
        tm = (c * L + offs_m).to(tl.int64)
        tk = (c * L + offs_k).to(tl.int64)
        Cm = tl.load(C_ptr + b * sCb + g * sCg + tm[:, None] * sCt + offs_n[None, :] * sCn,
                     mask=(tm < T)[:, None] & mn[None, :], other=0.0)
        Bk = tl.load(B_ptr + b * sBb + g * sBg + tk[None, :] * sBt + offs_n[:, None] * sBn,
                     mask=(tk < T)[None, :] & mn[:, None], other=0.0)  # [N, K]
        cb = _dot(Cm, Bk.to(Cm.dtype), tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32), IEEE)
        base = cb_ptr + ((b * nchunks + c) * G + g) * (L * L)
        tl.store(base + offs_m[:, None] * L + offs_k[None, :], cb)


@triton.jit(do_not_specialize=["T", "nchunks"])
def _ssd_chunk_scan_kernel(
    x_ptr, z_ptr, B_ptr, C_ptr, D_ptr, dtw_ptr, cum_ptr, prev_ptr, cb_ptr, y_ptr,
    T, H, P, N, G, nchunks, n_pblk, n_mblk, hpg,
    sxb, sxt, sxh, sxp, szb, szt, szh, szp, sBb, sBt, sBg, sBn, sCb, sCt, sCg, sCn,
    syb, syt, syh, syp,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_CB: tl.constexpr, L: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    pb = pid % n_pblk
    rest = pid // n_pblk
    h = rest % H
    rest = rest // H
    mb = rest % n_mblk
    rest = rest // n_mblk
    c = rest % nchunks
    b = (rest // nchunks).to(tl.int64)
    g = h // hpg
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # position in the chunk
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, BLOCK_K)
    mp = offs_p < P
    mn = offs_n < N
    tm = (c * L + offs_m).to(tl.int64)
    mm = tm < T
    ws = (b * H + h) * (nchunks * L) + c * L
    cum_m = tl.load(cum_ptr + ws + offs_m)

    # inter-chunk: exp(cum_m) * C_m . start_state  ([M, N] @ [N, P])
    Cm = tl.load(C_ptr + b * sCb + g * sCg + tm[:, None] * sCt + offs_n[None, :] * sCn,
                 mask=mm[:, None] & mn[None, :], other=0.0)
    prev = tl.load(prev_ptr + ((b * nchunks + c) * H + h) * (P * N) + offs_p[None, :] * N + offs_n[:, None],
                   mask=mn[:, None] & mp[None, :], other=0.0)  # [N, P]
    acc = _dot(Cm.to(prev.dtype), prev, tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32), IEEE)
    acc = acc * tl.exp(cum_m)[:, None]

    # intra-chunk, causal: source blocks up to the end of this M-block
    x_base = x_ptr + b * sxb + h * sxh
    cb_base = cb_ptr + ((b * nchunks + c) * G + g) * (L * L)
    for k0 in range(0, (mb + 1) * BLOCK_M, BLOCK_K):
        offs_k = k0 + offs_kk
        tk = (c * L + offs_k).to(tl.int64)
        mk = tk < T
        if HAS_CB:
            cb = tl.load(cb_base + offs_m[:, None] * L + offs_k[None, :])
        else:
            Bk = tl.load(B_ptr + b * sBb + g * sBg + tk[None, :] * sBt + offs_n[:, None] * sBn,
                         mask=mk[None, :] & mn[:, None], other=0.0)  # [N, K]
            cb = _dot(Cm, Bk.to(Cm.dtype), tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32), IEEE)
        cum_k = tl.load(cum_ptr + ws + offs_k)
        dt_k = tl.load(dtw_ptr + ws + offs_k)
        seg = tl.where(offs_m[:, None] >= offs_k[None, :], cum_m[:, None] - cum_k[None, :], float("-inf"))
        cb = cb * tl.exp(seg) * dt_k[None, :]
        xk = tl.load(x_base + tk[:, None] * sxt + offs_p[None, :] * sxp, mask=mk[:, None] & mp[None, :],
                     other=0.0)  # [K, P]
        acc = _dot(cb.to(xk.dtype), xk, acc, IEEE)

    mmp = mm[:, None] & mp[None, :]
    if HAS_D:
        xm = tl.load(x_base + tm[:, None] * sxt + offs_p[None, :] * sxp, mask=mmp, other=0.0).to(tl.float32)
        acc += tl.load(D_ptr + h).to(tl.float32) * xm
    if HAS_Z:
        zm = tl.load(z_ptr + b * szb + h * szh + tm[:, None] * szt + offs_p[None, :] * szp, mask=mmp,
                     other=0.0).to(tl.float32)
        acc = acc * silu(zm)
    y_ptrs = y_ptr + b * syb + h * syh + tm[:, None] * syt + offs_p[None, :] * syp
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmp)


def _dt_limits(dt_min: float, dt_max: float) -> tuple[float, float]:
    """Finite clamp bounds: an ``inf`` kernel argument would have to survive Inductor's wrapper codegen."""
    big = 3.0e38
    return max(float(dt_min), -big), min(float(dt_max), big)


def _states_tile(rows: int, hdim: int, dstate: int, L: int, esize: int, cfg: dict) -> tuple[int, int]:
    """(P, N) state tile of one ``_ssd_states_kernel`` program for ``rows`` = B * H sequences of heads."""
    sp = min(cfg["STATE_BLOCK_P"], max(next_pow2(hdim), 16))
    sn = min(cfg["STATE_BLOCK_N"], max(next_pow2(dstate), 16))
    while sn > 32 and rows * triton.cdiv(hdim, sp) * triton.cdiv(dstate, sn) < cfg["STATE_MIN_PROGRAMS"]:
        sn //= 2  # one program per SM at least: the kernel is sequential over the chunks
    while cfg["state_num_stages"] * (sp + sn) * L * esize > cfg["STATE_SMEM"] and max(sp, sn) > 16:
        if sn >= sp:  # the staged x [P, L] and B [L, N] tiles must fit shared memory (fp32, long chunks)
            sn //= 2
        else:
            sp //= 2
    return sp, sn


def _chunk_len(chunk_size: int) -> int:
    want = CONFIG["ssd"]["CHUNK"] or chunk_size
    return min(max(next_pow2(want), 16), 256)


def ssd_scan_triton(
    x: torch.Tensor,  # [B, T, H, P]
    dt: torch.Tensor,  # [B, T, H]
    A: torch.Tensor,  # [H] fp32
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
    assert seqlen >= 1, "ssd_scan needs T >= 1"
    assert nheads % ngroups == 0, f"{nheads} heads are not a multiple of {ngroups} groups"
    assert dt.shape == (bsz, seqlen, nheads) and A.shape == (nheads,), "dt must be [B, T, H] and A [H]"
    assert Bm.shape == Cm.shape == (bsz, seqlen, ngroups, dstate), "B and C must be [B, T, G, N]"
    cfg = CONFIG["ssd"]
    dev = x.device
    L = _chunk_len(chunk_size)
    nch = triton.cdiv(seqlen, L)
    bm = min(cfg["BLOCK_M"], L)
    bk = min(cfg["BLOCK_K"], L)
    bp = min(cfg["BLOCK_P"], max(next_pow2(hdim), 16))
    bn = max(next_pow2(dstate), 16)
    n_pblk = triton.cdiv(hdim, bp)
    n_mblk = L // bm
    hpg = nheads // ngroups
    ieee = x.dtype == torch.float32
    use_cb = bool(cfg["CB"])

    dtw = torch.empty(bsz, nheads, nch * L, dtype=torch.float32, device=dev)
    cum = torch.empty(bsz, nheads, nch * L, dtype=torch.float32, device=dev)
    prev = torch.empty(bsz, nch, nheads, hdim, dstate, dtype=x.dtype, device=dev)
    final = torch.empty(bsz, nheads, hdim, dstate, dtype=torch.float32, device=dev)
    y = torch.empty(bsz, seqlen, nheads, hdim, dtype=x.dtype, device=dev)
    db = dt_bias if dt_bias is not None else A
    h0 = initial_states if initial_states is not None else final

    sp, sn = _states_tile(bsz * nheads, hdim, dstate, L, x.element_size(), cfg)
    n_sp, n_sn = triton.cdiv(hdim, sp), triton.cdiv(dstate, sn)
    wrap_triton(_ssd_dt_kernel)[(bsz * nheads * nch,)](
        dt, A, db, dtw, cum, seqlen, nheads, nch, *_dt_limits(dt_min, dt_max),
        dt.stride(0), dt.stride(1), dt.stride(2),
        HAS_DB=dt_bias is not None, SOFTPLUS=bool(dt_softplus), L=L,
    )
    wrap_triton(_ssd_states_kernel)[(bsz * nheads * n_sp * n_sn,)](
        x, Bm, h0, dtw, cum, prev, final,
        seqlen, nheads, hdim, dstate, nch, n_sp, n_sn, hpg,
        x.stride(0), x.stride(1), x.stride(2), x.stride(3),
        Bm.stride(0), Bm.stride(1), Bm.stride(2), Bm.stride(3),
        h0.stride(0), h0.stride(1), h0.stride(2), h0.stride(3),
        HAS_H0=initial_states is not None, L=L, BLOCK_P=sp, BLOCK_N=sn, IEEE=ieee,
        num_warps=cfg["state_num_warps"], num_stages=cfg["state_num_stages"],
    )
    if use_cb:
        cb = torch.empty(bsz, nch, ngroups, L, L, dtype=torch.float32, device=dev)
        wrap_triton(_ssd_cb_kernel)[(bsz * nch * ngroups * n_mblk * n_mblk,)](
            Bm, Cm, cb, seqlen, ngroups, dstate, nch, n_mblk,
            Bm.stride(0), Bm.stride(1), Bm.stride(2), Bm.stride(3), Cm.stride(0), Cm.stride(1), Cm.stride(2),
            Cm.stride(3),
            L=L, BLOCK_M=bm, BLOCK_N=bn, IEEE=ieee, num_warps=cfg["num_warps"],
        )
    else:
        cb = dtw
    zz = z if z is not None else x
    wrap_triton(_ssd_chunk_scan_kernel)[(bsz * nch * n_mblk * nheads * n_pblk,)](
        x, zz, Bm, Cm, D if D is not None else A, dtw, cum, prev, cb, y,
        seqlen, nheads, hdim, dstate, ngroups, nch, n_pblk, n_mblk, hpg,
        x.stride(0), x.stride(1), x.stride(2), x.stride(3), zz.stride(0), zz.stride(1), zz.stride(2),
        zz.stride(3), Bm.stride(0), Bm.stride(1), Bm.stride(2), Bm.stride(3), Cm.stride(0), Cm.stride(1),
        Cm.stride(2), Cm.stride(3), y.stride(0), y.stride(1), y.stride(2), y.stride(3),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_CB=use_cb, L=L, BLOCK_M=bm, BLOCK_K=bk, BLOCK_P=bp,
        BLOCK_N=bn, IEEE=ieee, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y, final


@triton.jit
def _ssd_state_update_kernel(
    st_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, db_ptr, idx_ptr, y_ptr,
    H, P, N, n_pblk, hpg, dt_min, dt_max,
    sss, ssh, ssp, ssn, sxb, sxh, sxp, sdtb, sdth, sBb, sBg, sBn, sCb, sCg, sCn, szb, szh, szp,
    syb, syh, syp,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DB: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_IDX: tl.constexpr, A_LOG: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    pb = pid % n_pblk
    h = pid // n_pblk
    g = h // hpg
    if HAS_IDX:
        slot = tl.load(idx_ptr + row).to(tl.int64)
    else:
        slot = row
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    valid_p = (offs_p * 0 + slot) >= 0  # a vector: the interpreter rejects vector & scalar masks
    mpn = (mp & valid_p)[:, None] & mn[None, :]

    s_ptrs = st_ptr + slot * sss + h * ssh + offs_p[:, None] * ssp + offs_n[None, :] * ssn
    s = tl.load(s_ptrs, mask=mpn, other=0.0).to(tl.float32)
    dt = _process_dt(tl.load(dt_ptr + row * sdtb + h * sdth), db_ptr, h, dt_min, dt_max, HAS_DB, SOFTPLUS)
    a = tl.load(A_ptr + h).to(tl.float32)
    if A_LOG:  # A given as HF's A_log parameter: A = -exp(A_log), here rather than in a kernel of its own
        a = -tl.exp(a)
    dA = tl.exp(dt * a)
    x = tl.load(x_ptr + row * sxb + h * sxh + offs_p * sxp, mask=mp, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + row * sBb + g * sBg + offs_n * sBn, mask=mn, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + row * sCb + g * sCg + offs_n * sCn, mask=mn, other=0.0).to(tl.float32)
    s = s * dA + (dt * Bv)[None, :] * x[:, None]
    tl.store(s_ptrs, s.to(st_ptr.dtype.element_ty), mask=mpn)
    y = tl.sum(s * Cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * x
    if HAS_Z:
        y = y * silu(tl.load(z_ptr + row * szb + h * szh + offs_p * szp, mask=mp, other=0.0).to(tl.float32))
    y = tl.where(valid_p, y, 0.0)
    tl.store(y_ptr + row * syb + h * syh + offs_p * syp, y.to(y_ptr.dtype.element_ty), mask=mp)


def ssd_state_update_triton(
    state: torch.Tensor,  # [S, H, P, N], updated in place (fp32 / bf16 / fp16)
    x: torch.Tensor,  # [B, H, P]
    dt: torch.Tensor,  # [B, H]
    A: torch.Tensor,  # [H]
    Bm: torch.Tensor,  # [B, G, N]
    Cm: torch.Tensor,  # [B, G, N]
    D: torch.Tensor | None,  # [H]
    z: torch.Tensor | None,  # [B, H, P]
    dt_bias: torch.Tensor | None,  # [H]
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    state_indices: torch.Tensor | None,  # [B] int32, -1 = pad row
    A_is_log: bool = False,  # A holds A_log: A = -exp(A_log)
) -> torch.Tensor:
    bsz, nheads, hdim = x.shape
    ngroups, dstate = Bm.shape[1], Bm.shape[2]
    assert state.shape[1:] == (nheads, hdim, dstate), f"state {tuple(state.shape)} vs x {tuple(x.shape)}"
    assert nheads % ngroups == 0, f"{nheads} heads are not a multiple of {ngroups} groups"
    y = torch.empty(bsz, nheads, hdim, dtype=x.dtype, device=x.device)
    cfg = CONFIG["ssd_update"]
    bn = next_pow2(dstate)
    bp = max(1, min(cfg["TILE"] // bn, next_pow2(hdim)))
    n_pblk = triton.cdiv(hdim, bp)
    zz = z if z is not None else x
    wrap_triton(_ssd_state_update_kernel)[(nheads * n_pblk, bsz)](
        state, x, dt, A, Bm, Cm, D if D is not None else A, zz, dt_bias if dt_bias is not None else A,
        state_indices if state_indices is not None else y, y,
        nheads, hdim, dstate, n_pblk, nheads // ngroups, *_dt_limits(dt_min, dt_max),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), x.stride(0), x.stride(1),
        x.stride(2), dt.stride(0), dt.stride(1), Bm.stride(0), Bm.stride(1), Bm.stride(2), Cm.stride(0),
        Cm.stride(1), Cm.stride(2), zz.stride(0), zz.stride(1), zz.stride(2), y.stride(0), y.stride(1),
        y.stride(2),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DB=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
        HAS_IDX=state_indices is not None, A_LOG=bool(A_is_log), BLOCK_P=bp, BLOCK_N=bn, num_warps=cfg["num_warps"],
        **pdl_opts(x),
    )
    return y
