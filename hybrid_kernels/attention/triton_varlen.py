"""Packed variable-length attention over the paged key/value buffer, one Triton kernel (``varlen_attention_triton``).

One program per (block of a sequence's queries, kv head): the block's ``BLOCK_T`` queries times the ``GROUP`` query
heads that share the kv head form the rows of one tile, so each key row loaded from the pages serves every head of
its group. Programs find their sequence by a binary search over ``cu_q`` (sequence s's blocks start at program
``cu_q[s] // BLOCK_T + s``, so ``N // BLOCK_T + S`` programs cover every block of every sequence; the spare ones
exit). Keys are read in place through the block table (no gather), scores in fp32 with an online softmax; a
sequence's keys stop at its block's last query position (causal) and start at its first query's window. Optional:
logit soft-capping of the scaled scores, and learned sinks (one logit per query head that joins the softmax's
denominator only)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _key_block(q, row, tab, start, last, pos, m_i, l_i, acc, sb_row, scale_log2, softcap, window, dk, dv,
               BLOCK_N: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr,
               CAP: tl.constexpr, MASK: tl.constexpr):
    """One block of keys folded into the online softmax of a tile; MASK applies the causal, window and length masks
    (blocks wholly before every row's position need none)."""
    j = start + tl.arange(0, BLOCK_N)
    if MASK:
        jm = j <= last
        blk = tl.load(tab + j // BS, mask=jm, other=0)
    else:
        blk = tl.load(tab + j // BS)
    slot = blk.to(tl.int64) * BS + j % BS
    if MASK:
        k = tl.load(row + slot[:, None] * sb_row + DV + dk[None, :], mask=jm[:, None] & (dk[None, :] < DK), other=0.0)
        v = tl.load(row + slot[:, None] * sb_row + dv[None, :], mask=jm[:, None] & (dv[None, :] < DV), other=0.0)
    else:
        k = tl.load(row + slot[:, None] * sb_row + DV + dk[None, :], mask=dk[None, :] < DK, other=0.0)
        v = tl.load(row + slot[:, None] * sb_row + dv[None, :], mask=dv[None, :] < DV, other=0.0)
    if IEEE:
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    if CAP:  # softcap * tanh(score / softcap), the score scaled; tanh(x) = 1 - 2 / (exp(2x) + 1)
        sc = softcap * (1.0 - 2.0 / (tl.exp2(sc * (scale_log2 * 2.0 / softcap)) + 1.0)) * 1.4426950408889634
    else:
        sc = sc * scale_log2
    if MASK:
        seen = jm[None, :] & (j[None, :] <= pos[:, None])
        if window > 0:
            seen = seen & ((pos[:, None] - j[None, :]) < window)
        sc = tl.where(seen, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["s_tab", "num_seqs"])
def _varlen_kernel(q_ptr, buf_ptr, table_ptr, cu_ptr, ctx_ptr, out_ptr, sinks_ptr, sq_n, sq_h, sb_row, sb_h, so_n,
                   so_h, s_tab, num_seqs, scale_log2, softcap, window, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   DK_P: tl.constexpr, DV_P: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr,
                   SINKS: tl.constexpr, CAP: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    lo = 0
    hi = num_seqs - 1
    while lo < hi:  # the last sequence whose first block starts at or before this program
        mid = (lo + hi + 1) // 2
        ok = tl.load(cu_ptr + mid) // BLOCK_T + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    s = lo
    q0 = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - q0
    t0 = (pid - (q0 // BLOCK_T + s)) * BLOCK_T
    if t0 < n:
        width = tl.load(ctx_ptr + s)
        r = tl.arange(0, BLOCK_T * GROUP_P)
        t = t0 + r // GROUP_P
        g = r % GROUP_P
        valid = (t < n) & (g < GROUP)
        head = kvh * GROUP + g
        tok = (q0 + t).to(tl.int64)
        pos = width - n + t
        dk = tl.arange(0, DK_P)
        dv = tl.arange(0, DV_P)
        q = tl.load(q_ptr + tok[:, None] * sq_n + head[:, None] * sq_h + dk[None, :],
                    mask=valid[:, None] & (dk[None, :] < DK), other=0.0)
        last = width - n + tl.minimum(t0 + BLOCK_T, n) - 1
        k_lo = 0
        if window > 0:
            k_lo = tl.maximum(width - n + t0 - window + 1, 0)
        m_i = tl.full([BLOCK_T * GROUP_P], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_T * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_T * GROUP_P, DV_P], tl.float32)
        row = buf_ptr + kvh * sb_h
        tab = table_ptr + s * s_tab
        # Key blocks that end at or before the tile's first query position are seen by every row: no masks there
        # (with a window, every block keeps its masks).
        full = k_lo
        if window == 0:
            full = k_lo + (width - n + t0 + 1 - k_lo) // BLOCK_N * BLOCK_N
        for start in range(k_lo, full, BLOCK_N):
            m_i, l_i, acc = _key_block(q, row, tab, start, last, pos, m_i, l_i, acc, sb_row, scale_log2, softcap,
                                       window, dk, dv, BLOCK_N, DK, DV, BS, IEEE, CAP, False)
        for start in range(full, last + 1, BLOCK_N):
            m_i, l_i, acc = _key_block(q, row, tab, start, last, pos, m_i, l_i, acc, sb_row, scale_log2, softcap,
                                       window, dk, dv, BLOCK_N, DK, DV, BS, IEEE, CAP, True)
        if SINKS:  # a learned logit per head in the softmax's denominator, with no value (HF's sinks / s_aux)
            sink = tl.load(sinks_ptr + head, mask=valid, other=0.0) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_new)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * so_n + head[:, None] * so_h + dv[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (dv[None, :] < DV))


def launch_config(n_tok: int, num_seqs: int, dk_p: int, dv_p: int) -> dict:
    """The launch for a step of ``n_tok`` queries over ``num_seqs`` sequences, head widths padded to ``dk_p`` /
    ``dv_p``: rows (queries x heads per tile), block_n (keys per block), num_warps, num_stages. Each branch is the
    fastest config of bench/varlen.py's sweep on its step kind: decodes (under 4 queries a sequence),
    long prefill chunks (128 or more) and the steps between (decodes beside a few long chunks); heads wider than 128
    (MLA's expanded keys) take 8 warps for their larger tiles."""
    per_seq = n_tok / max(num_seqs, 1)
    if max(dk_p, dv_p) > 128:
        if per_seq < 4:
            return {"rows": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
        return {"rows": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
    if per_seq < 4:
        return {"rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
    if per_seq >= 128:
        return {"rows": 64, "block_n": 32, "num_warps": 4, "num_stages": 3}
    return {"rows": 128, "block_n": 64, "num_warps": 4, "num_stages": 3}


def varlen_attention_triton(q: torch.Tensor, buf: torch.Tensor, block_table: torch.Tensor, cu_q: torch.Tensor,
                            ctx: torch.Tensor, v_dim: int, block_size: int, window: int,
                            scale: float, sinks: torch.Tensor | None = None, softcap: float = 0.0,
                            config: dict | None = None) -> torch.Tensor:
    """``reference.varlen_attention_ref`` in one launch (same arguments, same result within rounding). ``config``
    (bench/varlen.py's sweep) overrides the launch: rows (queries x heads per tile), block_n, num_warps, num_stages."""
    n_tok, hq, dk = q.shape
    hkv = buf.shape[1]
    group = hq // hkv
    group_p = triton.next_power_of_2(group)
    dk_p, dv_p = triton.next_power_of_2(max(dk, 16)), triton.next_power_of_2(max(v_dim, 16))
    cfg = {**launch_config(n_tok, ctx.shape[0], dk_p, dv_p), **(config or {})}
    block_t = max(1, cfg["rows"] // group_p)  # rows per tile: queries x the heads of the group
    out = torch.empty(n_tok, hq, v_dim, dtype=q.dtype, device=q.device)
    num_seqs = ctx.shape[0]
    if n_tok == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert buf.stride(-1) == 1 and block_table.stride(-1) == 1, "buffer rows and table rows must be contiguous"
    grid = (n_tok // block_t + num_seqs, hkv)
    sinks = None if sinks is None else sinks.float().contiguous()
    _varlen_kernel[grid](q, buf, block_table, cu_q, ctx, out, out if sinks is None else sinks, q.stride(0), q.stride(1),
                         buf.stride(0), buf.stride(1), out.stride(0), out.stride(1), block_table.stride(0), num_seqs,
                         scale * LOG2E, float(softcap), window,
                         GROUP=group, GROUP_P=group_p, BLOCK_T=block_t, BLOCK_N=cfg["block_n"],
                         DK=dk, DV=v_dim, DK_P=dk_p, DV_P=dv_p, BS=block_size, IEEE=q.dtype == torch.float32,
                         SINKS=sinks is not None, CAP=softcap > 0,
                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
