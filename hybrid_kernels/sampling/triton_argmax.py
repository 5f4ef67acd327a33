"""Row-wise argmax over the vocabulary in two short kernels, for greedy decoding.

torch's argmax reduces one row in one thread block (slow for a 100K-token vocabulary), and a max-per-chunk +
argmax-of-chunks in torch costs four kernels. Here: ``_argmax_chunks_kernel``
gives each of B x NCH programs one chunk (about one block) of a row (its max and the first index holding it), then
``_argmax_rows_kernel`` picks, per row, the first chunk holding the row's max. Result: torch.argmax's
(first maximal index; NaN logits are not expected from a model and are not special-cased). No host sync,
sizes from shapes only: CUDA-graph safe. Reference: ``reference.argmax_ref`` (tests/kernels/test_sampling.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_kernels.library import pdl_opts, pdl_start

#: BLOCK logits per load; chunks of one block per program (a loop over a longer chunk runs its loads one after
#: another), at most MAX_CHUNKS per row
MAX_CHUNKS, BLOCK = 128, 1024


@triton.jit
def _argmax_chunks_kernel(x_ptr, val_ptr, idx_ptr, V, stride_b, CHUNK, NCH, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    best_i = lo
    for start in range(lo, hi, BLOCK):
        cols = start + offs
        v = tl.load(x_ptr + b * stride_b + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
        m = tl.max(v, 0)
        i = tl.min(tl.where(v == m, cols, V), 0)  # first column holding the block's max
        take = m > best                            # strictly: an earlier block keeps a tie
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(val_ptr + b * NCH + c, best)
    tl.store(idx_ptr + b * NCH + c, best_i)


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, ids_ptr, pos_ptr, pad_ptr, step_ptr, NCH, NCH_P: tl.constexpr,
                        ADVANCE: tl.constexpr, HAS_PADS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NCH_P)
    ok = offs < NCH
    v = tl.load(val_ptr + b * NCH + offs, mask=ok, other=float("-inf"))
    m = tl.max(v, 0)
    first = tl.min(tl.where(ok & (v == m), offs, NCH_P), 0)  # first chunk holding the max
    i = tl.load(idx_ptr + b * NCH + first).to(tl.int64)
    tl.store(out_ptr + b, i)
    if ADVANCE:  # the next decode step's inputs (see argmax_triton)
        step = tl.load(step_ptr + b)
        tl.store(ids_ptr + b, i)
        tl.store(pos_ptr + b, tl.load(pos_ptr + b) + step)
        if HAS_PADS:
            tl.store(pad_ptr + b, tl.load(pad_ptr + b) - step)


def argmax_triton(logits: torch.Tensor, advance: tuple | None = None) -> torch.Tensor:
    """logits [B, V] (fp16 / bf16 / fp32: compared in fp32; the last dim contiguous) -> int64 [B]:
    torch.argmax(logits, -1).

    ``advance`` = (ids, positions, pads or None, step), int64 [B] each: also moves a decode step's inputs to the
    next step in the same kernel: ids <- the argmax, positions += step, pads -= step (step: 1 on real rows, 0 on
    padding rows)."""
    assert logits.dim() == 2 and logits.stride(-1) == 1, f"logits must be [B, V] rows, got {tuple(logits.shape)}"
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    nch = max(1, min(MAX_CHUNKS, triton.cdiv(V, BLOCK)))
    chunk = triton.cdiv(triton.cdiv(V, nch), BLOCK) * BLOCK
    nch = triton.cdiv(V, chunk)
    vals = torch.empty(B, nch, dtype=torch.float32, device=logits.device)
    idx = torch.empty(B, nch, dtype=torch.int32, device=logits.device)
    _argmax_chunks_kernel[(B, nch)](logits, vals, idx, V, logits.stride(0), chunk, nch, BLOCK=BLOCK, num_warps=4,
                                    **pdl_opts(logits))
    ids, pos, pads, step = advance if advance is not None else (out, out, None, out)
    if advance is not None:
        assert all(t.dtype == torch.int64 and t.shape == (B,) and t.is_contiguous() for t in (ids, pos, step)) and (
            pads is None or (pads.dtype == torch.int64 and pads.shape == (B,))), "advance tensors must be int64 [B]"
    _argmax_rows_kernel[(B,)](vals, idx, out, ids, pos, pads if pads is not None else out, step, nch,
                              NCH_P=max(2, triton.next_power_of_2(nch)), ADVANCE=advance is not None,
                              HAS_PADS=pads is not None, num_warps=1, **pdl_opts(logits))
    return out
