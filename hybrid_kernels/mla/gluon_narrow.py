"""MLA decode at up to 32 heads on Hopper: a Gluon kernel with the keys as the wgmma M dimension (sm_90, bf16 / fp16).

At 16 heads decode is memory-bound (about 30 flops per cache byte); what counts is keeping enough key bytes in flight.
A wgmma's M is 64, more than the heads, so the products are computed transposed ("swap AB"):

  S^T [64 keys, HN] = K [64 keys, 576] . q^T           (A: the key tile in shared memory, B: q in shared memory)
  O^T [512, HN]    += K_lat^T [512, 64 keys] . P^T     (A: the same tile read column-major, B: P^T in shared memory)

HN = 16 or 32 (heads padded with zero queries; their rows are never stored). One warpgroup per program, one
program per (sequence, split), every head of the sequence in it, so each key byte is read once. Key tiles of 64
keys (72 KB: latent + rope columns) come by cp.async into a ring of two; the next tile's copies are issued before
the current tile is waited for, so one tile is always in flight while the dots and the softmax run (a tile's
share of 4.3 TB/s over 132 SMs is ~2.3 us). The softmax runs down the key axis: row maxima and sums are per head
(per column of S^T). Shared memory: 2 x 72 KB + q (HN x 576) + P^T. Outputs and split-KV partials are in the layout
of triton_attention.py's decode mode, merged by its merge kernels.
"""
from __future__ import annotations

from .gluon_common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    from .gluon_common import _copy_keys, _cp_async, _cta_barrier, _key_blocks, _load_keys, _pdl_start, _sequence

    @gluon.jit
    def _split_tiles(seq_len, pid_split, NUM_SPLITS, BN: gl.constexpr):
        """Split pid_split's share of a sequence's BN-key tiles: (n, k_rest). The first NUM_SPLITS tiles are dealt one
        per split, so where a split's first tile sits (key pid_split BN) is known before the length is and its block
        ids load alongside the length, not after it; the other tiles go in runs, one per split, from key k_rest on
        (_tile_start). The splits' counts differ by at most one. (Tile order: bench/README.md, TUNING.)"""
        rest = gl.maximum(gl.cdiv(seq_len, BN) - NUM_SPLITS, 0)      # tiles after the first round
        per = gl.cdiv(rest, NUM_SPLITS)
        n_rest = gl.maximum(gl.minimum(per, rest - pid_split * per), 0)
        return gl.where(pid_split * BN < seq_len, 1 + n_rest, 0), (NUM_SPLITS + pid_split * per) * BN

    @gluon.jit
    def _tile_start(j, pid_split, k_rest, BN: gl.constexpr):
        """The first key of a split's j-th tile (_split_tiles' order)."""
        return gl.where(j == 0, pid_split * BN, k_rest + (j - 1) * BN)

    @gluon.jit
    def _mla_decode_narrow_kernel(QL, QR, LATP, ROPEP, BT, SEQ, PO, PLSE, O,
                                  s_qlb, s_qlh, s_qrb, s_qrh, s_lb, s_ls, s_rb, s_rs, s_bt, N_BT, s_ob, s_oh,
                                  H, NUM_SPLITS, S_DENSE, sm_scale_log2,
                                  PAGE: gl.constexpr, LAT: gl.constexpr, ROPE: gl.constexpr, DIRECT: gl.constexpr,
                                  HN: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr,
                                  PDL: gl.constexpr = False):
        """Program (sequence, split). Keys from pages (PAGE > 0: block table BT of N_BT columns, lengths SEQ) or
        from HF's dense latent / rope tensors (PAGE == 0: every sequence S_DENSE keys long)."""
        _pdl_start(PDL)
        b = gl.program_id(0)
        pid_split = gl.program_id(1)
        b64 = b.to(gl.int64)
        dtype: gl.constexpr = LATP.dtype.element_ty
        t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HN, 16])  # S^T and O^T
        heads_l: gl.constexpr = gl.SliceLayout(0, t_layout)  # per-head values (maxima, sums)
        smem_lat: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, LAT], dtype)
        smem_rope: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, ROPE], dtype)
        smem_q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HN, LAT], dtype)
        smem_qr: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HN, ROPE], dtype)
        smem_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HN], dtype)

        kb, k_hi = _sequence(SEQ, S_DENSE, b64, s_bt, PAGE)
        n_tiles, k_rest = _split_tiles(k_hi, pid_split, NUM_SPLITS, BN)
        bt_keys = N_BT * PAGE

        q_lat_s = gl.allocate_shared_memory(dtype, [HN, LAT], smem_q)
        q_rope_s = gl.allocate_shared_memory(dtype, [HN, ROPE], smem_qr)
        lat_s = gl.allocate_shared_memory(dtype, [2, BN, LAT], smem_lat)
        rope_s = gl.allocate_shared_memory(dtype, [2, BN, ROPE], smem_rope)
        p_s = gl.allocate_shared_memory(dtype, [BN, HN], smem_p)

        # queries (heads >= H read as zeros) in one commit group, then key tile 0 in the next
        chunk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        h_idx = gl.arange(0, HN, layout=gl.SliceLayout(1, chunk))
        heads = gl.expand_dims(h_idx.to(gl.int64), 1)
        h_ok = gl.expand_dims(h_idx < H, 1)
        cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, chunk)), 0)
        for c in gl.static_range(LAT // 64):
            _cp_async(q_lat_s.slice(c * 64, 64, dim=1), QL + b64 * s_qlb + heads * s_qlh + (cols + c * 64), mask=h_ok)
        _cp_async(q_rope_s, QR + b64 * s_qrb + heads * s_qrh + cols, mask=h_ok)
        async_copy.commit_group()
        _load_keys(LATP, ROPEP, BT, kb, pid_split * BN, k_hi, bt_keys, s_lb, s_ls, s_rb, s_rs, lat_s.index(0),
                   rope_s.index(0), 0, LAT // 64, True, PAGE, LAT, BN)
        blk_next = _key_blocks(BT, kb, k_rest, bt_keys, PAGE, BN)   # block ids one tile ahead of their copies
        m_i = gl.full([HN], -1.0e30, gl.float32, layout=heads_l)
        l_i = gl.zeros([HN], gl.float32, layout=heads_l)
        acc = gl.zeros([LAT, HN], gl.float32, layout=t_layout)
        for j in range(n_tiles):
            start = _tile_start(j, pid_split, k_rest, BN)
            lat = lat_s.index(j % 2)
            rope = rope_s.index(j % 2)
            # the next tile into the other buffer (free: its P . V was waited for; after the split's last tile,
            # nothing), the block ids of the one after (their load latency hides behind this tile's dots), then wait
            # for this tile. (k_rest + j BN is _tile_start(j + 1), written out: j + 1 > 0.)
            _copy_keys(LATP, ROPEP, blk_next, k_rest + j * BN, gl.where(j + 1 < n_tiles, k_hi, 0), s_lb, s_ls, s_rb,
                       s_rs, lat_s.index((j + 1) % 2), rope_s.index((j + 1) % 2), 0, LAT // 64, True, PAGE, LAT, BN)
            blk_next = _key_blocks(BT, kb, k_rest + (j + 1) * BN, bt_keys, PAGE, BN)
            async_copy.wait_group(1)
            fence_async_shared()
            _cta_barrier()
            s = gl.zeros([BN, HN], gl.float32, layout=t_layout)
            for c in gl.static_range(LAT // 64):
                s = warpgroup_mma(lat.slice(c * 64, 64, dim=1), q_lat_s.slice(c * 64, 64, dim=1).permute((1, 0)), s,
                                  use_acc=c > 0, is_async=True)
            s = warpgroup_mma(rope, q_rope_s.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            keys = start + gl.arange(0, BN, layout=gl.SliceLayout(1, t_layout))
            s = gl.where(gl.expand_dims(keys < k_hi, 1), s * sm_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 0))
            l_i = l_i * alpha + gl.sum(p, 0)
            p_s.store(p.to(dtype))
            fence_async_shared()
            _cta_barrier()
            acc = warpgroup_mma(lat.permute((1, 0)), p_s, acc * gl.expand_dims(alpha, 0), is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _cta_barrier()  # every warp is past this tile's P . V before its buffer is refilled
            m_i = m_new
        async_copy.wait_group(0)  # the (masked, empty) copies issued for the tile after the last

        l_use = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / gl.expand_dims(l_use, 0)                                   # [LAT, HN]
        h_out = gl.arange(0, HN, layout=heads_l)
        d_out = gl.expand_dims(gl.arange(0, LAT, layout=gl.SliceLayout(1, t_layout)), 1)
        ok = gl.expand_dims(h_out < H, 0) & (d_out < LAT)
        if DIRECT:
            gl.store(O + b64 * s_ob + gl.expand_dims(h_out.to(gl.int64) * s_oh, 0) + d_out, out.to(O.dtype.element_ty),
                     mask=ok)
        else:
            rows = (b64 * H + h_out) * NUM_SPLITS + pid_split
            gl.store(PLSE + rows, gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_use)), mask=h_out < H)
            gl.store(PO + gl.expand_dims(rows * LAT, 0) + d_out, out, mask=ok & gl.expand_dims(l_i > 0.0, 0))
