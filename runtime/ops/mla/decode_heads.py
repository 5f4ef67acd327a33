"""MLA decode at a few sequences and short contexts: absorption, attention and W_UV per head, in one launch.

At B=1 the engine's decode of one MLA layer was three launches that mostly wait: the W_UK absorption (a
batched matmul over 16 heads, 2 MB of weights), the split-KV attention (one 16-head tile per split, each key
tile's two dots latency-bound at M = 16) and the merge with W_UV. Here a program owns one (sequence, head,
split): it computes its head's absorbed query itself (q_nope [P] @ W_UK[h] [P, L], fp32 sums, rounded to the
query dtype as the batched matmul stores it), attends over its split's keys on the CUDA cores (scores and
p @ latent as fp32 sums; p rounded to the cache dtype as the tensor-core kernel feeds its second dot) and
writes its partial output and log-sum-exp. The last split of a (sequence, head) to finish (an atomic count
per row, zeroed by the launcher and read back by that program with L2 loads) merges the partials and applies
W_UV[h] [V, L] to the merged row (rounded to the output dtype first, as the unfused path stores o_lat).

Each program reads W_UK[h] (P x L) and, if last, W_UV[h]: at B x H x splits programs the weights are read
once from HBM and splits times from L2, and every head re-reads its keys (from L2 after the first). That is
cheap at a few sequences and short contexts and wrong for long ones: ``paged.py`` takes this path only up to
``CONFIGS["heads"]["max_batch"]`` sequences and ``max_keys`` keys of capacity (``kernels.py`` otherwise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ..library import size_hint
from .kernels import LOG2E, _merge_splits, _pow2

CONFIGS = {
    # splits: programs per (sequence, head) = slots // (B * H), at least 1, at most max_splits, and keeping
    # >= min_keys keys of capacity per split. block_p: rows of W_UK per load; block_n keys per tile;
    # block_v: rows of W_UV per load in the merge.
    "heads": dict(num_warps=8, block_p=32, block_n=32, block_v=32, slots=132, max_splits=16, min_keys=32,
                  max_batch=4, max_keys=4096),
}


@triton.jit
def _mla_decode_heads_kernel(QN, QR, W, KV, BT, SEQ, PO, PLSE, CNT, O,
                             s_qnb, s_qnh, s_qrb, s_qrh, s_wh, s_wr, s_kb, s_ks, s_bt, s_ob, s_oh,
                             H, P, L, R, V, NUM_SPLITS, sm_scale_log2,
                             PAGE: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr,
                             BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_S: tl.constexpr):
    n = tl.program_id(0)  # sequence * H + head
    split = tl.program_id(1)
    b = (n // H).to(tl.int64)
    h = (n % H).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < L
    r_ok = offs_r < R
    q_dtype = QN.dtype.element_ty
    kv_dtype = KV.dtype.element_ty

    # ---- the absorbed query of this head: q_lat = q_nope @ W_UK[h] ----
    q_lat = tl.zeros([BLOCK_L], dtype=tl.float32)
    for p0 in tl.static_range(0, BLOCK_P, BP):
        offs_p = p0 + tl.arange(0, BP)
        p_ok = offs_p < P
        qn = tl.load(QN + b * s_qnb + h * s_qnh + offs_p, mask=p_ok, other=0.0).to(tl.float32)
        wk = tl.load(W + h * s_wh + offs_p[:, None] * s_wr + offs_l[None, :],
                     mask=p_ok[:, None] & l_ok[None, :], other=0.0).to(tl.float32)
        q_lat += tl.sum(wk * qn[:, None], 0)
    q_lat = q_lat.to(q_dtype).to(kv_dtype).to(tl.float32)
    q_rope = tl.load(QR + b * s_qrb + h * s_qrh + offs_r, mask=r_ok, other=0.0).to(kv_dtype).to(tl.float32)

    # ---- this split's keys: chunks of BN dealt out evenly ----
    seq_len = tl.load(SEQ + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, BN), NUM_SPLITS)
    k_lo = split * per_split * BN
    k_hi = tl.minimum((split + 1) * per_split * BN, seq_len)
    m_i = tl.max(tl.full([BN], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BN], dtype=tl.float32), 0)
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for start in range(k_lo, k_hi, BN):
        offs_n = start + tl.arange(0, BN)
        n_ok = offs_n < k_hi
        blk = tl.load(BT + b * s_bt + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        row = blk * s_kb + (offs_n % PAGE).to(tl.int64) * s_ks
        lat = tl.load(KV + row[:, None] + offs_l[None, :], mask=n_ok[:, None] & l_ok[None, :],
                      other=0.0).to(tl.float32)                                   # [BN, BLOCK_L]
        rope = tl.load(KV + row[:, None] + L + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                       other=0.0).to(tl.float32)                                  # [BN, BLOCK_R]
        qk = tl.sum(lat * q_lat[None, :], 1) + tl.sum(rope * q_rope[None, :], 1)
        qk = tl.where(n_ok, qk * tl.cast(sm_scale_log2, tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 0))  # finite: the tile holds at least one key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        p = p.to(kv_dtype).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * lat, 0)
        m_i = m_new

    # ---- partial output and log-sum-exp (-inf: no keys, the merge skips it) ----
    prow = n.to(tl.int64) * NUM_SPLITS + split
    l_use = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(PLSE + prow, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_use)))
    tl.store(PO + prow * L + offs_l, acc / l_use, mask=l_ok & ((acc * 0.0 + l_i) > 0.0))  # a vector mask

    # ---- the last split of this row to finish merges and applies W_UV[h] ----
    tl.debug_barrier()  # every thread's partial stores are issued before the count is released
    done = tl.atomic_add(CNT + n, 1, sem="acq_rel")
    if done == NUM_SPLITS - 1:
        tl.store(CNT + n, 0)  # ready for the next call (a CUDA graph replays this launch)
        o = _merge_splits(PO, PLSE, n, L, NUM_SPLITS, BLOCK_L, BLOCK_S)
        o = o.to(O.dtype.element_ty).to(tl.float32)
        for v0 in range(0, V, BV):
            offs_v = v0 + tl.arange(0, BV)
            v_ok = offs_v < V
            wv = tl.load(W + h * s_wh + (P + offs_v)[:, None] * s_wr + offs_l[None, :],
                         mask=v_ok[:, None] & l_ok[None, :], other=0.0).to(tl.float32)
            tl.store(O + b * s_ob + h * s_oh + offs_v, tl.sum(wv * o[None, :], 1).to(O.dtype.element_ty), mask=v_ok)


def heads_splits(batch, heads, capacity, config: dict | None = None) -> int:
    """Splits per (sequence, head) from shapes only (capacity = block table width x page, not the live length)."""
    c = {**CONFIGS["heads"], **(config or {})}
    rows = max(1, size_hint(batch) * size_hint(heads))
    most = max(1, min(c["max_splits"], size_hint(capacity) // c["min_keys"]))
    return max(1, min(most, c["slots"] // rows))


def use_heads_kernel(batch, capacity) -> bool:
    c = CONFIGS["heads"]
    return size_hint(batch) <= c["max_batch"] and size_hint(capacity) <= c["max_keys"]


def mla_decode_heads_triton(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, w: torch.Tensor, scale: float,
                            num_splits: int = 0, config: dict | None = None) -> torch.Tensor:
    """q_nope [B, H, P], q_rope [B, H, R] (last dims contiguous), cache [NB, BS, L+R], block_table [B, MB] int32,
    seq_lens [B] int32, w = kv_b_proj.weight viewed [H, P + V, L] (rows contiguous) -> [B, H, V] in q's dtype:
    ((softmax((q_nope W_UK) latent^T + q_rope k_rope^T) * scale) latent) W_UV^T per head, as
    ``hybrid::mla_attention_paged`` computes it in three launches."""
    B, H, P = q_nope.shape
    R = q_rope.shape[-1]
    L = cache.shape[-1] - R
    V = w.shape[1] - P
    assert w.dim() == 3 and w.shape[0] == H and w.shape[2] == L and w.stride(2) == 1, \
        f"w must be [H={H}, P + V, L={L}] with contiguous rows, got {tuple(w.shape)}"
    assert q_nope.stride(2) == 1 and q_rope.stride(2) == 1, "q_nope / q_rope need a contiguous last dim"
    assert cache.dim() == 3 and cache.stride(2) == 1, "cache must be [num_blocks, block_size, L+R], rows contiguous"
    c = {**CONFIGS["heads"], **(config or {})}
    page = cache.shape[1]
    if num_splits <= 0:
        num_splits = heads_splits(B, H, block_table.shape[1] * page, c)
    out = torch.empty((B, H, V), device=q_nope.device, dtype=q_nope.dtype)
    if B == 0:
        return out
    po = torch.empty((B * H * num_splits * L,), device=q_nope.device, dtype=torch.float32)
    plse = torch.empty((B * H * num_splits,), device=q_nope.device, dtype=torch.float32)
    count = torch.zeros((B * H,), device=q_nope.device, dtype=torch.int32)
    wrap_triton(_mla_decode_heads_kernel)[(B * H, num_splits)](
        q_nope, q_rope, w, cache, block_table, seq_lens, po, plse, count, out,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), w.stride(0), w.stride(1),
        cache.stride(0), cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
        H, P, L, R, V, num_splits, scale * LOG2E,
        PAGE=page, BP=c["block_p"], BN=c["block_n"], BV=c["block_v"], BLOCK_P=_pow2(P, c["block_p"]),
        BLOCK_L=_pow2(L), BLOCK_R=_pow2(R), BLOCK_S=min(triton.next_power_of_2(num_splits), 16),
        num_warps=c["num_warps"])
    return out
