"""Gated RMSNorm (HF MambaRMSNormGated): y = weight * to_x_dtype(rmsnorm_per_group(x * silu(z))).

One program normalises BLOCK_R group-rows of ``group_size`` elements (one pass: the row stays in
registers). Traffic: x, z read and y written once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from hybrid_kernels.library import pdl_opts, pdl_start
from .triton_config import CONFIG, next_pow2


@triton.jit(do_not_specialize=["R"])
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr,
    R, NG, GS, eps,
    sxm, szm, sym,
    HAS_Z: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # group-row index = row * NG + group
    j = tl.arange(0, BLOCK_G)
    mr = r < R
    mj = j < GS
    m = mr[:, None] & mj[None, :]
    row = (r // NG).to(tl.int64)
    col = (r % NG) * GS
    cols = col[:, None] + j[None, :]
    h = tl.load(x_ptr + row[:, None] * sxm + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        zz = tl.load(z_ptr + row[:, None] * szm + cols, mask=m, other=0.0).to(tl.float32)
        h = h * (zz / (1.0 + tl.exp(-zz)))
    var = tl.sum(h * h, axis=1) / GS
    h = h * tl.rsqrt(var + tl.cast(eps, tl.float32))[:, None]
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)  # HF casts back to the input dtype before the weight
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row[:, None] * sym + cols, (w * h).to(y_ptr.dtype.element_ty), mask=m)


def gated_rms_norm_triton(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor | None,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    group_size: int,
) -> torch.Tensor:
    dim = x.shape[-1]
    assert dim % group_size == 0, f"hidden size {dim} is not a multiple of group_size {group_size}"
    assert weight.shape == (dim,), f"weight {tuple(weight.shape)} != ({dim},)"
    weight = weight.contiguous()
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    z2 = x2
    if z is not None:
        assert z.shape == x.shape, f"z {tuple(z.shape)} != x {tuple(x.shape)}"
        z2 = z.reshape(-1, dim)
        if z2.stride(-1) != 1:
            z2 = z2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, dim, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    ngroups = dim // group_size
    cfg = CONFIG["norm"]
    bg = next_pow2(group_size)
    br = max(1, cfg["ELEMS"] // bg)
    nw = cfg["num_warps"] if bg <= cfg["ELEMS"] else cfg["big_num_warps"]
    total = rows * ngroups
    wrap_triton(_gated_rms_norm_kernel)[(triton.cdiv(total, br),)](
        x2, z2, weight, out, total, ngroups, group_size, float(eps),
        x2.stride(0), z2.stride(0), out.stride(0),
        HAS_Z=z is not None, BLOCK_R=br, BLOCK_G=bg, num_warps=nw, **pdl_opts(x2),
    )
    return out.reshape(x.shape)
