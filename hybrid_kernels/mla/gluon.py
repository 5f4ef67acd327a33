"""Launchers of the Gluon MLA decode kernels (Hopper, DeepSeek widths: L 512, R 64, bf16 / fp16): up to 32 heads
``gluon_narrow.py``'s kernel, multiples of 64 heads ``gluon_wide.py``'s. One split writes o_lat; several write
split-KV partials that triton_attention.py's merge kernels combine (and, given W_UV, absorb). ``ops.implementation``
says when these take a call; ``hybrid::mla_decode_wg`` / ``hybrid::mla_decode_wg_dense`` (ops.py) call them.
"""
from __future__ import annotations

import torch

from hybrid_kernels.library import pdl_opts

from . import gluon_narrow, gluon_wide, triton_attention
from .gluon_common import BN, HAVE_GLUON, LAT, NARROW_MAX_HEADS, ROPE, WIDE_HEADS  # noqa: F401  (HAVE_GLUON: re-exported)


def split_count(B: int, H: int, max_len) -> int:
    """The split-KV factor for these kernels: one program per (64 heads | every head, sequence, split), one program
    per SM (their shared memory), tiles of BN keys."""
    programs = B * (1 if H <= NARROW_MAX_HEADS else H // WIDE_HEADS)
    return triton_attention.choose_num_splits(programs, max_len, BN, per_sm=1)


def _launch(q_lat, q_rope, lat, rope, page: int, block_table, seq_lens, scale: float, num_splits: int, out):
    """Paged (page > 0: lat / rope are the cache and its rope columns, [NB, page, *]) or dense (page 0: [B, S, *]).
    One split: o_lat straight into ``out`` [B, H, 512]; several: returns the partials (po, plse)."""
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
    if H <= NARROW_MAX_HEADS:
        gluon_narrow._mla_decode_narrow_kernel[(B, num_splits)](*args, PAGE=page, LAT=LAT, ROPE=ROPE, DIRECT=direct,
                                                                HN=16 if H <= 16 else 32, BN=BN, num_warps=4,
                                                                **pdl_opts(q_lat))
    else:
        gluon_wide._mla_decode_wg_kernel[(H // WIDE_HEADS, B, num_splits)](
            *args, PAGE=page, LAT=LAT, ROPE=ROPE, DIRECT=direct, BH=WIDE_HEADS, BN=BN, num_warps=4, **pdl_opts(q_lat))
    return None if direct else (po, plse)


def decode(q_lat, q_rope, lat, rope, page: int, block_table, seq_lens, scale: float, num_splits: int, w_uv=None):
    """q_lat [B, H, 512], q_rope [B, H, 64] over paged (page > 0) or dense (page 0) keys -> o_lat [B, H, 512], or with
    w_uv [H, V, 512] o_lat @ W_UV^T [B, H, V] (from the merge kernel, so at least two splits)."""
    B, H, L = q_lat.shape
    out = q_lat.new_empty((B, H, L if w_uv is None else w_uv.shape[1]))
    if B == 0:
        return out
    if w_uv is not None:
        num_splits = max(num_splits, 2)
    parts = _launch(q_lat, q_rope, lat, rope, page, block_table, seq_lens, scale, num_splits, out)
    if parts is not None:
        triton_attention.merge(*parts, out, H=H, L=L, num_splits=num_splits, n_scr_tokens=B, t_out=1, w_uv=w_uv)
    return out
