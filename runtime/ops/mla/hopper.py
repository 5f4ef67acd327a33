"""MLA decode at many heads on Hopper: a Gluon kernel with explicit warpgroup roles (sm_90, bf16 / fp16).

At 64+ heads decode is tensor-core-bound (each latent byte feeds 2 x 1088 flops per head). The Triton kernel
(kernels.py) cannot place its two chained dots well there: Triton gives a dot whose result feeds another dot
warps [num_warps, 1], so with 64 heads per tile and 8 warps both warpgroups compute the same 64 x 64 scores
(docs/limitations.md). Here the layouts are ours. One program = (sequence, 64 heads, split); 8 warps, two
warpgroups; per 64-key tile:

  scores   S [64 heads, 64 keys] = q_lat . latent^T + q_rope . rope^T: warps [4, 2], each warpgroup computes the
           scores of 32 keys (wgmma, operands in shared memory);
  softmax  online in the log2 domain; the row max crosses the two warpgroups (a shared-memory reduction), the row
           sums are kept per key column and reduced once after the last tile;
  output   P goes to shared memory as bf16; O [64, 512] += P . latent with warps [4, 2]: each warpgroup owns 256
           value columns (a 64 x 256 fp32 accumulator, 128 registers per thread).

Key tiles are gathered from the paged cache with cp.async (any page size; rows past the split are zero-filled
and masked), two stages: tile i + 1 loads while tile i computes; block ids are read one tile further ahead.
Shared memory: q 72 KB + 2 x 72 KB of keys + 8 KB of P = 224 KB. One split writes o_lat; several write the
split-KV partials (o, lse) that kernels.py's merge kernels read, in the layout of ``_mla_attn_kernel``'s decode
mode. Measured: bench/results/2026-11-30_mla_decode_warpgroup_h200.md.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from ..library import op_name

try:  # Gluon (Triton >= 3.5); the module stays importable where it is missing (CPU-only installs)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    # cp.async of a pointer tensor into shared memory: ``async_load`` from Triton 3.7 on (the old name raises there)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed barrier() in Triton 3.7
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

BH, BN, NUM_WARPS = 64, 64, 8  # heads per program, keys per tile, warps (two warpgroups)
LAT, ROPE = 512, 64            # the only latent / rope widths the kernel is built for (DeepSeek V2 / V3)
ENABLED = os.environ.get("HYBRID_MLA_WG", "1") != "0"  # 0: 64+ heads take the Triton kernel (A/B in bench/mla.py)


def supported(q_lat: Tensor, q_rope: Tensor, cache: Tensor) -> bool:
    """Whether the Gluon kernel serves this decode: a Hopper GPU, heads in multiples of 64, L = 512, R = 64,
    bf16 / fp16 queries and cache, rows contiguous in their last dim."""
    if not (ENABLED and HAVE_GLUON and q_lat.is_cuda and torch.cuda.get_device_capability(q_lat.device)[0] == 9):
        return False
    H, L = q_lat.shape[1], q_lat.shape[2]
    return (H % BH == 0 and L == LAT and cache.shape[-1] == LAT + ROPE and q_lat.dtype == cache.dtype
            and cache.dtype in (torch.bfloat16, torch.float16) and cache.stride(-1) == 1
            and q_lat.stride(-1) == 1 and q_rope.stride(-1) == 1 and q_rope.shape[-1] == ROPE)


if HAVE_GLUON:
    @gluon.jit
    def _load_tile(CACHE, blk, offs_n, k_hi, s_cb, s_cs, lat_dst, rope_dst, PAGE: gl.constexpr,
                   LAT: gl.constexpr, ROPE: gl.constexpr, lat_rows: gl.constexpr, rope_rows: gl.constexpr):
        """cp.async one key tile (rows offs_n, their pages' block ids blk) into shared memory; keys >= k_hi
        read as zeros."""
        n_l = gl.convert_layout(offs_n, gl.SliceLayout(1, lat_rows))
        b_l = gl.convert_layout(blk, gl.SliceLayout(1, lat_rows))
        row = b_l * s_cb + (n_l % PAGE).to(gl.int64) * s_cs
        cols = gl.arange(0, LAT, layout=gl.SliceLayout(0, lat_rows))
        ok = gl.expand_dims(n_l < k_hi, 1)
        _cp_async(lat_dst, CACHE + gl.expand_dims(row, 1) + gl.expand_dims(cols, 0), mask=ok)
        n_r = gl.convert_layout(offs_n, gl.SliceLayout(1, rope_rows))
        b_r = gl.convert_layout(blk, gl.SliceLayout(1, rope_rows))
        row_r = b_r * s_cb + (n_r % PAGE).to(gl.int64) * s_cs + LAT
        cols_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, rope_rows))
        ok_r = gl.expand_dims(n_r < k_hi, 1)
        _cp_async(rope_dst, CACHE + gl.expand_dims(row_r, 1) + gl.expand_dims(cols_r, 0), mask=ok_r)

    @gluon.jit
    def _block_ids(BT, bt_row, offs_n, k_hi, PAGE: gl.constexpr):
        return gl.load(BT + bt_row + offs_n // PAGE, mask=offs_n < k_hi, other=0).to(gl.int64)

    @gluon.jit
    def _mla_decode_wg_kernel(QL, QR, CACHE, BT, SEQ, PO, PLSE, O,
                              s_qlb, s_qlh, s_qrb, s_qrh, s_cb, s_cs, s_bt, s_ob, s_oh,
                              H, NUM_SPLITS, sm_scale_log2,
                              PAGE: gl.constexpr, LAT: gl.constexpr, ROPE: gl.constexpr, DIRECT: gl.constexpr,
                              BH: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
        b = gl.program_id(0)
        h0 = gl.program_id(1) * BH
        pid_split = gl.program_id(2)
        b64 = b.to(gl.int64)
        dtype: gl.constexpr = CACHE.dtype.element_ty

        # ---- layouts ----
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BN // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, LAT // 2, 16])
        lat_rows: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        rope_rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        key_ids: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        smem_lat: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, LAT], dtype)
        smem_rope: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, ROPE], dtype)
        smem_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BN], dtype)

        # ---- this split's keys ----
        seq_len = gl.load(SEQ + b)
        n_tiles_all = gl.cdiv(seq_len, BN)
        per_split = gl.cdiv(n_tiles_all, NUM_SPLITS)
        k_lo = pid_split * per_split * BN
        k_hi = gl.minimum((pid_split + 1) * per_split * BN, seq_len)
        n_tiles = gl.cdiv(gl.maximum(k_hi - k_lo, 0), BN)

        # ---- queries into shared memory ----
        heads = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, lat_rows))
        cols = gl.arange(0, LAT, layout=gl.SliceLayout(0, lat_rows))
        q_lat = gl.load(QL + b64 * s_qlb + gl.expand_dims(heads.to(gl.int64) * s_qlh, 1) + gl.expand_dims(cols, 0))
        q_lat_s = gl.allocate_shared_memory(dtype, [BH, LAT], smem_lat, q_lat.to(dtype))
        heads_r = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, rope_rows))
        cols_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, rope_rows))
        q_rope = gl.load(QR + b64 * s_qrb + gl.expand_dims(heads_r.to(gl.int64) * s_qrh, 1)
                         + gl.expand_dims(cols_r, 0))
        q_rope_s = gl.allocate_shared_memory(dtype, [BH, ROPE], smem_rope, q_rope.to(dtype))
        lat_s = gl.allocate_shared_memory(dtype, [2, BN, LAT], smem_lat)
        rope_s = gl.allocate_shared_memory(dtype, [2, BN, ROPE], smem_rope)
        p_s = gl.allocate_shared_memory(dtype, [BH, BN], smem_p)

        bt_row = b64 * s_bt
        keys = gl.arange(0, BN, layout=key_ids)
        blk = _block_ids(BT, bt_row, k_lo + keys, k_hi, PAGE)
        _load_tile(CACHE, blk, k_lo + keys, k_hi, s_cb, s_cs, lat_s.index(0), rope_s.index(0), PAGE, LAT, ROPE,
                   lat_rows, rope_rows)
        async_copy.commit_group()
        blk = _block_ids(BT, bt_row, k_lo + BN + keys, k_hi, PAGE)

        m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        # row sums kept per key column and summed once at the end: a sum per tile would cross the warpgroups
        # again (measured 2-5% slower)
        l_2d = gl.zeros([BH, BN], gl.float32, layout=s_layout)
        acc = gl.zeros([BH, LAT], gl.float32, layout=o_layout)
        s_keys = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        for i in range(n_tiles):
            stage = i % 2
            lat = lat_s.index(stage)
            async_copy.wait_group(0)
            _cta_barrier()      # every thread's copies of tile i landed; tile i - 1's dots are done
            fence_async_shared()
            if i + 1 < n_tiles:      # tile i + 1 loads while tile i computes
                start = k_lo + (i + 1) * BN
                _load_tile(CACHE, blk, start + keys, k_hi, s_cb, s_cs, lat_s.index(1 - stage),
                           rope_s.index(1 - stage), PAGE, LAT, ROPE, lat_rows, rope_rows)
                async_copy.commit_group()
                blk = _block_ids(BT, bt_row, start + BN + keys, k_hi, PAGE)
            s = gl.zeros([BH, BN], gl.float32, layout=s_layout)
            s = warpgroup_mma(q_lat_s, lat.permute((1, 0)), s, use_acc=False, is_async=True)
            s = warpgroup_mma(q_rope_s, rope_s.index(stage).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            ok = (k_lo + i * BN + s_keys) < k_hi
            s = gl.where(gl.expand_dims(ok, 0), s * sm_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))   # the one reduction across the two warpgroups
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_2d = l_2d * gl.expand_dims(alpha, 1) + p
            m_i = m_new
            p_s.store(p.to(dtype))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            _cta_barrier()      # both halves of P are in shared memory
            fence_async_shared()
            acc = warpgroup_mma(p_s, lat, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        l_i = gl.sum(l_2d, 1)

        # ---- output: one split writes o = acc / l in the query dtype; several write the partials (o, lse), with
        # lse = m + log2(l) (rows with no key write lse = -inf only) ----
        l_use = gl.where(l_i == 0.0, 1.0, l_i)
        l_o = gl.convert_layout(l_use, gl.SliceLayout(1, o_layout))
        out = acc / gl.expand_dims(l_o, 1)
        heads_o = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, o_layout))
        cols_o = gl.arange(0, LAT, layout=gl.SliceLayout(0, o_layout))
        if DIRECT:
            gl.store(O + b64 * s_ob + gl.expand_dims(heads_o.to(gl.int64) * s_oh, 1) + gl.expand_dims(cols_o, 0),
                     out.to(O.dtype.element_ty))
        else:
            lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_use))
            rows_s = (b64 * H + h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, s_layout))) * NUM_SPLITS + pid_split
            gl.store(PLSE + rows_s, lse)
            rows_o = (b64 * H + heads_o) * NUM_SPLITS + pid_split
            live = gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)) > 0.0, 1)
            gl.store(PO + gl.expand_dims(rows_o * LAT, 1) + gl.expand_dims(cols_o, 0), out,
                     mask=live & gl.expand_dims(cols_o < LAT, 0))


def _launch(q_lat, q_rope, cache, block_table, seq_lens, scale: float, num_splits: int, out):
    """One split: o_lat straight into ``out`` [B, H, 512]; several: returns the partials (po, plse)."""
    B, H, L = q_lat.shape
    direct = num_splits == 1
    if direct:
        po = plse = out
    else:
        po = torch.empty((B * H * num_splits * L,), device=q_lat.device, dtype=torch.float32)
        plse = torch.empty((B * H * num_splits,), device=q_lat.device, dtype=torch.float32)
    _mla_decode_wg_kernel[(B, H // BH, num_splits)](
        q_lat, q_rope, cache, block_table, seq_lens, po, plse, out,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0), cache.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1), H, num_splits, scale * 1.4426950408889634,
        PAGE=cache.shape[1], LAT=LAT, ROPE=ROPE, DIRECT=direct, BH=BH, BN=BN, num_warps=NUM_WARPS)
    return None if direct else (po, plse)


@torch.library.custom_op(op_name("mla_decode_wg"), mutates_args=())
def mla_decode_wg(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                  num_splits: int, w_uv: Optional[Tensor] = None) -> Tensor:
    """kernels.mla_decode_triton's contract, on the Gluon kernel (``supported`` must hold): q_lat [B, H, 512],
    q_rope [B, H, 64], cache [NB, page, 576], block_table [B, MB] int32, seq_lens [B] int32 -> o_lat [B, H, 512],
    or with w_uv [H, V, 512] o_lat @ W_UV^T [B, H, V]. An opaque op: Inductor cannot inline a Gluon kernel (it
    re-emits traced kernels as Triton source), so a compiled graph calls this as it stands."""
    from . import kernels
    B, H, L = q_lat.shape
    out = torch.empty((B, H, L), device=q_lat.device, dtype=q_lat.dtype)
    if B == 0:
        return out if w_uv is None else q_lat.new_empty((B, H, w_uv.shape[1]))
    if w_uv is not None:
        num_splits = max(num_splits, 2)  # W_UV is applied by the merge kernel
    parts = _launch(q_lat, q_rope, cache, block_table, seq_lens, scale, num_splits, out)
    if parts is None:
        return out
    if w_uv is not None:
        out = q_lat.new_empty((B, H, w_uv.shape[1]))
    kernels.merge(*parts, out, H=H, L=L, num_splits=num_splits, n_scr_tokens=B, t_out=1, w_uv=w_uv)
    return out


@mla_decode_wg.register_fake
def _(q_lat, q_rope, cache, block_table, seq_lens, scale, num_splits, w_uv=None):
    B, H, L = q_lat.shape
    return q_lat.new_empty((B, H, L if w_uv is None else w_uv.shape[1]))
