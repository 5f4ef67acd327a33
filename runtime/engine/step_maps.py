"""A step's cache maps, built on the device from its block table and left padding.

``step_maps`` is the plain torch version (the CPU path and the oracle); ``device_step_maps`` computes the same
tensors in one Triton launch on the GPU, where Inductor compiles the torch version into four kernels (unbacked
sizes, int64 index math), all recorded in every decode graph; the one kernel writes every map from one read of the
table row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_kernels.library import pdl_opts, pdl_start

from . import attention


def step_maps(table: torch.Tensor, pads: torch.Tensor, width: int, q_len: int, bs: int, kv_heads: int):
    """The cache maps of a step from its block table [B, width / bs] and left padding [B]: (gather_idx [B, width]
    flat cache rows of every key (0 for padding), write slots [B * q_len] (a row's own tokens are its last q_len
    keys), key validity [B, width], keys per row int32 [B], the table as int32, and, when ``kv_heads`` > 0, the
    paged MHA decode maps of attention.decode_maps)."""
    arange = torch.arange(width, device=table.device)[None, :]
    pos = arange - pads[:, None]  # [B, width]; < 0 is padding
    keep = pos >= 0
    pos = pos.clamp(min=0)
    gather_idx = torch.where(keep, table.gather(1, pos // bs) * bs + pos % bs, 0)
    # a copy, not a view: a view's storage offset (width - q_len at one row) is something dynamo specialises on
    writes = gather_idx[:, width - q_len:].reshape(-1).clone()
    lengths = width - pads
    mha_maps = None
    if kv_heads:  # valid keys first
        key = arange.expand(table.shape[0], width)
        slots = torch.where(key < lengths[:, None], table.gather(1, key // bs) * bs + key % bs, 0)
        mha_maps = attention.decode_maps(slots, lengths, kv_heads)
    return gather_idx, writes, keep, lengths.to(torch.int32), table.to(torch.int32), mha_maps


@triton.jit
def _step_maps_kernel(table_ptr, pads_ptr, gather_ptr, writes_ptr, keep_ptr, lengths_ptr, table32_ptr, mha_table_ptr,
                      mha_lens_ptr, width, nb, q_len, bs, KV_HEADS: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program (row b, BLOCK keys): keys k of the block (left-padded: key k holds position k - pad), their write
    slots, the row's table as int32 and its length; KV_HEADS > 0: the paged MHA rows (valid keys first)."""
    pdl_start(PDL)
    b = tl.program_id(0)
    first = tl.program_id(1) == 0
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = k < width
    row = table_ptr + b.to(tl.int64) * nb
    out = b.to(tl.int64) * width + k
    pad = tl.load(pads_ptr + b)
    length = width - pad
    pos = k - pad
    keep = pos >= 0
    pos = tl.maximum(pos, 0)
    slot = tl.where(keep, tl.load(row + pos // bs, mask=ok, other=0) * bs + pos % bs, 0)
    tl.store(gather_ptr + out, slot, mask=ok)
    tl.store(keep_ptr + out, keep, mask=ok)
    j = k - (width - q_len)
    tl.store(writes_ptr + b.to(tl.int64) * q_len + j, slot, mask=ok & (j >= 0))
    tl.store(table32_ptr + b.to(tl.int64) * nb + k, tl.load(row + k, mask=k < nb, other=0).to(tl.int32),
             mask=k < nb)
    tl.store(lengths_ptr + b, length.to(tl.int32), mask=first)
    if KV_HEADS > 0:
        mha = tl.where(k < length, tl.load(row + k // bs, mask=ok, other=0) * bs + k % bs, 0) * KV_HEADS
        for h in tl.static_range(KV_HEADS):
            r = b.to(tl.int64) * KV_HEADS + h
            tl.store(mha_table_ptr + r * width + k, (mha + h).to(tl.int32), mask=ok)
            tl.store(mha_lens_ptr + r, length.to(tl.int32), mask=first)


def triton_step_maps(table: torch.Tensor, pads: torch.Tensor, width: int, q_len: int, bs: int, kv_heads: int):
    """``step_maps`` in one launch (same tensors, same dtypes)."""
    table, pads = table.contiguous(), pads.contiguous()
    B, nb = table.shape
    dev = table.device
    gather_idx = torch.empty(B, width, dtype=table.dtype, device=dev)
    writes = torch.empty(B * q_len, dtype=table.dtype, device=dev)
    keep = torch.empty(B, width, dtype=torch.bool, device=dev)
    lengths = torch.empty(B, dtype=torch.int32, device=dev)
    table32 = torch.empty(B, nb, dtype=torch.int32, device=dev)
    mha = (torch.empty(B * kv_heads, width, dtype=torch.int32, device=dev),
           torch.empty(B * kv_heads, dtype=torch.int32, device=dev)) if kv_heads else None
    block = min(1024, triton.next_power_of_2(max(width, 16)))
    if B:
        _step_maps_kernel[(B, triton.cdiv(width, block))](
            table, pads, gather_idx, writes, keep, lengths, table32, *(mha or (lengths, lengths)), width, nb, q_len, bs,
            KV_HEADS=kv_heads, BLOCK=block, num_warps=4, **pdl_opts(table))
    return gather_idx, writes, keep, lengths, table32, mha


def device_step_maps():
    """The runner's maps on the GPU: ``triton_step_maps``; should its kernel fail on some stack, the torch version
    runs from then on (slower, same values) and a warning says why."""
    eager = []

    def run(*args):
        if not eager:
            try:
                return triton_step_maps(*args)
            except Exception as e:  # noqa: BLE001  (a compiler failure must not stop generation)
                import warnings
                warnings.warn(f"hybrid engine: the step's cache-map kernel failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}); the maps run as torch ops",
                              stacklevel=2)
                eager.append(True)
        return step_maps(*args)
    return run
