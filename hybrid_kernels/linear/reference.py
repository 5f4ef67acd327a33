"""Plain torch references of the linear family: ``F.linear`` itself for ``hybrid::linear`` / ``linear_group``, and
HF's RMSNorm (of x, or of the residual add x + r before it) for ``hybrid::norm_linear``.

t = the norm's input, h = w * (t * rsqrt(mean(t^2) + eps)).to(t.dtype). Here t = x, or s = x + r (in the add's result
dtype, also returned), in the output dtype when ``round_input`` (HF's ``hidden.to(weight.dtype)`` before the norm of a
model whose residual stream is fp32), else in fp32.
"""
from __future__ import annotations

import torch


def add_rms_norm_ref(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float, round_input: bool,
                     out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (h in out_dtype, s = x + r or None): the reference, in torch ops."""
    s = None if r is None else x + r
    t = x if s is None else s
    t = t.to(out_dtype) if round_input else t.float()  # the norm's input: the weights' dtype, or fp32
    tf = t.float()
    h = w * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)
    return h.to(out_dtype), s
