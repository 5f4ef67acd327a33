"""Triton kernels for absorbed MLA attention over the latent, and their launchers.

One attention kernel (``_mla_attn_kernel``) serves the three entry points; constexpr MODE picks how a
program finds its queries and keys:

  MODE_DECODE   one query per sequence, paged cache, split-KV (stage 1 + ``_mla_merge_kernel``);
  MODE_PREFILL  ragged query tiles (binary search over query_start_loc), paged cache, causal;
  MODE_DENSE    [B, H, T, L] queries over a strided [B, S, L] latent (HF layout), optional mask /
                bottom-right causal, split-KV when there are few query tiles.

A program owns a tile of M = BQ * BH rows: BQ query tokens x BH heads of one sequence. Each latent
tile [BN, L] read from memory feeds both dots (scores, q_lat . latent^T, and the output, p @ latent)
for all M rows: at 16 heads this is what keeps decode memory-bound-efficient, at 128 heads it puts
the work on the tensor cores. Softmax is online in the log2 domain with fp32 accumulators. Rows with
no key to attend produce zeros (and lse = -inf, which the merge ignores).

Memory per decode step (bf16): sum_b seq_b * (L + R) * 2 bytes of cache, plus q and out.
Launch configs are pure functions of shapes (``CONFIGS`` + ``choose_num_splits``); nothing syncs.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from hybrid_kernels.library import pdl_opts, pdl_start, size_hint

MODE_DECODE, MODE_PREFILL, MODE_DENSE = 0, 1, 2
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2
LOG2E = 1.4426950408889634

# Tunable launch parameters, one place (where each value comes from: bench/TUNING.md, "MLA"). block_m = rows (query
# tokens x heads) per tile, block_h = the most heads per tile, block_n = keys per inner iteration. bench/mla.py --tune
# sweeps alternatives on the GPU and prints the winners to paste here.
CONFIGS = {
    # H <= 32, memory-bound: one tile holds every head so each latent byte is read from HBM once; 3 stages, so a key
    # tile loads while the other is used. per_sm: programs resident per SM (sets the split count, choose_num_splits)
    "decode_small_h": dict(block_h=16, block_n=32, num_warps=4, num_stages=3, per_sm=2),
    # H > 32, tensor-core-bound: 64 heads per tile so the dots are wgmma (M=64); q sits in smem, the
    # [64, L] fp32 accumulator takes 128 regs/thread over 8 warps
    "decode_large_h": dict(block_h=64, block_n=64, num_warps=8, num_stages=2, per_sm=1),
    # prefill / dense (T > 1): BQ query tokens x BH heads = block_m rows per tile (wgmma M=64)
    "prefill": dict(block_m=64, block_h=16, block_n=32, num_warps=8, num_stages=2),
    "dense": dict(block_m=64, block_h=16, block_n=32, num_warps=8, num_stages=2),
    # block_s partials per load; merge_tiles sets the rows and columns per program (max_elems fp32 per load: 64 per
    # thread over 4 warps)
    "merge": dict(num_warps=4, block_s=16, max_programs=1024, few_rows=128, block_l=256, max_elems=8192),
    # the merge with W_UV (decode at up to uv_max_batch sequences): block_v output columns per program, so
    # B=1 at 16 heads runs 128 programs, each reading a [16, 512] tile of W_UV; above uv_max_batch each W_UV
    # tile would be reread per sequence: the batched matmul after the merge
    "merge_uv": dict(num_warps=4, block_v=16, uv_max_batch=4),
    # paged keys: block ids are read a window of this many keys at a time (one load per window, not per tile)
    "window_keys": 1024,
    # split-KV (choose_num_splits): keep >= min_tokens keys per split so the fp32 partials (H*L*4 bytes per
    # split, mostly L2-resident) stay small next to the keys they summarise; overhead, merge_launch and
    # merge_per_split are in units of keys read by one program (setup + partial write; the merge kernel's
    # launch; its serial read of one more partial), fitted to bench/mla.py --split-sweep. At small batches the step
    # is one short wave, where many short splits win.
    "split": dict(num_sms=132, min_tokens=64, max_splits=64, overhead=64, merge_launch=128, merge_per_split=6),
}


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


def decode_config(num_heads: int) -> dict:
    return dict(CONFIGS["decode_small_h" if num_heads <= 32 else "decode_large_h"])


def choose_num_splits(num_programs, max_len, block_n: int, per_sm: int = 2) -> int:
    """Split-KV factor from shapes only (max_len is the capacity, not the live length: no host sync).

    Picks s minimising a wave model of the step: programs run ``num_sms * per_sm`` at a time, a wave costs
    the longest program (max_len / s keys plus a fixed ~``overhead`` keys of setup and partial writes), and
    s > 1 adds the merge (a launch plus reading the partials). This keeps the last wave full: at 16 heads,
    B=128 takes 2 splits (256 programs, one wave of 264 slots), not 3 (384 programs, a half-empty second
    wave). Symbolic sizes are read at their traced value (no guard): every split count is correct."""
    c = CONFIGS["split"]
    progs, length = size_hint(num_programs), size_hint(max_len)
    if length <= 0 or progs <= 0:
        return 1
    slots = c["num_sms"] * per_sm
    chunks = triton.cdiv(length, block_n)
    most = max(1, min(c["max_splits"], length // max(c["min_tokens"], block_n)))

    def cost(s: int) -> float:
        waves = triton.cdiv(progs * s, slots)
        keys = triton.cdiv(chunks, s) * block_n
        merge = 0 if s == 1 else (c["merge_launch"] + triton.cdiv(progs * s, slots) * c["overhead"]
                                  + s * c["merge_per_split"])
        return waves * (keys + c["overhead"]) + merge

    return min(range(1, most + 1), key=lambda s: (cost(s), s))


def _tile_rows(num_heads: int, multi_query: bool, block_m: int, block_h: int) -> tuple[int, int]:
    """(BQ, BH): heads per tile BH (power of two, <= block_h) and query tokens per tile BQ so that
    BQ * BH ~ block_m rows and >= 16 (the smallest tl.dot M)."""
    bh = min(block_h, triton.next_power_of_2(num_heads))
    bq = max(1, block_m // bh) if multi_query else 1
    if bq * bh < 16:
        bh = 16 // bq
    return bq, bh


# ----------------------------------------------------------------------------------------------
# the attention kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attend_tile(q_lat, q_rope, KL, KR, row_l, row_r, s_kld, s_krd, offs_l, offs_r, l_ok, r_ok, offs_n, n_ok, rows,
                 lim, MASK, b64, t64, s_mb, s_mt, s_ms, sm_scale_log2, m_i, l_i, acc,
                 CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, IEEE: tl.constexpr):
    """One key tile [BN] (row offsets row_l / row_r into the latent / rope arrays): scores, masks, online
    softmax update of (m_i, l_i, acc). The latent tile feeds both dots."""
    kv_dtype = KL.dtype.element_ty
    lat = tl.load(KL + row_l[:, None] + offs_l[None, :] * s_kld,
                  mask=n_ok[:, None] & l_ok[None, :], other=0.0)              # [BN, BLOCK_L]
    rope = tl.load(KR + row_r[:, None] + offs_r[None, :] * s_krd,
                   mask=n_ok[:, None] & r_ok[None, :], other=0.0)             # [BN, BLOCK_R]
    if IEEE:
        qk = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
        qk = tl.dot(q_rope, tl.trans(rope), acc=qk, input_precision="ieee")
    else:
        qk = tl.dot(q_lat, tl.trans(lat))
        qk = tl.dot(q_rope, tl.trans(rope), acc=qk)
    qk = qk * tl.cast(sm_scale_log2, tl.float32)  # [M, BN], log2 units (fp32 even if the scalar arrives as fp64)
    keep = n_ok[None, :] & (rows >= 0)[:, None]        # padded rows (q = 0) stay finite; stores mask them
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= lim[:, None])
    if MASK_KIND == 1:
        mv = tl.load(MASK + b64 * s_mb + t64[:, None] * s_mt + offs_n[None, :] * s_ms,
                     mask=keep, other=0)
        keep = keep & (mv != 0)
    if MASK_KIND == 2:
        mv = tl.load(MASK + b64 * s_mb + t64[:, None] * s_mt + offs_n[None, :] * s_ms,
                     mask=keep, other=0.0).to(tl.float32)
        # finite biases are clamped to -1e37 so that * log2(e) cannot overflow to -inf: a row
        # biased by finfo.min everywhere stays finite (uniform, as in SDPA); -inf stays -inf.
        bias = tl.where(mv == float("-inf"), float("-inf"), tl.maximum(mv, -1.0e37) * 1.4426950408889634)
        qk = qk + bias
    qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = tl.dot(p.to(kv_dtype), lat, acc=acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(kv_dtype), lat, acc=acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["T", "S", "NSEQ", "NUM_SPLITS", "T_SCR", "s_bt"])
def _mla_attn_kernel(
    QL, QR, KL, KR, BT, SEQ, QSL, MASK, O, PO, PLSE,
    s_qlb, s_qlt, s_qlh, s_qld, s_qrb, s_qrt, s_qrh, s_qrd,      # query strides (batch, token, head, dim)
    s_klb, s_kls, s_kld, s_krb, s_krs, s_krd,                    # key strides: (block|batch, slot|pos, dim)
    s_bt, s_mb, s_mt, s_ms,                                      # block table row; mask (batch, q, k)
    s_ob, s_ot, s_oh,                                            # output strides (last dim contiguous)
    H, T, S, L, R, NSEQ, NUM_SPLITS, T_SCR, sm_scale_log2,
    MODE: tl.constexpr, PAGE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr, SEARCH_STEPS: tl.constexpr, IEEE: tl.constexpr,
    BQ: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    WIN: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid_tile = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_split = tl.program_id(2)
    M: tl.constexpr = BQ * BH
    rows = tl.arange(0, M)
    qi = rows // BH
    hh = pid_h * BH + rows % BH
    head_ok = hh < H

    # ---- which sequence, which queries, how far each row may look (lim, inclusive) ----
    if MODE == 0:       # decode: tile = sequence, one query token at the end of it
        b = pid_tile
        t = qi                                  # BQ == 1 -> 0
        row_ok = head_ok
        seq_len = tl.load(SEQ + b)
        lim = tl.zeros([M], dtype=tl.int32) + seq_len - 1
        kv_hi = seq_len
    elif MODE == 1:     # ragged prefill: tiles of sequence b start at qsl[b] // BQ + b
        lo = pid_tile * 0
        hi = lo + NSEQ
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            take = (tl.load(QSL + mid) // BQ + mid) <= pid_tile
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid)
        b = lo
        q_start = tl.load(QSL + b)
        q_end = tl.load(QSL + b + 1)
        t0 = q_start + (pid_tile - (q_start // BQ + b)) * BQ
        t = t0 + qi                             # global token index
        row_ok = head_ok & (t < q_end)
        seq_len = tl.load(SEQ + b)
        first_pos = seq_len - (q_end - q_start)
        lim = first_pos + (t - q_start)
        kv_hi = tl.minimum(seq_len, first_pos + (tl.minimum(t0 + BQ, q_end) - q_start))
        kv_hi = tl.where(t0 < q_end, kv_hi, 0)
    else:               # dense: tile = (batch, block of BQ query tokens)
        n_qt = tl.cdiv(T, BQ)
        b = pid_tile // n_qt
        t0 = (pid_tile % n_qt) * BQ
        t = t0 + qi
        row_ok = head_ok & (t < T)
        if CAUSAL:
            lim = t + (S - T)
            kv_hi = tl.maximum(tl.minimum(S, t0 + BQ + (S - T)), 0)
        else:
            lim = tl.zeros([M], dtype=tl.int32) + S - 1
            kv_hi = S
    b64 = b.to(tl.int64)

    # ---- this split's key range: chunks of BN keys dealt out evenly ----
    n_chunks = tl.cdiv(kv_hi, BN)
    per_split = tl.cdiv(n_chunks, NUM_SPLITS)
    k_lo = pid_split * per_split * BN
    k_hi = tl.minimum((pid_split + 1) * per_split * BN, kv_hi)

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < L
    r_ok = offs_r < R
    kv_dtype = KL.dtype.element_ty
    t64 = t.to(tl.int64)
    h64 = hh.to(tl.int64)
    q_lat = tl.load(QL + b64 * s_qlb + t64[:, None] * s_qlt + h64[:, None] * s_qlh + offs_l[None, :] * s_qld,
                    mask=row_ok[:, None] & l_ok[None, :], other=0.0).to(kv_dtype)
    q_rope = tl.load(QR + b64 * s_qrb + t64[:, None] * s_qrt + h64[:, None] * s_qrh + offs_r[None, :] * s_qrd,
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0).to(kv_dtype)

    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, BLOCK_L], dtype=tl.float32)
    if PAGE > 0:
        # Windows of WIN pages: the window's block ids are loaded once, and each key tile picks its rows from
        # them in registers (tl.gather). Key addresses then depend on no load inside the inner loop, so the
        # pipeliner double-buffers the key tiles (num_stages >= 3); a block-table load per tile left them
        # single-buffered, every tile waiting out its own load.
        w0 = k_lo
        while w0 < k_hi:
            page0 = w0 // PAGE
            pages = page0 + tl.arange(0, WIN)
            w1 = tl.minimum((page0 + WIN) * PAGE, k_hi)
            bt_win = tl.load(BT + b64 * s_bt + pages, mask=pages * PAGE < w1, other=0).to(tl.int64)
            for start in tl.range(w0, w1, BN):
                offs_n = start + tl.arange(0, BN)
                n_ok = offs_n < w1
                blk = tl.gather(bt_win, tl.minimum(offs_n // PAGE - page0, WIN - 1), 0)
                slot = (offs_n % PAGE).to(tl.int64)
                m_i, l_i, acc = _attend_tile(
                    q_lat, q_rope, KL, KR, blk * s_klb + slot * s_kls, blk * s_krb + slot * s_krs, s_kld, s_krd,
                    offs_l, offs_r, l_ok, r_ok, offs_n, n_ok, rows, lim, MASK, b64, t64, s_mb, s_mt, s_ms,
                    sm_scale_log2, m_i, l_i, acc, CAUSAL, MASK_KIND, IEEE)
            w0 = w1
    else:
        for start in range(k_lo, k_hi, BN):
            offs_n = start + tl.arange(0, BN)
            n64 = offs_n.to(tl.int64)
            m_i, l_i, acc = _attend_tile(
                q_lat, q_rope, KL, KR, b64 * s_klb + n64 * s_kls, b64 * s_krb + n64 * s_krs, s_kld, s_krd,
                offs_l, offs_r, l_ok, r_ok, offs_n, offs_n < k_hi, rows, lim, MASK, b64, t64, s_mb, s_mt, s_ms,
                sm_scale_log2, m_i, l_i, acc, CAUSAL, MASK_KIND, IEEE)

    l_use = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_use[:, None]
    if SPLIT:
        n_scr = (b * T_SCR + t).to(tl.int64)
        prow = (n_scr * H + h64) * NUM_SPLITS + pid_split                        # [M]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_use))
        tl.store(PLSE + prow, lse, mask=row_ok)
        tl.store(PO + prow[:, None] * L + offs_l[None, :], out,
                 mask=row_ok[:, None] & l_ok[None, :] & (l_i > 0.0)[:, None])
    else:
        tl.store(O + b64 * s_ob + t64[:, None] * s_ot + h64[:, None] * s_oh + offs_l[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & l_ok[None, :])


@triton.jit
def _merge_splits(PO, PLSE, r0, NROWS, L, NUM_SPLITS, c0, HB: tl.constexpr, BLOCK_L: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """Rows r0 .. r0 + HB (rows < NROWS), columns c0 .. c0 + BLOCK_L of the merged output, fp32 [HB, BLOCK_L]:
    sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max), an online merge over BLOCK_S splits at a time. A block's lse
    and partials are loaded together (one round trip); a split with lse = -inf (no keys) has its partial row
    unwritten, so what is loaded there is discarded, never multiplied."""
    rows = r0 + tl.arange(0, HB)
    offs = c0 + tl.arange(0, BLOCK_L)
    offs_s = tl.arange(0, BLOCK_S)
    base = rows.to(tl.int64)[:, None] * NUM_SPLITS + offs_s[None, :]              # [HB, BLOCK_S]
    m = tl.full([HB], float("-inf"), tl.float32)
    acc = tl.zeros([HB, BLOCK_L], dtype=tl.float32)
    den = tl.zeros([HB], dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        ok = (rows < NROWS)[:, None] & (s0 + offs_s < NUM_SPLITS)[None, :]
        lse = tl.load(PLSE + base + s0, mask=ok, other=float("-inf"))
        po = tl.load(PO + (base + s0)[:, :, None] * L + offs[None, None, :],
                     mask=ok[:, :, None] & (offs < L)[None, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp2(m - m_use)                   # 0 while m is -inf (acc and den are still 0 then)
        w = tl.exp2(lse - m_use[:, None])
        live = (lse > float("-inf"))[:, :, None]
        acc = acc * rescale[:, None] + tl.sum(tl.where(live, w[:, :, None] * po, 0.0), 1)
        den = den * rescale + tl.sum(w, 1)
        m = m_new
    return acc / tl.where(den == 0.0, 1.0, den)[:, None]


@triton.jit(do_not_specialize=["NUM_SPLITS", "NROWS", "T_OUT"])
def _mla_merge_kernel(PO, PLSE, O, H, L, NUM_SPLITS, NROWS, T_OUT, s_ob, s_ot, s_oh, HB: tl.constexpr,
                      BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """Program (HB rows of token x head, BLOCK_L columns): those rows' merged o_lat columns."""
    pdl_start(PDL)
    r0 = tl.program_id(0) * HB
    rows = r0 + tl.arange(0, HB)
    c0 = tl.program_id(1) * BLOCK_L
    offs = c0 + tl.arange(0, BLOCK_L)
    o = _merge_splits(PO, PLSE, r0, NROWS, L, NUM_SPLITS, c0, HB, BLOCK_L, BLOCK_S)
    n = rows // H
    h = (rows % H).to(tl.int64)
    b = (n // T_OUT).to(tl.int64)
    t = (n % T_OUT).to(tl.int64)
    tl.store(O + (b * s_ob + t * s_ot + h * s_oh)[:, None] + offs[None, :], o.to(O.dtype.element_ty),
             mask=(rows < NROWS)[:, None] & (offs < L)[None, :])


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _mla_merge_uv_kernel(PO, PLSE, W, O, H, L, V, NUM_SPLITS, s_wh, s_wv, s_ob, s_oh, BLOCK_L: tl.constexpr,
                         BLOCK_S: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
    """Decode at a few sequences: the merge, then W_UV, in one launch. Program (token x head, BV columns of V):
    out[n, h, v] = sum_l round(o_lat[n, h, l]) * W_UV[h, v, l], o_lat rounded to the output dtype as the unfused
    path stores it; fp32 products and sum. The W_UV tile (a weight: the kernel before does not write it) is loaded
    before the wait for the partials, so with PDL its read overlaps the attention kernel's tail."""
    pid = tl.program_id(0)
    n = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    offs = tl.arange(0, BLOCK_L)
    w = tl.load(W + h * s_wh + offs_v[:, None] * s_wv + offs[None, :],
                mask=(offs_v < V)[:, None] & (offs < L)[None, :], other=0.0)
    pdl_start(PDL)
    o = tl.reshape(_merge_splits(PO, PLSE, pid, pid + 1, L, NUM_SPLITS, 0, 1, BLOCK_L, BLOCK_S), [BLOCK_L])
    o = o.to(O.dtype.element_ty).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * o[None, :], 1)
    tl.store(O + n * s_ob + h * s_oh + offs_v, y.to(O.dtype.element_ty), mask=offs_v < V)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
def _launch(q_lat, q_rope, kl, kr, kl_strides, kr_strides, out, *, mode, page, bt, seq, qsl, mask,
            mask_strides, causal, q_strides_l, q_strides_r, H, T, S, nseq, grid_tiles, t_scr, t_out,
            n_scr_tokens, scale, bq, bh, num_splits, cfg, w_uv=None):
    """w_uv (decode only): W_UV [H, V, L] (last dim contiguous) applied in the merge; ``out`` is then [B, H, V]."""
    L, R = q_lat.shape[-1], q_rope.shape[-1]
    head_blocks = triton.cdiv(H, bh)
    if kl.dtype == torch.float32 and kl.is_cuda:           # fp32 dots are CUDA-core FMAs: smaller key tiles
        cfg = {**cfg, "block_n": min(cfg["block_n"], 16)}  # (block_n 64 spills ~3 KB on sm_90)
    split = num_splits > 1 or w_uv is not None
    if split:
        po = torch.empty((n_scr_tokens * H * num_splits * L,), device=q_lat.device, dtype=torch.float32)
        plse = torch.empty((n_scr_tokens * H * num_splits,), device=q_lat.device, dtype=torch.float32)
    else:
        po = plse = out                                    # unused
    mask_kind = MASK_NONE if mask is None else (MASK_BOOL if mask.dtype == torch.bool else MASK_FLOAT)
    # bool -> uint8 as a real (tiny) conversion: Inductor cannot lower a bool->uint8 view
    mask_arg = out if mask is None else (mask.to(torch.uint8) if mask_kind == MASK_BOOL else mask)
    wrap_triton(_mla_attn_kernel)[(grid_tiles, head_blocks, num_splits)](
        q_lat, q_rope, kl, kr, out if bt is None else bt, out if seq is None else seq,
        out if qsl is None else qsl, mask_arg, out, po, plse,
        *q_strides_l, *q_strides_r, *kl_strides, *kr_strides,
        bt.stride(0) if bt is not None else 0, *mask_strides,
        *_out_strides(out, mode),
        H, T, S, L, R, nseq, num_splits, t_scr, scale * LOG2E,
        MODE=mode, PAGE=page, MASK_KIND=mask_kind, CAUSAL=causal, SPLIT=split,
        SEARCH_STEPS=max(1, math.ceil(math.log2(max(nseq, 1))) + 1) if mode == MODE_PREFILL else 1,
        IEEE=kl.dtype == torch.float32, BQ=bq, BH=bh, BN=cfg["block_n"],
        BLOCK_L=_pow2(L), BLOCK_R=_pow2(R), WIN=_window_pages(page, cfg["block_n"]), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_opts(q_lat),
    )
    if split:
        merge(po, plse, out, H=H, L=L, num_splits=num_splits, n_scr_tokens=n_scr_tokens, t_out=t_out, mode=mode,
              w_uv=w_uv)
    return out


def merge(po, plse, out, *, H, L, num_splits, n_scr_tokens, t_out, mode=MODE_DECODE, w_uv=None):
    """The split-KV partials (po [rows * L], plse [rows] fp32; rows = (token * H + head) * num_splits + split)
    -> out: o_lat, or with w_uv [H, V, L] the absorbed output o_lat @ W_UV^T (one launch either way)."""
    block_s = min(triton.next_power_of_2(num_splits), CONFIGS["merge"]["block_s"])
    if w_uv is not None:
        V, bv = w_uv.shape[1], CONFIGS["merge_uv"]["block_v"]
        wrap_triton(_mla_merge_uv_kernel)[(n_scr_tokens * H, triton.cdiv(V, bv))](
            po, plse, w_uv, out, H, L, V, num_splits, w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1),
            BLOCK_L=_pow2(L), BLOCK_S=block_s, BV=bv, num_warps=CONFIGS["merge_uv"]["num_warps"], **pdl_opts(out))
    else:
        rows = n_scr_tokens * H
        hb, block_l = merge_tiles(rows, block_s, L)
        wrap_triton(_mla_merge_kernel)[(triton.cdiv(rows, hb), triton.cdiv(L, block_l))](
            po, plse, out, H, L, num_splits, rows, t_out, *_out_strides(out, mode),
            HB=hb, BLOCK_L=block_l, BLOCK_S=block_s, num_warps=CONFIGS["merge"]["num_warps"], **pdl_opts(out),
        )


def merge_tiles(rows, block_s: int, L: int) -> tuple[int, int]:
    """(rows, columns) of the merged output per merge program. Many small programs are what costs (bench/mla_merge.py
    sweeps the tiles; bench/TUNING.md), so rows are grouped until at most ``max_programs``; under ``few_rows`` rows,
    half rows (twice the programs)."""
    c = CONFIGS["merge"]
    rows = size_hint(rows)
    block_l = min(_pow2(L), c["block_l"] if rows < c["few_rows"] else 1 << 30)
    hb = 1
    while triton.cdiv(rows, hb) > c["max_programs"] and 2 * hb * block_s * block_l <= c["max_elems"]:
        hb *= 2
    return hb, block_l


def _window_pages(page: int, block_n: int) -> int:
    """Pages per block-table window (a power of two; 1 for unpaged keys): about CONFIGS["window_keys"] keys,
    at least one key tile."""
    if page <= 0:
        return 1
    return triton.next_power_of_2(max(triton.cdiv(CONFIGS["window_keys"], page), triton.cdiv(block_n, page)))


def _out_strides(out: torch.Tensor, mode: int):
    if mode == MODE_DENSE:                  # [B, H, T, L]
        return out.stride(0), out.stride(2), out.stride(1)
    if mode == MODE_PREFILL:                # [Tq, H, L], rows addressed by global token index
        return 0, out.stride(0), out.stride(1)
    return out.stride(0), 0, out.stride(1)  # decode [B, H, L]


def _check_cache(cache, block_table, L, R):
    assert cache.dim() == 3 and cache.shape[-1] == L + R, \
        f"cache must be [num_blocks, block_size, L+R={L + R}], got {tuple(cache.shape)}"
    assert cache.stride(-1) == 1, "cache rows must be contiguous in the last dim"
    assert block_table.dim() == 2, "block_table must be [B, max_blocks]"


def mla_decode_triton(q_lat, q_rope, cache, block_table, seq_lens, scale: float, num_splits: int = 0,
                      config: dict | None = None, w_uv: torch.Tensor | None = None) -> torch.Tensor:
    """q_lat [B, H, L], q_rope [B, H, R], cache [NB, BS, L+R], block_table [B, MB] int32,
    seq_lens [B] int32 -> o_lat [B, H, L] (q dtype). num_splits 0 = automatic (shapes only).
    w_uv: W_UV [H, V, L] -> the absorbed output o_lat @ W_UV^T [B, H, V] instead (o_lat rounded to q's dtype
    first, as ``reference.unabsorb_out`` of this op's o_lat), from the merge kernel."""
    B, H, L = q_lat.shape
    R = q_rope.shape[-1]
    _check_cache(cache, block_table, L, R)
    cfg = {**decode_config(H), **(config or {})}
    bq, bh = _tile_rows(H, False, 16, cfg["block_h"])
    page = cache.shape[1]
    assert w_uv is None or (w_uv.shape[0] == H and w_uv.shape[2] == L and w_uv.stride(2) == 1
                            and w_uv.dtype == q_lat.dtype), "w_uv must be [H, V, L] in q's dtype, rows contiguous"
    if num_splits <= 0:
        num_splits = choose_num_splits(B * triton.cdiv(H, bh), block_table.shape[1] * page, cfg["block_n"],
                                       cfg.get("per_sm", 1))
    out = torch.empty((B, H, L if w_uv is None else w_uv.shape[1]), device=q_lat.device, dtype=q_lat.dtype)
    if B == 0:
        return out
    return _launch(
        q_lat, q_rope, cache, cache[:, :, L:], (cache.stride(0), cache.stride(1), 1),
        (cache.stride(0), cache.stride(1), 1), out, mode=MODE_DECODE, page=page, bt=block_table,
        seq=seq_lens, qsl=None, mask=None, mask_strides=(0, 0, 0), causal=False,
        q_strides_l=(q_lat.stride(0), 0, q_lat.stride(1), q_lat.stride(2)),
        q_strides_r=(q_rope.stride(0), 0, q_rope.stride(1), q_rope.stride(2)),
        H=H, T=1, S=0, nseq=B, grid_tiles=B, t_scr=1, t_out=1, n_scr_tokens=B, scale=scale,
        bq=bq, bh=bh, num_splits=num_splits, cfg=cfg, w_uv=w_uv)


def mla_prefill_triton(q_lat, q_rope, cache, block_table, seq_lens, query_start_loc, scale: float,
                       config: dict | None = None) -> torch.Tensor:
    """q_lat [Tq, H, L], q_rope [Tq, H, R]; ragged batch given by query_start_loc [B+1] int32;
    seq_lens [B] int32 include the new tokens (already in the cache) -> o_lat [Tq, H, L]."""
    Tq, H, L = q_lat.shape
    R = q_rope.shape[-1]
    _check_cache(cache, block_table, L, R)
    B = seq_lens.shape[0]
    cfg = {**CONFIGS["prefill"], **(config or {})}
    bq, bh = _tile_rows(H, True, cfg["block_m"], cfg["block_h"])
    out = torch.empty((Tq, H, L), device=q_lat.device, dtype=q_lat.dtype)
    if Tq == 0 or B == 0:
        return out
    return _launch(
        q_lat, q_rope, cache, cache[:, :, L:], (cache.stride(0), cache.stride(1), 1),
        (cache.stride(0), cache.stride(1), 1), out, mode=MODE_PREFILL, page=cache.shape[1],
        bt=block_table, seq=seq_lens, qsl=query_start_loc, mask=None, mask_strides=(0, 0, 0), causal=True,
        q_strides_l=(0, q_lat.stride(0), q_lat.stride(1), q_lat.stride(2)),
        q_strides_r=(0, q_rope.stride(0), q_rope.stride(1), q_rope.stride(2)),
        H=H, T=1, S=0, nseq=B, grid_tiles=triton.cdiv(Tq, bq) + B, t_scr=0, t_out=1, n_scr_tokens=Tq,
        scale=scale, bq=bq, bh=bh, num_splits=1, cfg=cfg)


def dense_mask_4d(attn_mask: torch.Tensor | None, B: int, T: int, S: int) -> torch.Tensor | None:
    """Broadcast a mask to [B, 1, T, S] without copying (stride 0 where it was 1). Per-head masks are
    not supported (HF's masks are shared by all heads)."""
    if attn_mask is None:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.shape[1] != 1:
        raise ValueError(f"mla_attention_dense: per-head masks are not supported, got {tuple(attn_mask.shape)}")
    return m.expand(B, 1, T, S)


def mla_attention_dense_triton(q_lat, q_rope, latent, k_rope, attn_mask, is_causal: bool, scale: float,
                               num_splits: int = 0, config: dict | None = None) -> torch.Tensor:
    """q_lat [B, H, T, L], q_rope [B, H, T, R], latent [B, S, L], k_rope [B, S, R] (any strides),
    attn_mask [B|1, 1, T, S] bool (True = attend) / float additive / None; is_causal: key j <= i + S - T.
    -> o_lat [B, H, T, L] (q dtype)."""
    B, H, T, L = q_lat.shape
    S = latent.shape[1]
    cfg = {**CONFIGS["dense"], **(config or {})}
    if T == 1:
        cfg = {**decode_config(H), "block_m": 16, **(config or {})}
    bq, bh = _tile_rows(H, T > 1, cfg.get("block_m", 16), cfg["block_h"])
    mask = dense_mask_4d(attn_mask, B, T, S)
    mask_strides = (0, 0, 0) if mask is None else (mask.stride(0), mask.stride(2), mask.stride(3))
    tiles = B * triton.cdiv(T, bq)
    if num_splits <= 0:
        num_splits = choose_num_splits(tiles * triton.cdiv(H, bh), S, cfg["block_n"], cfg.get("per_sm", 1))
    out = torch.empty((B, H, T, L), device=q_lat.device, dtype=q_lat.dtype)
    if B == 0 or T == 0:
        return out
    return _launch(
        q_lat, q_rope, latent, k_rope, (latent.stride(0), latent.stride(1), latent.stride(2)),
        (k_rope.stride(0), k_rope.stride(1), k_rope.stride(2)), out, mode=MODE_DENSE, page=0,
        bt=None, seq=None, qsl=None, mask=mask, mask_strides=mask_strides, causal=bool(is_causal),
        q_strides_l=(q_lat.stride(0), q_lat.stride(2), q_lat.stride(1), q_lat.stride(3)),
        q_strides_r=(q_rope.stride(0), q_rope.stride(2), q_rope.stride(1), q_rope.stride(3)),
        H=H, T=T, S=S, nseq=B, grid_tiles=tiles, t_scr=T, t_out=T, n_scr_tokens=B * T, scale=scale,
        bq=bq, bh=bh, num_splits=num_splits, cfg=cfg)
