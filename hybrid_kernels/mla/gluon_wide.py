"""MLA decode on Hopper in Gluon (sm_90, bf16 / fp16) at 64+ heads: two warp-specialised warpgroups. Up to 32 heads
take gluon_narrow.py's kernel; gluon.py launches either.

At 64+ heads decode is tensor-core-bound (each latent byte feeds 2 x 1088 flops per head). The Triton kernel
(triton_attention.py) cannot give its two warpgroups different work: Triton lays out a dot whose result feeds another dot with
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
One split writes o_lat; several write the split-KV partials (o, lse) that triton_attention.py's merge kernels read, in the
layout of ``_mla_attn_kernel``'s decode mode.
"""
from __future__ import annotations

from .gluon_common import BN, HAVE_GLUON, LAT

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .gluon_common import _cp_async, _cta_barrier, _load_keys, _pdl_start, _sequence

    # one warpgroup's layouts: scores [64 heads, 64 keys] and its half of the output [64, 256], wgmma accumulators
    _S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]))
    _O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, LAT // 2, 16]))
    _P_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O_LAYOUT.value, k_width=2))  # P . V's A
    _ROWS = gl.constexpr(gl.SliceLayout(1, _S_LAYOUT.value))  # per-row values (maxima, sums)
    # the mbarriers: row maxima and P handed over, key columns freed, row sums handed over (one completion per pair)
    _M0, _M1, _P0, _P1, _K0_FREE, _K1_FREE, _L0 = (gl.constexpr(i) for i in range(7))

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
        # need not wait for the length (tile order: bench/TUNING.md)
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
