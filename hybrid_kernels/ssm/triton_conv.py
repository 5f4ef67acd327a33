"""Depthwise causal conv1d (Mamba / Mamba2 short conv): prefill with an initial state and the decode update.

Traffic (bf16): prefill reads x and writes y once (2 * B*C*T*2 bytes; the K shifted loads of a tile hit
L1/L2); decode reads and writes the [C, W] state of each row plus x and y.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from hybrid_kernels.library import pdl_opts, pdl_start
from hybrid_kernels.triton_shared import conv_step_load, conv_step_store, silu

from .triton_config import CONFIG, next_pow2


def _silu_flag(activation: str) -> bool:
    if activation == "silu":
        return True
    if activation in ("none", "identity", ""):
        return False
    raise ValueError(f"activation must be 'silu' or 'none', got {activation!r}")


@triton.jit(do_not_specialize=["T", "n_tblk", "sxb", "syb"])
def _conv_fwd_kernel(
    x_ptr, w_ptr, b_ptr, init_ptr, y_ptr, fs_ptr,
    C, T, n_tblk,
    sxb, sxc, sxt, swc, swk, sib, sic, siw, syb, syc, syt, sfb, sfc, sfw,
    K: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
    BIG: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    pid_t = pid % n_tblk
    pid_c = pid // n_tblk
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    if BIG:  # offsets inside one batch row may pass 2^31
        offs_t = offs_t.to(tl.int64)
    mc = offs_c < C
    mt = offs_t < T
    x_b = x_ptr + pid_b * sxb
    x_c = offs_c[:, None] * sxc

    acc = tl.zeros([BLOCK_C, BLOCK_T], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[:, None]
    for k in tl.static_range(K):
        src = offs_t + (k - (K - 1))  # input position read by tap k (negative: the initial state)
        wk = tl.load(w_ptr + offs_c * swc + k * swk, mask=mc, other=0.0).to(tl.float32)
        v = tl.load(x_b + x_c + src[None, :] * sxt, mask=mc[:, None] & (mt & (src >= 0))[None, :], other=0.0)
        acc += wk[:, None] * v.to(tl.float32)
    if HAS_INIT:
        if pid_t * BLOCK_T < K - 1:  # only the first steps reach back into the initial state
            i_b = init_ptr + pid_b * sib + offs_c[:, None] * sic
            for k in tl.static_range(K - 1):
                src = offs_t + (k - (K - 1))
                si = src + W
                wk = tl.load(w_ptr + offs_c * swc + k * swk, mask=mc, other=0.0).to(tl.float32)
                mi = mt & (src < 0) & (si >= 0)
                v = tl.load(i_b + si[None, :] * siw, mask=mc[:, None] & mi[None, :], other=0.0)
                acc += wk[:, None] * v.to(tl.float32)
    if SILU:
        acc = silu(acc)
    y_ptrs = y_ptr + pid_b * syb + offs_c[:, None] * syc + offs_t[None, :] * syt
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mc[:, None] & mt[None, :])

    if pid_t == n_tblk - 1:
        # final state = last W columns of cat(initial_state or 0, x)
        j = tl.arange(0, BLOCK_W)
        fsrc = (T - W + j).to(tl.int64)
        mj = j < W
        fv = tl.load(x_b + x_c + fsrc[None, :] * sxt, mask=mc[:, None] & (mj & (fsrc >= 0))[None, :], other=0.0)
        fv = fv.to(tl.float32)
        if HAS_INIT:
            fsi = fsrc + W
            fv += tl.load(init_ptr + pid_b * sib + offs_c[:, None] * sic + fsi[None, :] * siw,
                          mask=mc[:, None] & (mj & (fsrc < 0))[None, :], other=0.0).to(tl.float32)
        f_ptrs = fs_ptr + pid_b * sfb + offs_c[:, None] * sfc + j[None, :] * sfw
        tl.store(f_ptrs, fv.to(fs_ptr.dtype.element_ty), mask=mc[:, None] & mj[None, :])


def causal_conv1d_triton(
    x: torch.Tensor,  # [B, C, T], any strides
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    initial_state: torch.Tensor | None,  # [B, C, W]
    activation: str,
    state_width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    bsz, chans, seqlen = x.shape
    k = weight.shape[1]
    w = int(state_width)
    assert weight.shape[0] == chans, f"weight {tuple(weight.shape)} does not match {chans} channels"
    assert w >= 1, "state_width must be >= 1"
    if initial_state is not None:
        assert initial_state.shape == (bsz, chans, w), \
            f"initial_state {tuple(initial_state.shape)} != {(bsz, chans, w)}"
    # keep the producer's layout: channel-last input (a split of in_proj's output) -> channel-last y
    if x.stride(1) == 1 and chans > 1:
        y = torch.empty(bsz, seqlen, chans, dtype=x.dtype, device=x.device).transpose(1, 2)
    else:
        y = torch.empty(bsz, chans, seqlen, dtype=x.dtype, device=x.device)
    fs = torch.empty(bsz, chans, w, dtype=x.dtype, device=x.device)
    cfg = CONFIG["conv"]
    if x.stride(2) == 1 and seqlen > 1:
        bc, bt = cfg["BLOCK_C_TLAST"], cfg["BLOCK_T_TLAST"]
    else:
        bc, bt = cfg["BLOCK_C"], cfg["BLOCK_T"]
    n_tblk = triton.cdiv(seqlen, bt)
    grid = (n_tblk * triton.cdiv(chans, bc), bsz)
    init = initial_state if initial_state is not None else fs
    # int64 time offsets only when a row's extent can pass 2^31 elements
    big = max(abs(x.stride(2)), abs(y.stride(2))) * (seqlen + w) + max(abs(x.stride(1)), abs(y.stride(1))) * chans \
        >= 2**31
    wrap_triton(_conv_fwd_kernel)[grid](
        x, weight, bias if bias is not None else weight, init, y, fs,
        chans, seqlen, n_tblk,
        x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1),
        init.stride(0), init.stride(1), init.stride(2), y.stride(0), y.stride(1), y.stride(2),
        fs.stride(0), fs.stride(1), fs.stride(2),
        K=k, W=w, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        SILU=_silu_flag(activation), BIG=big, BLOCK_C=bc, BLOCK_T=bt, BLOCK_W=next_pow2(w),
        num_warps=cfg["num_warps"],
    )
    return y, fs


@triton.jit
def _conv_update_kernel(
    x_ptr, st_ptr, w_ptr, b_ptr, idx_ptr, y_ptr,
    C,
    sxb, sxc, sss, ssc, ssw, swc, swk, syb, syc,
    K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_IDX: tl.constexpr,
    SILU: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid_c = tl.program_id(0)
    row = tl.program_id(1)
    if HAS_IDX:
        slot = tl.load(idx_ptr + row).to(tl.int64)
    else:
        slot = row.to(tl.int64)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offs_c < C
    valid = (offs_c * 0 + slot) >= 0  # as a vector: the interpreter rejects vector & scalar masks
    m = mc & valid
    xv = tl.load(x_ptr + row * sxb + offs_c * sxc, mask=mc, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
    st = st_ptr + slot * sss + offs_c * ssc
    shifted, taps = conv_step_load(st, ssw, m, w_ptr + offs_c * swc, swk, mc, K, W, WP)
    acc = conv_step_store(st, ssw, m, shifted, taps, xv, acc, W, WP)
    if SILU:
        acc = silu(acc)
    acc = tl.where(valid, acc, 0.0)
    tl.store(y_ptr + row * syb + offs_c * syc, acc.to(y_ptr.dtype.element_ty), mask=mc)


def causal_conv1d_update_triton(
    x: torch.Tensor,  # [B, C]
    conv_state: torch.Tensor,  # [S, C, W], updated in place
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,
    activation: str,
    state_indices: torch.Tensor | None,  # [B] int32, -1 = pad row
) -> torch.Tensor:
    bsz, chans = x.shape
    k = weight.shape[1]
    w = conv_state.shape[2]
    assert conv_state.shape[1] == chans and weight.shape[0] == chans, "channel counts differ"
    assert w >= k, f"conv state width {w} must be >= kernel size {k}"
    y = torch.empty(bsz, chans, dtype=x.dtype, device=x.device)
    cfg = CONFIG["conv_update"]
    bc = min(cfg["BLOCK_C"], next_pow2(chans))
    grid = (triton.cdiv(chans, bc), bsz)
    wrap_triton(_conv_update_kernel)[grid](
        x, conv_state, weight, bias if bias is not None else weight,
        state_indices if state_indices is not None else y, y,
        chans,
        x.stride(0), x.stride(1), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        K=k, W=w, WP=next_pow2(w), HAS_BIAS=bias is not None, HAS_IDX=state_indices is not None,
        SILU=_silu_flag(activation), BLOCK_C=bc, num_warps=cfg["num_warps"], **pdl_opts(x),
    )
    return y
