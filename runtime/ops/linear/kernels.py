"""Skinny GEMMs for decode: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for M <= 16 rows.

At decode a linear layer multiplies one row per sequence by the weight: the time is the weight's bytes over the
memory bandwidth, and cuBLAS's small-M kernels leave much of it on the table for the mid-sized projections of
these models (2-54 MB; see bench/linear.py). Each program here owns BLOCK_N output columns for every row and
streams its [BLOCK_N, K] slab of the weight once, BLOCK_K at a time, in as many pipeline stages as fit:

- ``_gemv_kernel`` (M == 1): products and a row sum on the CUDA cores, fp32.
- ``_skinny_dot_kernel`` (M <= 16): the rows padded to a 16-row tensor-core tile, fp32 accumulation.

Small BLOCK_N keeps enough programs in flight for every SM (no split-K, so one kernel and no second pass).
Launch configs per (M, N, K) come from ``pick_config`` (measured on the H200). Reference:
``torch.nn.functional.linear`` (tests/ops/test_linear.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..library import interpreting

#: the most rows the skinny kernels take; bigger batches go to cuBLAS
MAX_ROWS = 16


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + rk
        if EVEN_K:
            x = tl.load(x_ptr + cols).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _skinny_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    rm = tl.arange(0, 16)
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + rk
        if EVEN_K:
            x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (cols < K)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        if F32_DOT:  # the interpreter (bf16 is unreliable there): exact fp32 products
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def pick_config(M: int, N: int, K: int) -> dict:
    """Launch config for y[M, N] = x[M, K] w^T: kernel, BLOCK_N, BLOCK_K, warps, stages (see bench/linear.py)."""
    kind = "gemv" if M == 1 else "dot"
    block_n = 16 if kind == "dot" else 8
    while block_n > (16 if kind == "dot" else 2) and triton.cdiv(N, block_n) < 264:
        block_n //= 2
    return dict(kind=kind, block_n=block_n, block_k=256 if kind == "gemv" else 128, warps=4, stages=4)


def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                         config: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16), w [N, K] (rows contiguous), bias [N] or None -> [M, N] in x.dtype."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= MAX_ROWS, f"skinny_linear_triton takes at most {MAX_ROWS} rows, got {M}"
    assert w.shape[1] == K and w.stride(1) == 1 and x.stride(1) == 1, "x and w must have contiguous rows of K"
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = config or pick_config(M, N, K)
    gemv = cfg["kind"] == "gemv" and M == 1
    block_n = cfg["block_n"] if gemv else max(16, cfg["block_n"])
    b = bias if bias is not None else w  # a valid pointer, never read
    grid = (triton.cdiv(N, block_n),)
    even_k = K % cfg["block_k"] == 0
    opts = dict(num_warps=cfg["warps"], num_stages=cfg["stages"])
    if gemv:
        _gemv_kernel[grid](x, w, b, y, N, K, w.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
                           BLOCK_K=cfg["block_k"], EVEN_K=even_k, **opts)
    else:
        _skinny_dot_kernel[grid](x, w, b, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                 HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=cfg["block_k"],
                                 EVEN_K=even_k, F32_DOT=interpreting(), **opts)
    return y
