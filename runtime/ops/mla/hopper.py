"""MLA decode on Hopper in Gluon (sm_90, bf16 / fp16): the ops, and the kernel for 64+ heads (two warp-specialised
warpgroups). Up to 32 heads take hopper_narrow.py's kernel; the ops below pick by head count.

At 64+ heads decode is tensor-core-bound (each latent byte feeds 2 x 1088 flops per head). The Triton kernel
(kernels.py) cannot give its two warpgroups different work: Triton lays out a dot whose result feeds another dot with
warps [num_warps, 1], so both warpgroups compute the same 64 x 64 scores (docs/limitations.md). Here the layouts and
the schedule are ours. One program = (64 heads, sequence, split); the two head groups of a sequence are neighbours in
the grid, so its keys come from HBM once and from L2 the second time.

Schedule ("seesaw", after FlashMLA's write-up of its Hopper kernel): the output O [64, 512] is split by columns,
warpgroup 0 owns O_L (columns 0..255), warpgroup 1 owns O_R (256..511), each a 64 x 256 fp32 accumulator. Key tiles
of 64 come in pairs: warpgroup 0 scores the even tile K0, warpgroup 1 the odd tile K1, so each score dot is a full
64 x 64 x 576 wgmma and one warpgroup's softmax runs while the other's dots do. Per pair:

  wg0: S0 = q K0^T; m0 = max(m, rowmax S0) -> wg1; P0 = exp2(S0 - m0); O_L = O_L exp2(m - m0) + P0 V0_L
       (P0 from registers)
  wg1: S1 = q K1^T; m1 = max(m0, rowmax S1) -> wg0; P1 = exp2(S1 - m1) -> shared memory -> wg0
  wg0: P0 *= exp2(m0 - m1) -> shared memory -> wg1; O_L *= exp2(m0 - m1); O_L += P1 V1_L
  wg1: O_R = O_R exp2(m - m1) + P0 V0_R + P1 V1_R

Row sums are kept per warpgroup (of its own P) and added once at the end. The max, P and "buffer free" hand-offs
are mbarriers. Shared memory: q 72 KB + two key tiles of 72 KB (rows [latent | rope]) = 216 KB; a tile's rope
columns are dead once its scores are in, so its P goes there. Keys come by cp.async from the paged cache or (page
0) from HF's dense latent and rope tensors, issued by the warpgroup that scores the tile, in two commit groups; the
next pair's loads start as soon as the columns they overwrite are free (columns 0..255 of K0 after PV0_L, 256..511
of K1 after PV1_R, the rest after the other warpgroup's P . V), and the score dots wait for each group separately.
One split writes o_lat; several write the split-KV partials (o, lse) that kernels.py's merge kernels read, in the
layout of ``_mla_attn_kernel``'s decode mode. Measured: bench/results/2026-11-30_mla_decode_seesaw_h200.md (paged)
and ..._dense_h200.md (HF's cache).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from ..library import op_name, pdl_opts

try:  # Gluon (Triton >= 3.5); the module stays importable where it is missing (CPU-only installs)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    # cp.async of a pointer tensor into shared memory: ``async_load`` from Triton 3.7 on (the old name raises there)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed barrier() in Triton 3.7
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

BH, BN = 64, 64                # heads per program, keys per tile
NARROW_MAX_HEADS = 32          # up to this many heads: hopper_narrow.py (all heads of a sequence in one program)
LAT, ROPE = 512, 64            # the only latent / rope widths the kernel is built for (DeepSeek V2 / V3)
ENABLED = os.environ.get("HYBRID_MLA_WG", "1") != "0"  # 0: decode takes the Triton kernel (A/B in bench/mla.py)


def _rows_ok(t: Tensor, width: int) -> bool:
    """A [.., rows, width] operand cp.async can copy 16 bytes at a time: last dim contiguous, a 16-byte aligned start
    (the offset into its storage: no data pointer, which a compiled graph's fake tensors do not have), other strides
    multiples of 8 elements."""
    return (t.shape[-1] == width and t.stride(-1) == 1 and t.storage_offset() * t.element_size() % 16 == 0
            and all(st % 8 == 0 for st in t.stride()[:-1]))


def _queries_ok(q_lat: Tensor, q_rope: Tensor, *keys: Tensor) -> bool:
    if not (ENABLED and HAVE_GLUON and q_lat.is_cuda and torch.cuda.get_device_capability(q_lat.device)[0] == 9):
        return False
    heads = q_lat.shape[1]
    return ((heads % BH == 0 or 0 < heads <= NARROW_MAX_HEADS) and q_lat.dtype in (torch.bfloat16, torch.float16)
            and all(t.dtype == q_lat.dtype for t in (q_rope, *keys))
            and _rows_ok(q_lat, LAT) and _rows_ok(q_rope, ROPE))


def supported(q_lat: Tensor, q_rope: Tensor, cache: Tensor) -> bool:
    """Whether a Gluon kernel serves this paged decode: a Hopper GPU, heads <= 32 or a multiple of 64, L = 512, R = 64,
    bf16 / fp16 queries and cache, rows cp.async can copy (q_lat [B, H, 512], cache [NB, page, 576])."""
    return _queries_ok(q_lat, q_rope, cache) and _rows_ok(cache, LAT + ROPE)


def supported_dense(q_lat: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor) -> bool:
    """The same for one-token decode over HF's dense cache: latent [B, S, 512] and k_rope [B, S, 64]."""
    return _queries_ok(q_lat, q_rope, latent, k_rope) and _rows_ok(latent, LAT) and _rows_ok(k_rope, ROPE)


if HAVE_GLUON:
    # one warpgroup's layouts: scores [64 heads, 64 keys] and its half of the output [64, 256], wgmma accumulators
    _S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]))
    _O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, LAT // 2, 16]))
    _P_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O_LAYOUT.value, k_width=2))  # P . V's A
    _ROWS = gl.constexpr(gl.SliceLayout(1, _S_LAYOUT.value))  # per-row values (maxima, sums)
    # the mbarriers: row maxima and P handed over, key columns freed, row sums handed over (one completion per pair)
    _M0, _M1, _P0, _P1, _K0_FREE, _K1_FREE, _L0 = (gl.constexpr(i) for i in range(7))

    @gluon.jit
    def _pdl_start(PDL: gl.constexpr):
        """library.pdl_start in Gluon: wait for the kernel before (its writes visible), then let the next one (the
        merge) launch, its programs waiting in their own pdl_start while this kernel runs."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    # one warpgroup's [64 keys, 64 columns] copies: a warp's 16-byte copies take 4 whole 128-byte rows. (8 rows x 64 bytes,
    # as until 2026-12-01, ran the 16-head decode 5-12% slower: bench/results/2026-12-01_mla_probe_h200.md.)
    _CHUNK = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

    @gluon.jit
    def _key_blocks(BT, kb, start, bt_keys, PAGE: gl.constexpr, BN: gl.constexpr):
        """Where the keys start .. start + BN sit: paged (PAGE > 0), key k in block BT[kb + k // PAGE] ([BN] block
        ids, a plain load: it stalls only where used; ids past the sequence are loaded too, but never copied from);
        dense (PAGE == 0), all in batch row kb. bt_keys: the keys a block-table row addresses (its width x PAGE), the
        load's bound, so that it need not wait for the sequence's length."""
        if PAGE > 0:
            keys = start + gl.arange(0, BN, layout=gl.SliceLayout(1, _CHUNK))
            return gl.load(BT + kb + keys // PAGE, mask=keys < bt_keys, other=0).to(gl.int64)
        else:
            return kb

    @gluon.jit
    def _copy_keys(LATP, ROPEP, blk, start, k_hi, s_lb, s_ls, s_rb, s_rs, lat_dst, rope_dst, C0: gl.constexpr,
                   NC: gl.constexpr, WITH_ROPE: gl.constexpr, PAGE: gl.constexpr, LAT: gl.constexpr,
                   BN: gl.constexpr):
        """cp.async (one commit group) of latent columns [64 C0, 64 (C0 + NC)) of the key tile start .. start + BN
        (in blocks ``blk``, from _key_blocks), and its rope columns if WITH_ROPE, issued by one warpgroup; keys >=
        k_hi read as zeros. 64-column copies keep few pointers live; Triton 3.6 puts a CTA barrier between copies
        into slices of one buffer (3.9 does not), but one wide copy per tile measured slower (2026-12-01 probe)."""
        keys = start + gl.arange(0, BN, layout=gl.SliceLayout(1, _CHUNK))
        if PAGE > 0:
            pos = (keys % PAGE).to(gl.int64)
        else:
            pos = keys.to(gl.int64)
        row_l = gl.expand_dims(blk * s_lb + pos * s_ls, 1)
        ok = gl.expand_dims(keys < k_hi, 1)
        cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, _CHUNK)), 0)
        for c in gl.static_range(C0, C0 + NC):
            _cp_async(lat_dst.slice(c * 64, 64, dim=1), LATP + row_l + (cols + c * 64), mask=ok)
        if WITH_ROPE:
            _cp_async(rope_dst, ROPEP + gl.expand_dims(blk * s_rb + pos * s_rs, 1) + cols, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _load_keys(LATP, ROPEP, BT, kb, start, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, lat_dst, rope_dst,
                   C0: gl.constexpr, NC: gl.constexpr, WITH_ROPE: gl.constexpr, PAGE: gl.constexpr, LAT: gl.constexpr,
                   BN: gl.constexpr):
        """_copy_keys of the tile's columns, its block ids loaded here (paged: in batch-row kb of the table BT)."""
        _copy_keys(LATP, ROPEP, _key_blocks(BT, kb, start, bt_keys, PAGE, BN), start, k_hi, s_lb, s_ls, s_rb, s_rs,
                   lat_dst, rope_dst, C0, NC, WITH_ROPE, PAGE, LAT, BN)

    @gluon.jit
    def _sequence(SEQ, S_DENSE, b64, s_bt, PAGE: gl.constexpr):
        """Sequence b64: (kb, its length). kb: its block-table row offset (paged) or batch row (dense, every sequence
        S_DENSE keys)."""
        if PAGE > 0:
            return b64 * s_bt, gl.load(SEQ + b64)
        else:
            return b64, S_DENSE

    @gluon.jit
    def _scores(q_lat_s, q_rope_s, lat, rope, s, C0: gl.constexpr, NC: gl.constexpr, WITH_ROPE: gl.constexpr,
                PENDING: gl.constexpr, FIRST: gl.constexpr):
        """Once this warpgroup's copies but the last PENDING groups landed: s += q . keys over latent columns
        [64 C0, 64 (C0 + NC)) (+ the rope columns), issued asynchronously."""
        async_copy.wait_group(PENDING)
        fence_async_shared()
        _cta_barrier()
        for c in gl.static_range(C0, C0 + NC):
            s = warpgroup_mma(q_lat_s.slice(c * 64, 64, dim=1), lat.slice(c * 64, 64, dim=1).permute((1, 0)), s,
                              use_acc=not (FIRST and c == C0), is_async=True)
        if WITH_ROPE:
            s = warpgroup_mma(q_rope_s, rope.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _masked(s, start, k_hi, sm_scale_log2, s_layout: gl.constexpr, BN: gl.constexpr):
        """Scores in the log2 domain; keys >= k_hi (past the split or the sequence) -inf."""
        keys = start + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        return gl.where(gl.expand_dims(keys < k_hi, 0), s * sm_scale_log2, float("-inf"))

    @gluon.jit
    def _signal(bar):
        """Every thread of this warpgroup is past its shared-memory writes / reads -> one arrival."""
        _cta_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _finish(acc, m_i, l_own, l_s, bars, me: gl.constexpr, col0: gl.constexpr, PO, PLSE, O, b64, h0, pid_split,
                s_ob, s_oh, H, NUM_SPLITS, o_layout: gl.constexpr, row_layout: gl.constexpr, LAT: gl.constexpr,
                BH: gl.constexpr, DIRECT: gl.constexpr):
        """Row sums summed across the two warpgroups, then this warpgroup's 256 output columns (and, for warpgroup
        0, the lse of the partials)."""
        l_s.slice(me * BH, BH).store(l_own)
        _signal(bars.index(_L0 + me))
        mbarrier.wait(bars.index(_L0 + 1 - me), 0)
        l_i = l_own + l_s.slice((1 - me) * BH, BH).load(row_layout)
        l_use = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / gl.expand_dims(gl.convert_layout(l_use, gl.SliceLayout(1, o_layout)), 1)
        heads_o = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, o_layout))
        cols_o = col0 + gl.arange(0, LAT // 2, layout=gl.SliceLayout(0, o_layout))
        if DIRECT:
            gl.store(O + b64 * s_ob + gl.expand_dims(heads_o.to(gl.int64) * s_oh, 1) + gl.expand_dims(cols_o, 0),
                     out.to(O.dtype.element_ty))
        else:
            if me == 0:
                lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_use))
                rows_s = (b64 * H + h0 + gl.arange(0, BH, layout=row_layout)) * NUM_SPLITS + pid_split
                gl.store(PLSE + rows_s, lse)
            rows_o = (b64 * H + heads_o) * NUM_SPLITS + pid_split
            live = gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)) > 0.0, 1)
            gl.store(PO + gl.expand_dims(rows_o * LAT, 1) + gl.expand_dims(cols_o, 0), out,
                     mask=live & gl.expand_dims(cols_o < LAT, 0))

    @gluon.jit
    def _even_tiles(q_lat_s, q_rope_s, lat_s, rope_s, m_s, l_s, bars, LATP, ROPEP, BT, PO, PLSE, O, b64, h0, pid_split,
                    k_lo, k_hi, bt_keys, n_pairs, s_lb, s_ls, s_rb, s_rs, kb, s_ob, s_oh, H, NUM_SPLITS, sm_scale_log2,
                    PAGE: gl.constexpr, LAT: gl.constexpr, ROPE: gl.constexpr, DIRECT: gl.constexpr, BH: gl.constexpr,
                    BN: gl.constexpr):
        """Warpgroup 0: scores of the even tiles (K0), output columns 0..255."""
        dtype: gl.constexpr = LATP.dtype.element_ty
        s_layout: gl.constexpr = _S_LAYOUT
        o_layout: gl.constexpr = _O_LAYOUT
        p_op: gl.constexpr = _P_OPERAND
        row_layout: gl.constexpr = _ROWS
        k0 = lat_s.index(0)
        p0_s = rope_s.index(0)   # K0's rope columns are dead once its scores are in: P0 goes there
        k1 = lat_s.index(1)
        p1_s = rope_s.index(1)
        step = 2 * BN * NUM_SPLITS    # from one of the split's pairs to its next
        # tile 0: latent columns 0..255 (PV0L frees them first) then the rest
        _load_keys(LATP, ROPEP, BT, kb, k_lo, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, k0, p0_s, 0, 4, False, PAGE, LAT,
                   BN)
        _load_keys(LATP, ROPEP, BT, kb, k_lo, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, k0, p0_s, 4, 4, True, PAGE, LAT,
                   BN)
        m_i = gl.full([BH], -1.0e30, gl.float32, layout=row_layout)
        l_i = gl.zeros([BH], gl.float32, layout=row_layout)
        acc = gl.zeros([BH, LAT // 2], gl.float32, layout=o_layout)
        for j in range(n_pairs):
            ph = j & 1
            start = k_lo + j * step
            s = gl.zeros([BH, BN], gl.float32, layout=s_layout)
            s = _scores(q_lat_s, q_rope_s, k0, p0_s, s, 0, 4, False, 1, True)
            s = _scores(q_lat_s, q_rope_s, k0, p0_s, s, 4, 4, True, 0, False)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = _masked(s, start, k_hi, sm_scale_log2, s_layout, BN)
            m0 = gl.maximum(m_i, gl.max(s, 1))
            m_s.slice(0, BH).store(m0)
            _signal(bars.index(_M0))                             # m0 -> warpgroup 1
            alpha = gl.exp2(m_i - m0)
            p = gl.exp2(s - gl.expand_dims(m0, 1)).to(dtype)
            l_i = l_i * alpha + gl.sum(p.to(gl.float32), 1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            acc = warpgroup_mma(gl.convert_layout(p, p_op), k0.slice(0, LAT // 2, dim=1), acc, is_async=True)
            mbarrier.wait(bars.index(_M1), ph)                   # m1 (the pair's max) from warpgroup 1
            m1 = m_s.slice(BH, BH).load(row_layout)
            scale1 = gl.exp2(m0 - m1)
            p0_s.store((p.to(gl.float32) * gl.expand_dims(scale1, 1)).to(dtype))
            fence_async_shared()
            _signal(bars.index(_P0))                             # P0 (at m1) -> warpgroup 1
            l_i = l_i * scale1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc = acc * gl.expand_dims(gl.convert_layout(scale1, gl.SliceLayout(1, o_layout)), 1)
            more = j + 1 < n_pairs
            if more:                                         # K0's columns 0..255 are free: the next even tile's
                _load_keys(LATP, ROPEP, BT, kb, start + step, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, k0, p0_s,
                           0, 4, False, PAGE, LAT, BN)
            mbarrier.wait(bars.index(_P1), ph)                   # P1 from warpgroup 1
            acc = warpgroup_mma(p1_s, k1.slice(0, LAT // 2, dim=1), acc, is_async=True)
            if more:                                         # warpgroup 1 is done with K0 and P0: the rest
                mbarrier.wait(bars.index(_K0_FREE), ph)
                _load_keys(LATP, ROPEP, BT, kb, start + step, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, k0, p0_s,
                           4, 4, True, PAGE, LAT, BN)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _signal(bars.index(_K1_FREE))                        # K1's columns 0..255 and P1 are free
            m_i = m1
        _finish(acc, m_i, l_i, l_s, bars, 0, 0, PO, PLSE, O, b64, h0, pid_split, s_ob, s_oh, H, NUM_SPLITS,
                   o_layout, row_layout, LAT, BH, DIRECT)

    @gluon.jit
    def _odd_tiles(q_lat_s, q_rope_s, lat_s, rope_s, m_s, l_s, bars, LATP, ROPEP, BT, PO, PLSE, O, b64, h0, pid_split,
                   k_lo, k_hi, bt_keys, n_pairs, s_lb, s_ls, s_rb, s_rs, kb, s_ob, s_oh, H, NUM_SPLITS, sm_scale_log2,
                   PAGE: gl.constexpr, LAT: gl.constexpr, ROPE: gl.constexpr, DIRECT: gl.constexpr, BH: gl.constexpr,
                   BN: gl.constexpr):
        """Warpgroup 1: scores of the odd tiles (K1), output columns 256..511."""
        dtype: gl.constexpr = LATP.dtype.element_ty
        s_layout: gl.constexpr = _S_LAYOUT
        o_layout: gl.constexpr = _O_LAYOUT
        p_op: gl.constexpr = _P_OPERAND
        row_layout: gl.constexpr = _ROWS
        k0 = lat_s.index(0)
        p0_s = rope_s.index(0)
        k1 = lat_s.index(1)
        p1_s = rope_s.index(1)
        step = 2 * BN * NUM_SPLITS
        # tile 1: latent columns 256..511 (PV1R frees them first) then the rest
        _load_keys(LATP, ROPEP, BT, kb, k_lo + BN, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, k1, p1_s, 4, 4, False, PAGE,
                   LAT, BN)
        _load_keys(LATP, ROPEP, BT, kb, k_lo + BN, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, k1, p1_s, 0, 4, True, PAGE,
                   LAT, BN)
        m_i = gl.full([BH], -1.0e30, gl.float32, layout=row_layout)
        l_i = gl.zeros([BH], gl.float32, layout=row_layout)
        acc = gl.zeros([BH, LAT // 2], gl.float32, layout=o_layout)
        for j in range(n_pairs):
            ph = j & 1
            start = k_lo + j * step + BN
            s = gl.zeros([BH, BN], gl.float32, layout=s_layout)
            s = _scores(q_lat_s, q_rope_s, k1, p1_s, s, 4, 4, False, 1, True)
            s = _scores(q_lat_s, q_rope_s, k1, p1_s, s, 0, 4, True, 0, False)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = _masked(s, start, k_hi, sm_scale_log2, s_layout, BN)
            mbarrier.wait(bars.index(_M0), ph)                   # m0 from warpgroup 0
            m1 = gl.maximum(m_s.slice(0, BH).load(row_layout), gl.max(s, 1))
            m_s.slice(BH, BH).store(m1)
            _signal(bars.index(_M1))                             # m1 -> warpgroup 0
            alpha = gl.exp2(m_i - m1)
            p = gl.exp2(s - gl.expand_dims(m1, 1)).to(dtype)
            l_i = l_i * alpha + gl.sum(p.to(gl.float32), 1)
            p1_s.store(p)
            fence_async_shared()
            _signal(bars.index(_P1))                             # P1 -> warpgroup 0
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            mbarrier.wait(bars.index(_P0), ph)                   # P0 from warpgroup 0
            acc = warpgroup_mma(p0_s, k0.slice(LAT // 2, LAT // 2, dim=1), acc, is_async=True)
            acc = warpgroup_mma(gl.convert_layout(p, p_op), k1.slice(LAT // 2, LAT // 2, dim=1), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            _signal(bars.index(_K0_FREE))                        # K0's columns 256..511 and P0 are free
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if j + 1 < n_pairs:                              # K1's columns 256..511 are free: the next odd tile's
                _load_keys(LATP, ROPEP, BT, kb, start + step, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, k1, p1_s,
                           4, 4, False, PAGE, LAT, BN)
                mbarrier.wait(bars.index(_K1_FREE), ph)          # warpgroup 0 is done with K1 and P1: the rest
                _load_keys(LATP, ROPEP, BT, kb, start + step, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, k1, p1_s,
                           0, 4, True, PAGE, LAT, BN)
            m_i = m1
        _finish(acc, m_i, l_i, l_s, bars, 1, LAT // 2, PO, PLSE, O, b64, h0, pid_split, s_ob, s_oh, H,
                   NUM_SPLITS, o_layout, row_layout, LAT, BH, DIRECT)

    @gluon.jit
    def _mla_decode_wg_kernel(QL, QR, LATP, ROPEP, BT, SEQ, PO, PLSE, O,
                              s_qlb, s_qlh, s_qrb, s_qrh, s_lb, s_ls, s_rb, s_rs, s_bt, N_BT, s_ob, s_oh,
                              H, NUM_SPLITS, S_DENSE, sm_scale_log2,
                              PAGE: gl.constexpr, LAT: gl.constexpr, ROPE: gl.constexpr, DIRECT: gl.constexpr,
                              BH: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False):
        """Keys from pages (PAGE > 0: block table BT, lengths SEQ) or from HF's dense latent / rope tensors
        (PAGE == 0: every sequence S_DENSE keys long)."""
        _pdl_start(PDL)
        b = gl.program_id(1)            # the head groups of one sequence run side by side: its keys are read from
        h0 = gl.program_id(0) * BH      # HBM once, then from L2
        pid_split = gl.program_id(2)
        b64 = b.to(gl.int64)
        dtype: gl.constexpr = LATP.dtype.element_ty
        smem_lat: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, LAT], dtype)
        smem_rope: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, ROPE], dtype)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

        # pairs of key tiles dealt round-robin: split s takes pairs s, s + NUM_SPLITS, ... Its first pair's block ids
        # need not wait for the length. (Contiguous runs of pairs, as until 2026-12-01, ran 4-7% slower, also at one
        # split, where the order is the same: bench/results/2026-12-01_mla_split_start_h200.md.)
        kb, k_hi = _sequence(SEQ, S_DENSE, b64, s_bt, PAGE)
        n_pairs = gl.cdiv(gl.maximum(gl.cdiv(k_hi, 2 * BN) - pid_split, 0), NUM_SPLITS)
        k_lo = pid_split * 2 * BN
        bt_keys = N_BT * PAGE

        q_lat_s = gl.allocate_shared_memory(dtype, [BH, LAT], smem_lat)
        q_rope_s = gl.allocate_shared_memory(dtype, [BH, ROPE], smem_rope)
        lat_s = gl.allocate_shared_memory(dtype, [2, BN, LAT], smem_lat)
        rope_s = gl.allocate_shared_memory(dtype, [2, BN, ROPE], smem_rope)
        m_s = gl.allocate_shared_memory(gl.float32, [2 * BH], flat)  # the two warpgroups' row maxima
        l_s = gl.allocate_shared_memory(gl.float32, [2 * BH], flat)  # and row sums
        bars = gl.allocate_shared_memory(gl.int64, [_L0 + 2, 1], mbarrier.MBarrierLayout())
        for k in gl.static_range(_L0 + 2):
            mbarrier.init(bars.index(k), count=1)

        # queries straight into shared memory (cp.async, 64-column chunks)
        chunk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        heads = gl.expand_dims((h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, chunk))).to(gl.int64), 1)
        cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, chunk)), 0)
        for c in gl.static_range(LAT // 64):
            _cp_async(q_lat_s.slice(c * 64, 64, dim=1), QL + b64 * s_qlb + heads * s_qlh + (cols + c * 64))
        _cp_async(q_rope_s, QR + b64 * s_qrb + heads * s_qrh + cols)
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        _cta_barrier()

        # warpgroup 1's code is the default partition (it also ran the prologue above); warpgroup 0's, which keeps P0
        # in registers across the max exchange, is the worker with all 256 registers (8-16 B of spills on Triton 3.9,
        # 20-36 B of hoisted addresses on 3.6; the other way round spills more). The argument tuples are written out in
        # the call: a tuple bound to a name first turns its constexprs into tensors (Triton 3.9).
        gl.warp_specialize([
            (_odd_tiles, (q_lat_s, q_rope_s, lat_s, rope_s, m_s, l_s, bars, LATP, ROPEP, BT, PO, PLSE, O, b64, h0,
                       pid_split, k_lo, k_hi, bt_keys, n_pairs, s_lb, s_ls, s_rb, s_rs, kb, s_ob, s_oh, H, NUM_SPLITS,
                       sm_scale_log2,
                       PAGE, LAT, ROPE, DIRECT, BH, BN)),
            (_even_tiles, (q_lat_s, q_rope_s, lat_s, rope_s, m_s, l_s, bars, LATP, ROPEP, BT, PO, PLSE, O, b64, h0,
                       pid_split, k_lo, k_hi, bt_keys, n_pairs, s_lb, s_ls, s_rb, s_rs, kb, s_ob, s_oh, H, NUM_SPLITS,
                       sm_scale_log2,
                       PAGE, LAT, ROPE, DIRECT, BH, BN))], [4], [256])


def split_count(B: int, H: int, max_len) -> int:
    """The split-KV factor for these kernels: one program per (64 heads | every head, sequence, split), one program
    per SM (their shared memory), tiles of BN keys."""
    from . import kernels
    programs = B * (1 if H <= NARROW_MAX_HEADS else H // BH)
    return kernels.choose_num_splits(programs, max_len, BN, per_sm=1)


def _launch(q_lat, q_rope, lat, rope, page: int, block_table, seq_lens, scale: float, num_splits: int, out, **knobs):
    """Paged (page > 0: lat / rope are the cache and its rope columns, [NB, page, *]) or dense (page 0: [B, S, *]).
    One split: o_lat straight into ``out`` [B, H, 512]; several: returns the partials (po, plse). ``knobs`` go to
    hopper_narrow's kernel (bench/mla_probe.py's timeline and A/B switches)."""
    B, H, L = q_lat.shape
    direct = num_splits == 1
    if direct:
        po = plse = out
    else:
        po = torch.empty((B * H * num_splits * L,), device=q_lat.device, dtype=torch.float32)
        plse = torch.empty((B * H * num_splits,), device=q_lat.device, dtype=torch.float32)
    if page == 0:  # the block-table and length pointers go unread
        block_table = seq_lens = torch.empty((1,), device=q_lat.device, dtype=torch.int32)
    args = (q_lat, q_rope, lat, rope, block_table, seq_lens, po, plse, out,
            q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), lat.stride(0), lat.stride(1),
            rope.stride(0), rope.stride(1), block_table.stride(0), block_table.shape[-1], out.stride(0), out.stride(1),
            H, num_splits, lat.shape[1], scale * 1.4426950408889634)
    if knobs and H > NARROW_MAX_HEADS:
        raise ValueError(f"launch knobs {sorted(knobs)} are hopper_narrow's (up to {NARROW_MAX_HEADS} heads), not {H}")
    if H <= NARROW_MAX_HEADS:
        from .hopper_narrow import _mla_decode_narrow_kernel
        _mla_decode_narrow_kernel[(B, num_splits)](*args, PAGE=page, LAT=LAT, ROPE=ROPE, DIRECT=direct,
                                                   HN=16 if H <= 16 else 32, BN=BN, num_warps=4, **pdl_opts(q_lat),
                                                   **knobs)
    else:
        _mla_decode_wg_kernel[(H // BH, B, num_splits)](*args, PAGE=page, LAT=LAT, ROPE=ROPE, DIRECT=direct, BH=BH,
                                                        BN=BN, num_warps=4, **pdl_opts(q_lat))
    return None if direct else (po, plse)


def _decode(q_lat, q_rope, lat, rope, page, block_table, seq_lens, scale, num_splits, w_uv):
    from . import kernels
    B, H, L = q_lat.shape
    out = q_lat.new_empty((B, H, L if w_uv is None else w_uv.shape[1]))
    if B == 0:
        return out
    if w_uv is not None:
        num_splits = max(num_splits, 2)  # W_UV is applied by the merge kernel
    parts = _launch(q_lat, q_rope, lat, rope, page, block_table, seq_lens, scale, num_splits, out)
    if parts is not None:
        kernels.merge(*parts, out, H=H, L=L, num_splits=num_splits, n_scr_tokens=B, t_out=1, w_uv=w_uv)
    return out


@torch.library.custom_op(op_name("mla_decode_wg"), mutates_args=())
def mla_decode_wg(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                  num_splits: int, w_uv: Optional[Tensor] = None) -> Tensor:
    """kernels.mla_decode_triton's contract, on the Gluon kernel (``supported`` must hold): q_lat [B, H, 512],
    q_rope [B, H, 64], cache [NB, page, 576], block_table [B, MB] int32, seq_lens [B] int32 -> o_lat [B, H, 512],
    or with w_uv [H, V, 512] o_lat @ W_UV^T [B, H, V]. An opaque op: Inductor cannot inline a Gluon kernel (it
    re-emits traced kernels as Triton source), so a compiled graph calls this as it stands."""
    return _decode(q_lat, q_rope, cache, cache[..., LAT:], cache.shape[1], block_table, seq_lens, scale, num_splits,
                   w_uv)


@mla_decode_wg.register_fake
def _(q_lat, q_rope, cache, block_table, seq_lens, scale, num_splits, w_uv=None):
    B, H, L = q_lat.shape
    return q_lat.new_empty((B, H, L if w_uv is None else w_uv.shape[1]))


@torch.library.custom_op(op_name("mla_decode_wg_dense"), mutates_args=())
def mla_decode_wg_dense(q_lat: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, scale: float,
                        num_splits: int) -> Tensor:
    """One-token decode over HF's dense latent cache on the Gluon kernel (``supported_dense`` must hold): q_lat
    [B, H, 512], q_rope [B, H, 64], latent [B, S, 512], k_rope [B, S, 64] -> o_lat [B, H, 512]; every key attended
    (kernels.mla_attention_dense_triton takes it only without a mask)."""
    return _decode(q_lat, q_rope, latent, k_rope, 0, None, None, scale, num_splits, None)


@mla_decode_wg_dense.register_fake
def _(q_lat, q_rope, latent, k_rope, scale, num_splits):
    return q_lat.new_empty(q_lat.shape)
