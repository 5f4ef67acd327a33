"""RMSNorm of x, or of the residual add x + r before it, as one row-wise kernel: what ``hybrid::norm_linear`` runs
before cuBLAS where the one-row kernel (the norm as the gemv's prologue) does not take the call (more rows).
Reference: ``reference.add_rms_norm_ref``.

HF's RMSNorm (LlamaRMSNorm, MambaRMSNorm, DeepseekV2RMSNorm, ...): t = the norm's input, h = w * (t * rsqrt(mean(t^2)
+ eps)).to(t.dtype). Here t = x, or s = x + r (in the add's result dtype, also returned), in the output dtype when
``round_input`` (the norm reads the weights' dtype: HF's ``hidden.to(weight.dtype)`` before the norm of a model whose
residual stream is fp32), else in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, s_ptr, w_ptr, h_ptr, K, sx, sr, ss, sh, eps, HAS_RES: tl.constexpr,
                         ROUND: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    ok = cols < K
    t = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        t = (t + tl.load(r_ptr + row * sr + cols, mask=ok, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * ss + cols, t, mask=ok)
        t = t.to(tl.float32)
    if ROUND:
        t = t.to(h_ptr.dtype.element_ty).to(tl.float32)
    h = t * tl.rsqrt(tl.sum(t * t, axis=0) / K + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * sh + cols, (w * h).to(h_ptr.dtype.element_ty), mask=ok)


def add_rms_norm_triton(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float, round_input: bool,
                        out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, r [M, K] (rows contiguous), w [K] -> (h [M, K] in out_dtype, s = x + r or None). One program per row (the
    row in registers: K <= 8192)."""
    M, K = x.shape
    assert x.stride(1) == 1 and w.shape == (K,) and w.stride(0) == 1 and (r is None or (r.shape == x.shape
                                                                                         and r.stride(1) == 1))
    h = torch.empty(M, K, dtype=out_dtype, device=x.device)
    s = None if r is None else torch.empty(M, K, dtype=torch.promote_types(x.dtype, r.dtype), device=x.device)
    if M:
        bk = triton.next_power_of_2(K)
        _add_rms_norm_kernel[(M,)](x, x if r is None else r, h if s is None else s, w, h, K, x.stride(0),
                                   0 if r is None else r.stride(0), 0 if s is None else s.stride(0), h.stride(0),
                                   float(eps), HAS_RES=r is not None, ROUND=bool(round_input), BLOCK_K=bk,
                                   num_warps=4 if bk <= 2048 else 8)
    return h, s
