"""Skinny linear for decode steps: y [M, N] = x [M, K] @ W [N, K]^T (+ bias) with M <= 16.

At decode batch sizes a linear is a weight stream: every byte of W is read once and the arithmetic is
free. cuBLAS picks split-K kernels for some of these shapes (a partial pass plus a reduce kernel, e.g.
Mamba2's out_proj at 58% of HBM bandwidth on the H200). Here one program owns BLOCK_N output columns for
all M rows and streams its [BLOCK_N, K] slice of W through a deep software pipeline (num_stages tiles in
flight), so one kernel reads W at close to the copy bandwidth. fp32 accumulation; x is tiny and stays in
L2. Launch configs come from shapes (``config_for``); ``bench/linear.py`` sweeps them on the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 16

# tuned on the H200 (bench/linear.py --sweep)
CONFIGS = {
    "narrow": dict(block_n=16, block_k=256, num_warps=4, num_stages=4),  # N <= 4096
    "wide": dict(block_n=32, block_k=256, num_warps=4, num_stages=4),
}


def config_for(n: int, k: int) -> dict:
    return dict(CONFIGS["narrow" if n <= 4096 else "wide"])


@triton.jit
def _skinny_linear_kernel(X, W, B, Y, M, N, K, s_xm, s_wn, s_ym,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(X + rm[:, None] * s_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + rn[:, None] * s_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * s_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, last dim contiguous), weight [N, K] contiguous -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    cfg = {**config_for(n, k), **(config or {})}
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    grid = (triton.cdiv(n, cfg["block_n"]),)
    _skinny_linear_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0),
                                weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=MAX_M,
                                BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"],
                                num_stages=cfg["num_stages"])
    return y
