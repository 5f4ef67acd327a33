"""Chunked prefill of the gated delta rule in Triton (the math of reference.delta_rule_chunked), three kernels:

1. ``_chunk_prepare``, one program per (chunk, value head), all chunks in parallel: the in-chunk cumulative decay G,
   the UT system L = strict_lower(beta_i k_i.k_j exp(G_i - G_j)) inverted blockwise in registers
   (``_solve_unit_lower``: 16 x 16 diagonal blocks by forward substitution, stable where a product formula is not,
   since L's powers grow binomially for near-equal keys; the blocks below by products of those),
   w = (I + L)^-1 (beta k exp(G)), u = (I + L)^-1 (beta v) and the in-chunk attention
   Aqk = tril(scale q_i.k_j exp(G_i - G_j)).
   With a decay per key channel (Kimi Delta Attention) exp(G_i - G_j) differs per channel: the pairwise products
   are taken on 16 x 16 sub-blocks, off-diagonal ones as (x_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)) with G_r the
   decay at the first row of block i (both factors <= 1, no overflow), diagonal ones channel by channel; the k.k and
   q.k products of a block share their loads and exponentials.
2. ``_chunk_state``, one program per (sequence, value head, block of V columns), sequential over the sequence's
   chunks with the state block [K, BV] in registers (fp32): stores the state each chunk starts from and
   v' = u - w S, then S <- exp(G_last) S + (k exp(G_last - G))^T v'; initial and final states per sequence.
3. ``_chunk_output``, one program per (chunk, value head, block of V columns), all chunks in parallel:
   o = (q exp(G)) S_chunk + Aqk v'.

Sequences are packed along one token axis (``cu_seqlens``); a [B, T] batch is B sequences of T. The chunk table is
built on the device (no host sync), so a launch records into a CUDA graph.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_config import CONFIG


@triton.jit
def _rows(ptr, rows, mask, stride_t, cols, ncols, L2: tl.constexpr):
    """Rows ``rows`` [R] x columns [BK] of a [tokens, D] head view as fp32, zero outside; L2-normalised if asked."""
    x = tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=mask[:, None] & (cols[None, :] < ncols),
                other=0.0).to(tl.float32)
    if L2:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _decay_pairs(q_ptr, k_ptr, G_ptr, base, stride_qt, stride_kt, stride_gt, I: tl.constexpr, J: tl.constexpr, K,
                 scale, SUB: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, L2: tl.constexpr, end,
                 PAIR_PREC: tl.constexpr):
    """Block (I, J) of the two pairwise products under a decay per key channel, sum_d x_i[d] k_j[d] exp(G_i[d] -
    G_j[d]) for x = k (masked to j < i) and x = scale q (j <= i), as [SUB, SUB] fp32 (lk, aq); both share every
    load and exponential. ``PAIR_PREC``: the off-diagonal products' precision ("ieee", "tf32", or "16": operands
    rounded to the inputs' 16-bit dtype, fp32 sums)."""
    ri = base + I * SUB + tl.arange(0, SUB)
    rj = base + J * SUB + tl.arange(0, SUB)
    mi, mj = ri < end, rj < end
    cols = tl.arange(0, BK)
    ii = tl.arange(0, SUB)
    if J < I:
        qi = _rows(q_ptr, ri, mi, stride_qt, cols, K, L2) * scale
        ki = _rows(k_ptr, ri, mi, stride_kt, cols, K, L2)
        kj = _rows(k_ptr, rj, mj, stride_kt, cols, K, L2)
        gi = _rows(G_ptr, ri, mi, stride_gt, cols, K, False)
        gj = _rows(G_ptr, rj, mj, stride_gt, cols, K, False)
        # G_r: the first row of block i (rows past the end hold no G: then every row of the block is dropped)
        lim = tl.where(base + I * SUB < end, K, 0)
        ref = tl.load(G_ptr + (base + I * SUB) * stride_gt + cols, mask=cols < lim, other=0.0)
        # rows past the end carry zeros: keep their exponents at 0 so no 0 * inf appears in the kept rows
        ei = tl.exp(tl.where(mi[:, None], gi - ref[None, :], 0.0))
        kjd = tl.trans(kj * tl.exp(tl.where(mj[:, None], ref[None, :] - gj, 0.0)))
        if PAIR_PREC == "16":
            dt = k_ptr.dtype.element_ty
            kjd = kjd.to(dt)
            lk = tl.dot((ki * ei).to(dt), kjd)
            aq = tl.dot((qi * ei).to(dt), kjd)
        else:
            lk = tl.dot(ki * ei, kjd, input_precision=PAIR_PREC)
            aq = tl.dot(qi * ei, kjd, input_precision=PAIR_PREC)
    else:
        # the norms need whole rows: take them first, then the channels BKS at a time
        qn = _rows(q_ptr, ri, mi, stride_qt, cols, K, False)
        kn = _rows(k_ptr, ri, mi, stride_kt, cols, K, False)
        lk = tl.zeros([SUB, SUB], dtype=tl.float32)
        aq = tl.zeros([SUB, SUB], dtype=tl.float32)
        keep = ii[:, None] >= ii[None, :]
        for d0 in tl.static_range(0, BK, BKS):
            cs = d0 + tl.arange(0, BKS)
            qi = _rows(q_ptr, ri, mi, stride_qt, cs, K, False)
            ki = _rows(k_ptr, ri, mi, stride_kt, cs, K, False)
            kj = _rows(k_ptr, rj, mj, stride_kt, cs, K, False)
            gi = _rows(G_ptr, ri, mi, stride_gt, cs, K, False)
            gj = _rows(G_ptr, rj, mj, stride_gt, cs, K, False)
            e = tl.exp(tl.where(keep[:, :, None], gi[:, None, :] - gj[None, :, :], float("-inf")))
            kje = kj[None, :, :] * e
            lk += tl.sum(ki[:, None, :] * kje, axis=2)
            aq += tl.sum(qi[:, None, :] * kje, axis=2)
        if L2:  # on the diagonal block the key rows i and j are the same rows
            rk = tl.rsqrt(tl.sum(kn * kn, axis=1) + 1e-6)
            lk = lk * rk[:, None] * rk[None, :]
            aq = aq * tl.rsqrt(tl.sum(qn * qn, axis=1) + 1e-6)[:, None] * rk[None, :]
        lk = tl.where(ii[:, None] > ii[None, :], lk, 0.0)
        aq = aq * scale
    return lk, aq


@triton.jit
def _inv_block(Lb, SUB: tl.constexpr):
    """(I + Lb)^-1 of a strictly lower [SUB, SUB] block, in registers by forward substitution: row i of the inverse
    is e_i - sum_{m < i} Lb[i, m] row m."""
    jj = tl.arange(0, SUB)
    T = tl.where(jj[:, None] == jj[None, :], 1.0, 0.0)
    for i in tl.static_range(1, SUB):
        l_i = tl.sum(tl.where(jj[:, None] == i, Lb, 0.0), axis=0)
        t_i = tl.where(jj == i, 1.0, 0.0) - tl.sum(l_i[:, None] * T, axis=0)
        T = tl.where(jj[:, None] == i, t_i[None, :], T)
    return T


@triton.jit
def _blk(Lh, start, end, sL, I: tl.constexpr, J: tl.constexpr, SUB: tl.constexpr):
    """Block (I, J) of one chunk's [C, C] matrix at ``Lh`` (rows from ``start``, zero past ``end``)."""
    jj = tl.arange(0, SUB)
    r = start + I * SUB + jj
    return tl.load(Lh + r[:, None] * sL + (J * SUB + jj)[None, :], mask=(r < end)[:, None], other=0.0)


@triton.jit
def _put(Lh, T, start, end, sL, I: tl.constexpr, J: tl.constexpr, SUB: tl.constexpr):
    jj = tl.arange(0, SUB)
    r = start + I * SUB + jj
    tl.store(Lh + r[:, None] * sL + (J * SUB + jj)[None, :], T, mask=(r < end)[:, None])


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _solve_unit_lower(Lh, start, end, sL, C: tl.constexpr, SUB: tl.constexpr):
    """(I + L)^-1 in place of the strictly lower [C, C] L of one chunk (rows from ``start``, row stride ``sL``;
    C / SUB = 1, 2 or 4 blocks), in registers: every block of L is loaded, each diagonal block inverted by forward
    substitution (``_inv_block``: stable where a product formula is not, since L's powers grow binomially for
    near-equal keys), the blocks below from T_IJ = -T_II sum_{J <= M < I} L_IM T_MJ, and T stored over L. Rows past
    ``end`` are neither read nor written (they belong to the next chunk's tokens)."""
    NB: tl.constexpr = C // SUB
    tl.static_assert(NB == 1 or NB == 2 or NB == 4)
    L00 = _blk(Lh, start, end, sL, 0, 0, SUB)
    if NB > 1:
        L11 = _blk(Lh, start, end, sL, 1, 1, SUB)
        L10 = _blk(Lh, start, end, sL, 1, 0, SUB)
    if NB > 2:
        L22 = _blk(Lh, start, end, sL, 2, 2, SUB)
        L33 = _blk(Lh, start, end, sL, 3, 3, SUB)
        L20 = _blk(Lh, start, end, sL, 2, 0, SUB)
        L21 = _blk(Lh, start, end, sL, 2, 1, SUB)
        L30 = _blk(Lh, start, end, sL, 3, 0, SUB)
        L31 = _blk(Lh, start, end, sL, 3, 1, SUB)
        L32 = _blk(Lh, start, end, sL, 3, 2, SUB)
    tl.debug_barrier()  # every block is read before T overwrites any
    T00 = _inv_block(L00, SUB)
    _put(Lh, T00, start, end, sL, 0, 0, SUB)
    if NB > 1:
        T11 = _inv_block(L11, SUB)
        T10 = -_mm(T11, _mm(L10, T00))
        _put(Lh, T11, start, end, sL, 1, 1, SUB)
        _put(Lh, T10, start, end, sL, 1, 0, SUB)
    if NB > 2:
        T22 = _inv_block(L22, SUB)
        T33 = _inv_block(L33, SUB)
        T21 = -_mm(T22, _mm(L21, T11))
        T32 = -_mm(T33, _mm(L32, T22))
        T20 = -_mm(T22, _mm(L20, T00) + _mm(L21, T10))
        T31 = -_mm(T33, _mm(L31, T11) + _mm(L32, T21))
        T30 = -_mm(T33, _mm(L30, T00) + _mm(L31, T10) + _mm(L32, T20))
        _put(Lh, T22, start, end, sL, 2, 2, SUB)
        _put(Lh, T33, start, end, sL, 3, 3, SUB)
        _put(Lh, T20, start, end, sL, 2, 0, SUB)
        _put(Lh, T21, start, end, sL, 2, 1, SUB)
        _put(Lh, T30, start, end, sL, 3, 0, SUB)
        _put(Lh, T31, start, end, sL, 3, 1, SUB)
        _put(Lh, T32, start, end, sL, 3, 2, SUB)


@triton.jit
def _raw(ptr, rows, mask, stride_t, cols, ncols):
    """Rows ``rows`` x columns ``cols`` of a [tokens, D] head view in its own dtype, zero outside."""
    return tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=mask[:, None] & (cols[None, :] < ncols),
                   other=0.0)


@triton.jit
def _inv_norms(ph, rows, m, stride_t, K, BK: tl.constexpr, BD: tl.constexpr, L2: tl.constexpr, C: tl.constexpr):
    """[C] inverse L2 norms of a chunk's rows (ones without L2), BD columns at a time."""
    r = tl.full([C], 1.0, tl.float32)
    if L2:
        ss = tl.zeros([C], dtype=tl.float32)
        for d0 in tl.static_range(0, BK, BD):
            x = _rows(ph, rows, m, stride_t, d0 + tl.arange(0, BD), K, False)
            ss += tl.sum(x * x, axis=1)
        r = tl.rsqrt(ss + 1e-6)
    return r


@triton.jit
def _pairs(start, end, hv, q_ptr, k_ptr, g_ptr, beta_ptr, G_ptr, A_ptr, L_ptr, kd_ptr,
           stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh, stride_bt, stride_bh, HV, REP, K, scale,
           C: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, SUB: tl.constexpr, BKS: tl.constexpr,
           PER_CHANNEL: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, PAIR_PREC: tl.constexpr,
           D16: tl.constexpr):
    """The first half of the prepare step, one chunk of one value head: the cumulative decay G, the keys as the state
    update reads them (kd = k exp(G_last - G)), beta_i L_ij and Aqk (module docstring)."""
    hk = hv // REP
    rows = start + tl.arange(0, C)
    m = rows < end
    ii = tl.arange(0, C)
    last = end - 1 - start  # the chunk's last row
    qh = q_ptr + hk * stride_qh
    kh = k_ptr + hk * stride_kh
    beta = tl.load(beta_ptr + rows * stride_bt + hv * stride_bh, mask=m, other=0.0).to(tl.float32)
    # scratch rows: token-major [tokens, HV, D]
    Gh = G_ptr + hv * BK
    sG = HV * BK
    Lh = L_ptr + hv * C
    sL = HV * C
    Ah = A_ptr + hv * C
    sd = kd_ptr.dtype.element_ty
    rk = _inv_norms(kh, rows, m, stride_kt, K, BK, BD, L2, C)
    if PER_CHANNEL:  # the norms are applied block by block inside _decay_pairs
        for d0 in tl.static_range(0, BK, BD):
            cd = d0 + tl.arange(0, BD)
            Gb = tl.cumsum(_rows(g_ptr + hv * stride_gh, rows, m, stride_gt, cd, K, False), axis=0)
            tl.store(Gh + rows[:, None] * sG + cd[None, :], Gb, mask=m[:, None])
            Gl = tl.sum(tl.where(ii[:, None] == last, Gb, 0.0), axis=0)
            kb = _rows(kh, rows, m, stride_kt, cd, K, False) * rk[:, None]
            tl.store(kd_ptr + hv * BK + rows[:, None] * (HV * BK) + cd[None, :], (kb * tl.exp(Gl[None, :] - Gb)).to(sd),
                     mask=m[:, None])
        tl.debug_barrier()  # the sub-blocks below read G back
        for I in tl.static_range(C // SUB):
            ri = start + I * SUB + tl.arange(0, SUB)
            for J in tl.static_range(I + 1):
                cj = J * SUB + tl.arange(0, SUB)
                lk, aq = _decay_pairs(qh, kh, Gh, start, stride_qt, stride_kt, sG, I, J, K, scale, SUB, BK, BKS, L2,
                                      end, PAIR_PREC)
                tl.store(Lh + ri[:, None] * sL + cj[None, :], lk, mask=(ri < end)[:, None])
                tl.store(Ah + ri[:, None] * sL + cj[None, :], aq.to(A_ptr.dtype.element_ty), mask=(ri < end)[:, None])
        tl.debug_barrier()
        # only blocks on and below the diagonal were written: mask the rest away, then scale the rows by beta
        L = tl.load(Lh + rows[:, None] * sL + ii[None, :], mask=m[:, None] & (ii[:, None] > ii[None, :]),
                    other=0.0)
        tl.debug_barrier()
        tl.store(Lh + rows[:, None] * sL + ii[None, :], L * beta[:, None], mask=m[:, None])
    else:
        G = tl.cumsum(tl.load(g_ptr + rows * stride_gt + hv * stride_gh, mask=m, other=0.0).to(tl.float32), axis=0)
        tl.store(Gh + rows * sG, G, mask=m)
        Gl = tl.sum(tl.where(ii == last, G, 0.0), axis=0)
        kk = tl.zeros([C, C], dtype=tl.float32)
        qk = tl.zeros([C, C], dtype=tl.float32)
        for d0 in tl.static_range(0, BK, BD):
            cd = d0 + tl.arange(0, BD)
            if D16:  # products of the 16-bit rows themselves, fp32 sums
                qb = _raw(qh, rows, m, stride_qt, cd, K)
                kb = _raw(kh, rows, m, stride_kt, cd, K)
                kbt = tl.trans(kb)
                kk += tl.dot(kb, kbt)
                qk += tl.dot(qb, kbt)
                kb = kb.to(tl.float32)
            else:
                qb = _rows(qh, rows, m, stride_qt, cd, K, False)
                kb = _rows(kh, rows, m, stride_kt, cd, K, False)
                kbt = tl.trans(kb)
                kk += tl.dot(kb, kbt, input_precision=PREC)
                qk += tl.dot(qb, kbt, input_precision=PREC)
            tl.store(kd_ptr + hv * BK + rows[:, None] * (HV * BK) + cd[None, :],
                     (kb * (rk * tl.exp(Gl - G))[:, None]).to(sd), mask=m[:, None])
        pair = tl.exp(tl.where(ii[:, None] >= ii[None, :], G[:, None] - G[None, :], float("-inf")))
        L = tl.where(ii[:, None] > ii[None, :], kk * pair, 0.0) * (beta * rk)[:, None] * rk[None, :]
        tl.store(Lh + rows[:, None] * sL + ii[None, :], L, mask=m[:, None])
        rq = _inv_norms(qh, rows, m, stride_qt, K, BK, BD, L2, C)
        Aqk = qk * pair * (rq * scale)[:, None] * rk[None, :]
        tl.store(Ah + rows[:, None] * sL + ii[None, :], Aqk.to(A_ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def _solve_wu(start, end, hv, k_ptr, v_ptr, beta_ptr, G_ptr, w_ptr, u_ptr, L_ptr,
              stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_bh, HV, REP, K, V,
              C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, SUB: tl.constexpr,
              PER_CHANNEL: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, D16: tl.constexpr):
    """The second half, one chunk of one value head: (I + L)^-1 in place of L, w = (I + L)^-1 (beta k exp(G)) and
    u = (I + L)^-1 (beta v)."""
    hk = hv // REP
    rows = start + tl.arange(0, C)
    m = rows < end
    ii = tl.arange(0, C)
    kh = k_ptr + hk * stride_kh
    beta = tl.load(beta_ptr + rows * stride_bt + hv * stride_bh, mask=m, other=0.0).to(tl.float32)
    Gh = G_ptr + hv * BK
    sG = HV * BK
    Lh = L_ptr + hv * C
    sL = HV * C
    sd = u_ptr.dtype.element_ty
    _solve_unit_lower(Lh, start, end, sL, C, SUB)
    tl.debug_barrier()  # other threads stored the blocks of T this program reads whole
    Tm = tl.load(Lh + rows[:, None] * sL + ii[None, :], mask=m[:, None] & (ii[:, None] >= ii[None, :]), other=0.0)
    if D16:
        Tm = Tm.to(sd)
    rk = _inv_norms(kh, rows, m, stride_kt, K, BK, BD, L2, C)
    for d0 in tl.static_range(0, BV, BD):
        cv = d0 + tl.arange(0, BD)
        vb = tl.load(v_ptr + hv * stride_vh + rows[:, None] * stride_vt + cv[None, :],
                     mask=m[:, None] & (cv[None, :] < V), other=0.0).to(tl.float32) * beta[:, None]
        if D16:
            u = tl.dot(Tm, vb.to(sd))
        else:
            u = tl.dot(Tm, vb, input_precision=PREC)
        tl.store(u_ptr + hv * BV + rows[:, None] * (HV * BV) + cv[None, :], u.to(sd), mask=m[:, None])
    if not PER_CHANNEL:
        dh = tl.exp(tl.load(Gh + rows * sG, mask=m, other=0.0))
    for d0 in tl.static_range(0, BK, BD):
        cd = d0 + tl.arange(0, BD)
        if PER_CHANNEL:
            dk = tl.exp(tl.load(Gh + rows[:, None] * sG + cd[None, :], mask=m[:, None], other=0.0))
        else:
            dk = dh[:, None]
        kb = _rows(kh, rows, m, stride_kt, cd, K, False) * (rk * beta)[:, None] * dk
        if D16:
            w = tl.dot(Tm, kb.to(sd))
        else:
            w = tl.dot(Tm, kb, input_precision=PREC)
        tl.store(w_ptr + hv * BK + rows[:, None] * (HV * BK) + cd[None, :], w.to(sd), mask=m[:, None])


@triton.jit
def _chunk_prepare(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, chunks_ptr, G_ptr, w_ptr, u_ptr, A_ptr, L_ptr, kd_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
                   stride_bt, stride_bh, HV, REP, K, V, scale,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, SUB: tl.constexpr,
                   BKS: tl.constexpr, PER_CHANNEL: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
                   PAIR_PREC: tl.constexpr, D16: tl.constexpr, PAIRS: tl.constexpr, SOLVE: tl.constexpr):
    """One program per (chunk, value head): the pairwise products (PAIRS), then the solve and w, u (SOLVE); one launch
    with both, or two launches (``split``: each half alone holds fewer registers). Every [C, D] tile is taken BD
    columns at a time (loaded again where needed: the chunk's rows stay in L2), so that no more than a few [C, BD] /
    [C, C] fp32 tiles are live at once: whole [C, 128] tiles spill registers."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    start = tl.load(chunks_ptr + 2 * c)
    end = tl.load(chunks_ptr + 2 * c + 1)
    if start >= end:  # a slot of the chunk table's upper bound that holds no chunk
        return
    if PAIRS:
        _pairs(start, end, hv, q_ptr, k_ptr, g_ptr, beta_ptr, G_ptr, A_ptr, L_ptr, kd_ptr, stride_qt, stride_qh,
               stride_kt, stride_kh, stride_gt, stride_gh, stride_bt, stride_bh, HV, REP, K, scale, C, BK, BD, SUB,
               BKS, PER_CHANNEL, L2, PREC, PAIR_PREC, D16)
    if PAIRS and SOLVE:
        tl.debug_barrier()  # the solve reads L (and G) back
    if SOLVE:
        _solve_wu(start, end, hv, k_ptr, v_ptr, beta_ptr, G_ptr, w_ptr, u_ptr, L_ptr, stride_kt, stride_kh,
                  stride_vt, stride_vh, stride_bt, stride_bh, HV, REP, K, V, C, BK, BV, BD, SUB, PER_CHANNEL, L2,
                  PREC, D16)


@triton.jit
def _chunk_state(cu_ptr, first_ptr, G_ptr, w_ptr, u_ptr, kd_ptr, h0_ptr, ht_ptr, hc_ptr, vn_ptr, HV, K, V,
                 C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr,
                 PER_CHANNEL: tl.constexpr, HAS_H0: tl.constexpr, PREC: tl.constexpr, S16: tl.constexpr):
    """The sequential pass: per chunk, store the state the chunk starts from (for the output kernel), v' = u - w S
    (stored), S <- exp(G_last) S + kd^T v'."""
    n = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    slot = tl.load(first_ptr + n)
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    ii = tl.arange(0, C)
    hmask = (ck[:, None] < K) & (cv[None, :] < V)
    state_off = (n * HV + hv) * K * V + ck[:, None] * V + cv[None, :]
    if HAS_H0:
        h = tl.load(h0_ptr + state_off, mask=hmask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    for start in range(bos, eos, C):
        rows = start + ii
        m = rows < eos
        last = tl.minimum(start + C, eos) - 1
        tl.store(hc_ptr + (slot * HV + hv).to(tl.int64) * BK * BVF + ck[:, None] * BVF + cv[None, :],
                 h.to(hc_ptr.dtype.element_ty))
        w = tl.load(w_ptr + hv * BK + rows[:, None] * (HV * BK) + ck[None, :], mask=m[:, None], other=0.0)
        kd = tl.load(kd_ptr + hv * BK + rows[:, None] * (HV * BK) + ck[None, :], mask=m[:, None], other=0.0)
        u = tl.load(u_ptr + hv * BVF + rows[:, None] * (HV * BVF) + cv[None, :],
                    mask=m[:, None] & (cv[None, :] < V), other=0.0).to(tl.float32)
        if S16:  # 16-bit operands (the state rounded for the product), fp32 sums and state
            v_new = u - tl.dot(w, h.to(w.dtype))
        else:  # fp32 products on the 16-bit scratch (bench/TUNING.md, delta rule)
            w, kd = w.to(tl.float32), kd.to(tl.float32)
            v_new = u - tl.dot(w, h, input_precision=PREC)
        tl.store(vn_ptr + hv * BVF + rows[:, None] * (HV * BVF) + cv[None, :], v_new.to(vn_ptr.dtype.element_ty),
                 mask=m[:, None])
        if PER_CHANNEL:
            hdec = tl.exp(tl.load(G_ptr + hv * BK + last * (HV * BK) + ck))[:, None]
        else:
            hdec = tl.exp(tl.load(G_ptr + hv * BK + last * (HV * BK)))
        if S16:
            h = h * hdec + tl.dot(tl.trans(kd), v_new.to(kd.dtype))
        else:
            h = h * hdec + tl.dot(tl.trans(kd), v_new, input_precision=PREC)
        slot += 1
    tl.store(ht_ptr + state_off, h, mask=hmask)


@triton.jit
def _chunk_output(q_ptr, o_ptr, chunks_ptr, G_ptr, A_ptr, hc_ptr, vn_ptr, stride_qt, stride_qh, stride_ot,
                  stride_oh, HV, REP, K, V, scale,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr, BD: tl.constexpr,
                  PER_CHANNEL: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, D16: tl.constexpr):
    """Every chunk in parallel: o = (q exp(G)) S_chunk + Aqk v', the first product BD key columns at a time."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    start = tl.load(chunks_ptr + 2 * c)
    end = tl.load(chunks_ptr + 2 * c + 1)
    if start >= end:
        return
    hk = hv // REP
    rows = start + tl.arange(0, C)
    m = rows < end
    ii = tl.arange(0, C)
    cv = vb * BV + tl.arange(0, BV)
    qh = q_ptr + hk * stride_qh
    Aqk = tl.load(A_ptr + hv * C + rows[:, None] * (HV * C) + ii[None, :],
                  mask=m[:, None] & (ii[:, None] >= ii[None, :]), other=0.0)
    vn = tl.load(vn_ptr + hv * BVF + rows[:, None] * (HV * BVF) + cv[None, :], mask=m[:, None], other=0.0)
    if D16:  # the 16-bit scratch tiles as they are, fp32 sums
        o = tl.dot(Aqk, vn)
    else:
        o = tl.dot(Aqk.to(tl.float32), vn.to(tl.float32), input_precision=PREC)
    rq = tl.full([C], scale, tl.float32)
    if L2:
        sq = tl.zeros([C], dtype=tl.float32)
        for d0 in tl.static_range(0, BK, BD):
            qb = _rows(qh, rows, m, stride_qt, d0 + tl.arange(0, BD), K, False)
            sq += tl.sum(qb * qb, axis=1)
        rq = rq * tl.rsqrt(sq + 1e-6)
    if not PER_CHANNEL:
        rq = rq * tl.exp(tl.load(G_ptr + hv * BK + rows * (HV * BK), mask=m, other=0.0))
    hbase = hc_ptr + (c * HV + hv).to(tl.int64) * BK * BVF
    for d0 in tl.static_range(0, BK, BD):
        cd = d0 + tl.arange(0, BD)
        qd = _rows(qh, rows, m, stride_qt, cd, K, False) * rq[:, None]
        if PER_CHANNEL:
            qd = qd * tl.exp(tl.load(G_ptr + hv * BK + rows[:, None] * (HV * BK) + cd[None, :], mask=m[:, None],
                                     other=0.0))
        h = tl.load(hbase + cd[:, None] * BVF + cv[None, :])
        if D16:
            o += tl.dot(qd.to(h.dtype), h)
        else:
            o += tl.dot(qd, h.to(tl.float32), input_precision=PREC)
    tl.store(o_ptr + hv * stride_oh + rows[:, None] * stride_ot + cv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=m[:, None] & (cv[None, :] < V))


def chunk_table(cu_seqlens: torch.Tensor, total: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([slots, 2] int32 (start, end) of every chunk of the packed sequences, [N] int32 slot of each sequence's
    first chunk), built on the device: slots is the upper bound cdiv(total, chunk) + sequences; unused slots hold
    (0, 0)."""
    n = cu_seqlens.numel() - 1
    slots = triton.cdiv(total, chunk) + n
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    counts = (lens + chunk - 1) // chunk
    ends = counts.cumsum(0)
    j = torch.arange(slots, device=cu.device)
    seq = torch.searchsorted(ends, j, right=True).clamp(max=n - 1)
    first = ends[seq] - counts[seq]
    start = cu[seq] + (j - first) * chunk
    end = torch.minimum(start + chunk, cu[seq + 1])
    used = j < ends[-1]
    table = torch.stack([torch.where(used, start, 0), torch.where(used, end, 0)], 1).to(torch.int32).contiguous()
    return table, (ends - counts).to(torch.int32)


def _uniform_tables(B: int, T: int, C: int, device: torch.device):
    """cu_seqlens and the chunk table of B sequences of T tokens, kept for the last 64 shapes (a dozen small launches
    a prefill would otherwise pay every call); inside a CUDA-graph capture built afresh, so that the graph owns what
    it reads and no cached table is one a capture filled."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _build_uniform_tables(B, T, C, device)
    return _cached_uniform_tables(B, T, C, device)


def _build_uniform_tables(B: int, T: int, C: int, device: torch.device):
    cu = torch.arange(0, (B + 1) * T, T, device=device, dtype=torch.int32)
    return cu, chunk_table(cu, B * T, C)


_cached_uniform_tables = functools.lru_cache(maxsize=64)(_build_uniform_tables)


def _head_view(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] as a packed [B * T, H, D] view (copying only when the strides do not allow one)."""
    B, T = x.shape[:2]
    if B > 1 and x.stride(0) != T * x.stride(1):
        x = x.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(B * T, *x.shape[2:]) if B > 1 or x.dim() == 4 else x


#: (K, V, per_channel, dtype) -> the chunk length that fits this device's shared memory (first launch finds it)
_CHUNK_FITS: dict = {}


def delta_rule_chunk_triton(q, k, v, g, beta, scale: float, initial_state=None, cu_seqlens=None,
                            use_l2norm: bool = True):
    """-> (o [B, T, HV, V] in v's dtype, final states [N, HV, K, V] fp32); semantics of reference.delta_rule_*.
    Chunks of CONFIG's C tokens (C_per_channel with a decay per key channel), or half that where a kernel's tiles
    overflow shared memory (the math is the same at every chunk length)."""
    key = (k.shape[-1], v.shape[-1], g.dim() == 4, v.dtype, v.device)
    cfg = CONFIG["chunk"]
    C = cfg["C_per_channel"] if g.dim() == 4 else cfg["C"]
    sizes = [_CHUNK_FITS[key]] if key in _CHUNK_FITS else [c for c in (C, C // 2, 16) if c >= 16]
    for i, C in enumerate(sizes):
        try:
            out = _chunked(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_l2norm, C)
        except triton.runtime.errors.OutOfResources:
            if i + 1 == len(sizes):
                raise
            continue
        _CHUNK_FITS[key] = C
        return out


def _chunked(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_l2norm, C):
    B, T, HV, V = v.shape
    HK, K = k.shape[2], k.shape[3]
    per_channel = g.dim() == 4
    cfg = CONFIG["chunk"]
    BK, BVF = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    total = B * T
    if cu_seqlens is None:
        cu_seqlens, (chunks, first) = _uniform_tables(B, T, C, v.device)
    else:
        chunks, first = chunk_table(cu_seqlens, total, C)
    N = cu_seqlens.numel() - 1
    qf, kf, vf = _head_view(q), _head_view(k), _head_view(v)
    gf = _head_view(g) if per_channel else g.reshape(total, HV)
    bf = beta.reshape(total, HV)
    f32 = dict(dtype=torch.float32, device=v.device)
    # what the passes hand on to the next kernel is kept in the inputs' precision (fp32 for fp32 inputs): the decays
    # and the UT system stay fp32, every state is accumulated in fp32 registers
    scr = dict(dtype=v.dtype if cfg["scratch16"] and v.dtype != torch.float32 else torch.float32, device=v.device)
    Gs = torch.empty(total, HV, BK, **f32)  # the in-chunk cumulative decay; a scalar decay uses column 0
    w = torch.empty(total, HV, BK, **scr)
    kd = torch.empty(total, HV, BK, **scr)
    u = torch.empty(total, HV, BVF, **scr)
    A = torch.empty(total, HV, C, **scr)
    Ls = torch.empty(total, HV, C, **f32)
    # fp32 inputs keep fp32 products; 16-bit inputs carry less precision than tf32 keeps
    prec = "ieee" if v.dtype == torch.float32 else "tf32"
    slots = chunks.shape[0]
    d16 = cfg["dot16"] and scr["dtype"] != torch.float32
    pair_prec = "ieee" if v.dtype == torch.float32 else cfg["pair_prec"]
    halves = [(True, False), (False, True)] if cfg["split"] else [(True, True)]
    for pairs, solve in halves:
        _chunk_prepare[(slots, HV)](
            qf, kf, vf, gf, bf, chunks, Gs, w, u, A, Ls, kd,
            qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
            gf.stride(0), gf.stride(1), bf.stride(0), bf.stride(1), HV, HV // HK, K, V, scale,
            C=C, BK=BK, BV=BVF, BD=min(BK, BVF, cfg["BD"]), SUB=cfg["SUB"], BKS=cfg["BKS"], PER_CHANNEL=per_channel,
            L2=use_l2norm, PREC=prec, PAIR_PREC=pair_prec, D16=d16, PAIRS=pairs, SOLVE=solve,
            num_warps=cfg["prepare_warps"], num_stages=cfg["stages"])
    final = torch.empty(N, HV, K, V, **f32)
    h0 = initial_state.float().contiguous() if initial_state is not None else final
    hc = torch.empty(slots, HV, BK, BVF, **scr)  # the state each chunk starts from
    vn = torch.empty(total, HV, BVF, **scr)
    BV = min(BVF, cfg["BV"])
    _chunk_state[(N, HV, triton.cdiv(V, BV))](
        cu_seqlens, first, Gs, w, u, kd, h0, final, hc, vn, HV, K, V, C=C, BK=BK, BV=BV, BVF=BVF,
        PER_CHANNEL=per_channel, HAS_H0=initial_state is not None, PREC=prec,
        S16=cfg["state16"] and scr["dtype"] != torch.float32, num_warps=cfg["state_warps"],
        num_stages=cfg["state_stages"] if scr["dtype"] != torch.float32 else 1)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    of = o.view(total, HV, V)
    _chunk_output[(slots, HV, triton.cdiv(V, cfg["BV_OUT"]) if BVF > cfg["BV_OUT"] else 1)](
        qf, of, chunks, Gs, A, hc, vn, qf.stride(0), qf.stride(1), of.stride(0), of.stride(1), HV, HV // HK, K, V,
        scale, C=C, BK=BK, BV=min(BVF, cfg["BV_OUT"]), BVF=BVF, BD=min(BK, cfg["BD"]), PER_CHANNEL=per_channel,
        L2=use_l2norm, PREC=prec, D16=d16,
        num_warps=cfg["output_warps"], num_stages=cfg["stages"])
    return o, final
