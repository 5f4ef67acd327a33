"""Triton device functions that kernels of more than one family call: SiLU and the two halves of one decode step of
a depthwise causal conv (Mamba's short conv), which the SSM conv update runs on its own and the one-row in
projection (``hybrid_kernels/linear``) runs as its epilogue."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def conv_step_load(st, ssw, ok, w, swk, w_ok, K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """The loads of one decode step of a depthwise causal conv over state rows of width W (``st``: pointers of any
    shape to the rows' first columns, taps at ``w`` + j * swk), to be issued early (before a kernel's main loop):
    -> (the rows shifted left by one column, in the state's dtype; the taps aligned to the row's columns, fp32),
    each with a last dim of WP = next_pow2(W). ``conv_step_store`` finishes the step."""
    col = tl.arange(0, WP)
    st_c = tl.expand_dims(st, -1) + (col + 1) * ssw
    shifted = tl.load(st_c, mask=tl.expand_dims(ok, -1) & (col + 1 < W), other=0.0)
    w_c = tl.expand_dims(w, -1) + (col - (W - K)) * swk
    taps = tl.load(w_c, mask=tl.expand_dims(w_ok, -1) & (col >= W - K) & (col < W), other=0.0)
    return shifted, taps.to(tl.float32)


@triton.jit
def conv_step_store(st, ssw, ok, shifted, taps, new, acc, W: tl.constexpr, WP: tl.constexpr):
    """The rest of the step ``conv_step_load`` began: append ``new`` (fp32; stored in the state's dtype) to the
    shifted rows, write them back in place and return acc + the conv over the rows' last K values. A CTA barrier
    comes first: the compiler may give the loads and the stores different thread layouts, so every thread must have
    read the old row before any thread overwrites it."""
    col = tl.arange(0, WP)
    rows = tl.where(col == W - 1, tl.expand_dims(new, -1).to(shifted.dtype), shifted)
    tl.debug_barrier()
    tl.store(tl.expand_dims(st, -1) + col * ssw, rows, mask=tl.expand_dims(ok, -1) & (col < W))
    return acc + tl.sum(rows.to(tl.float32) * taps, axis=-1)
