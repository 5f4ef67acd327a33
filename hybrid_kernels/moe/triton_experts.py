"""The routed experts and the whole routed-MoE pipeline (``moe_triton``): routing (``triton_routing.py``), then grouped
expert GEMMs and a deterministic combine. No host sync, every size a function of shapes only: CUDA-graph safe.

3. ``_gate_up_kernel``: per (BM block, BN tile of I): gate and up tiles of the same expert in one program,
   act(gate) * up written once to ``inter [max_padded, I]`` (row = sorted position).
4. ``_down_kernel``: per (BM block, BN tile of H, K split): inter @ w2[e].T, times the routing weight, written
   to ``buf [SPLIT_K, T*k, H]`` (row = pair t*k+j).
5. ``_combine_kernel``: out[t] = sum over splits and slots of buf, in a fixed order (deterministic), plus the
   block's shared-expert output when ``hybrid::moe_block`` passes it.
Small T: BM=16 blocks, so every touched expert has one block and its weights are read once; the N dimension
is split finely (and K for the down projection) so enough CTAs stream the weights.

Memory traffic (gated, bf16): touched experts * 3 * H * I * 2 bytes + x/out, + inter (max_padded * I * 2 B,
written and read once) + buf (T*k*H*e written and read once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_kernels.library import pdl_opts, pdl_start
from . import triton_common as common
from .triton_common import bucket_for, config_for, mma, split_k_heuristic
from .reference import ACTIVATIONS, router_logits
from .triton_routing import (ROUTE_ALIGN_MAX_T, align_sizes, align_triton, route_align_triton, route_triton,
                      router_logits_triton, use_router_gemm)

_ACT_ID = {a: i for i, a in enumerate(ACTIVATIONS)}


# ----------------------------------------------------------------------------------------------------------
# Grouped GEMMs
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _act(x, ACT: tl.constexpr):
    # 0 silu, 1 gelu (erf), 2 gelu tanh approximation, 3 relu, 5 relu squared (4 swiglu_clamp, 6 swiglu_softcap and
    # 7 swiglu_limit combine gate and up: _glu)
    if ACT == 0:
        return x / (1.0 + tl.exp(-x))
    elif ACT == 1:
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 2:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (2.0 / (1.0 + tl.exp(-2.0 * inner)))  # 1 + tanh(u) = 2 * sigmoid(2u)
    elif ACT == 5:
        r = tl.maximum(x, 0.0)
        return r * r
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def _glu(g, u, ACT: tl.constexpr, alpha, limit):
    """The gated experts' product (reference.glu): act(g) * u, swiglu_clamp's (clamp(u) + 1) * g' sigmoid(alpha g')
    swiglu_softcap's cap(g, alpha) sigmoid(g) cap(u, limit), tanh as 2 sigmoid(2x) - 1, or swiglu_limit's
    silu(min(g, limit)) clamp(u, -limit, limit)."""
    if ACT == 4:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
    elif ACT == 6:
        gc = alpha * (2.0 / (1.0 + tl.exp(-2.0 * g / alpha)) - 1.0)
        uc = limit * (2.0 / (1.0 + tl.exp(-2.0 * u / limit)) - 1.0)
        return gc * uc / (1.0 + tl.exp(-g))
    elif ACT == 7:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return u * g / (1.0 + tl.exp(-g))
    else:
        return _act(g, ACT) * u


@triton.jit
def _tile_ids(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M consecutive M blocks sweep the N tiles together (weight tiles reused in L2)."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, inter_ptr, sorted_ptr, block_expert_ptr, num_post_ptr,
                    num_pairs, N, K, num_pid_m, alpha, limit,
                    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_im, stride_in,
                    TOP_K: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, CAST_F32: tl.constexpr, IEEE: tl.constexpr,
                    PDL: tl.constexpr = False):
    """inter[row, n] = glu(x[tok] @ gate[e, n] (+ bias), x[tok] @ up[e, n] (+ bias)) for the BM rows of one expert
    block. N = I (intermediate size), K = H. Weights [E, 2I or I, H] via strides, biases [E, 2I or I]."""
    pdl_start(PDL)
    pid_m, pid_n = _tile_ids(num_pid_m, tl.cdiv(N, BN), GROUP_M)
    if pid_m * BM >= tl.load(num_post_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + offs_m)
    row_ok = pair < num_pairs
    tok = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk
    w_base = w_ptr + e * stride_we
    if GATED:
        if INTERLEAVED:
            up_rows = 2 * offs_n + 1
            gate_rows = 2 * offs_n
        else:
            up_rows = offs_n + N
            gate_rows = offs_n
        g_ptrs = w_base + gate_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    else:
        up_rows = offs_n
    u_ptrs = w_base + up_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - kk * BK
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if CAST_F32:
            a = a.to(tl.float32)
            u = u.to(tl.float32)
        acc_u = mma(a, u, acc_u, IEEE)
        if GATED:
            if EVEN_K:
                g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if CAST_F32:
                g = g.to(tl.float32)
            acc_g = mma(a, g, acc_g, IEEE)
            g_ptrs += BK * stride_wk
        a_ptrs += BK * stride_xk
        u_ptrs += BK * stride_wk
    if HAS_BIAS:
        b_base = b_ptr + e * stride_be
        acc_u += tl.load(b_base + up_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_g += tl.load(b_base + gate_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        h = _glu(acc_g, acc_u, ACT, alpha, limit)
    else:
        h = _act(acc_u, ACT)
    out_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * stride_im + offs_n[None, :] * stride_in
    tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _down_kernel(inter_ptr, w_ptr, b_ptr, buf_ptr, sorted_ptr, block_expert_ptr, num_post_ptr, rw_ptr,
                 num_pairs, N, K, num_pid_m, k_per_split,
                 stride_im, stride_ik, stride_we, stride_wn, stride_wk, stride_be, stride_bs, stride_bp, stride_bn,
                 HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, CAST_F32: tl.constexpr, IEEE: tl.constexpr,
                 PDL: tl.constexpr = False):
    """buf[split, pair, n] = rw[pair] * (inter[row, k-range] @ w2[e, n, k-range] (+ bias[e, n] in split 0)).
    N = H, K = I."""
    pdl_start(PDL)
    pid_m, pid_n = _tile_ids(num_pid_m, tl.cdiv(N, BN), GROUP_M)
    pid_k = tl.program_id(1)
    if pid_m * BM >= tl.load(num_post_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + offs_m)
    row_ok = pair < num_pairs
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    k_lo = pid_k * k_per_split
    offs_k = k_lo + tl.arange(0, BK)
    a_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * stride_im + offs_k[None, :] * stride_ik
    b_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = (offs_k + (k0 - k_lo)) < k_hi
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if CAST_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = mma(a, b, acc, IEEE)
        a_ptrs += BK * stride_ik
        b_ptrs += BK * stride_wk
    if HAS_BIAS:  # once per pair: in the first K split
        bias = tl.load(b_ptr + e * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc += bias[None, :] * (pid_k == 0).to(tl.float32)
    rw = tl.load(rw_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    out_ptrs = buf_ptr + pid_k * stride_bs + pair[:, None].to(tl.int64) * stride_bp + offs_n[None, :] * stride_bn
    tl.store(out_ptrs, acc.to(buf_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(buf_ptr, out_ptr, shared_ptr, gate_ptr, N, stride_bs, stride_bp, stride_ot, stride_st, stride_gt,
                    TOP_K: tl.constexpr, SPLIT_K: tl.constexpr, BN: tl.constexpr, HAS_SHARED: tl.constexpr,
                    HAS_GATE: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = sum_{split, j} buf[split, t*k + j] (fixed order: deterministic), plus the block's shared-expert
    output [T, N] (times sigmoid(gate[t]) with HAS_GATE) when given: one rounding where the block had two."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = offs < N
    acc = tl.zeros([BN], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        for j in tl.static_range(TOP_K):
            acc += tl.load(buf_ptr + s * stride_bs + (t * TOP_K + j) * stride_bp + offs, mask=ok, other=0.0
                           ).to(tl.float32)
    if HAS_SHARED:
        sh = tl.load(shared_ptr + t * stride_st + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_GATE:
            sh = sh / (1.0 + tl.exp(-tl.load(gate_ptr + t * stride_gt).to(tl.float32)))
        acc += sh
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _check_experts_args(x, w13, w2, weights, ids, gated, activation):
    assert x.dim() == 2, f"x must be [T, H], got {tuple(x.shape)}"
    T, H = x.shape
    assert w13.dim() == 3 and w2.dim() == 3, "w13 / w2 must be [E, out, in]"
    E, H2, I = w2.shape
    assert H2 == H and w13.shape[0] == E and w13.shape[2] == H, (
        f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    assert w13.shape[1] == (2 * I if gated else I), (
        f"w13 has {w13.shape[1]} rows; expected {'2I' if gated else 'I'} with I={I} (gated={gated})")
    assert weights.shape == ids.shape and ids.shape[0] == T, (
        f"weights {tuple(weights.shape)} / ids {tuple(ids.shape)} must both be [T={T}, k]")
    if activation not in _ACT_ID:
        raise ValueError(f"unknown MoE activation {activation!r}; expected one of {ACTIVATIONS}")
    # everything but T is a model constant: plain ints (hashable config keys, no symbolic sizes under compile)
    return T, int(H), int(E), int(I), int(ids.shape[1])


def experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   *, gated: bool, interleaved: bool, activation: str, config: dict | None = None,
                   layout: tuple | None = None, shared: tuple | None = None, b13: torch.Tensor | None = None,
                   b2: torch.Tensor | None = None, alpha: float = 1.0, limit: float = float("inf")) -> torch.Tensor:
    """Same contract as reference.experts. ``config`` overrides ``config_for`` (tests, tuning); ``layout``:
    ``align_triton(ids, E, config BM)``'s result when the caller has it (``route_align_triton``); ``shared`` =
    (shared-expert output [T, H], gate [T, 1] | None): added to the result (``hybrid::moe_block``)."""
    T, H, E, I, top_k = _check_experts_args(x, w13, w2, weights, ids, gated, activation)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    assert w13.dtype == w2.dtype, f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must share a dtype"
    cfg = config or config_for(T, E, H, I, top_k, w13.element_size())
    if cfg["down"].get("SPLIT_K") is None:  # a hand-written config (tests, sweeps) may leave it to the heuristic
        cfg = {**cfg, "down": {**cfg["down"], "SPLIT_K": split_k_heuristic(
            min(bucket_for(T), 1 << 20), E, H, I, top_k, cfg)}}
    BM, up, down = cfg["BM"], cfg["up"], cfg["down"]
    num_pairs = T * top_k
    sorted_ids, block_expert, num_post = layout if layout is not None else align_triton(ids, E, BM)
    max_padded, _, grid_m = align_sizes(num_pairs, E, BM)
    out_dtype = x.dtype
    if x.dtype != w13.dtype:  # e.g. fp32 activations under autocast with bf16 experts: compute in the weights' dtype
        x = x.to(w13.dtype)
    cast, ieee = common.cast_f32(x.dtype), common.ieee(x.dtype)

    inter = torch.empty(max_padded, I, dtype=w2.dtype, device=x.device)
    grid = (grid_m * triton.cdiv(I, up["BN"]),)
    common.launch(_gate_up_kernel)[grid](
        x, w13, b13 if b13 is not None else w13, inter, sorted_ids, block_expert, num_post, num_pairs, I, H, grid_m,
        float(alpha), float(limit), x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        b13.stride(0) if b13 is not None else 0, inter.stride(0), inter.stride(1),
        TOP_K=top_k, GATED=bool(gated), INTERLEAVED=bool(interleaved), ACT=_ACT_ID[activation],
        HAS_BIAS=b13 is not None, BM=BM, BN=up["BN"], BK=up["BK"], GROUP_M=up["GROUP_M"], EVEN_K=H % up["BK"] == 0,
        CAST_F32=cast, IEEE=ieee, num_warps=up["warps"], num_stages=up["stages"], **pdl_opts(x))

    split = max(1, int(down["SPLIT_K"]))
    k_per_split = triton.cdiv(triton.cdiv(I, down["BK"]), split) * down["BK"]
    split = triton.cdiv(I, k_per_split)  # no empty splits
    buf_dtype = torch.float32 if split > 1 else out_dtype
    buf = torch.empty(split, num_pairs, H, dtype=buf_dtype, device=x.device)
    rw = weights.contiguous()
    grid = (grid_m * triton.cdiv(H, down["BN"]), split)
    common.launch(_down_kernel)[grid](
        inter, w2, b2 if b2 is not None else w2, buf, sorted_ids, block_expert, num_post, rw, num_pairs, H, I, grid_m,
        k_per_split, inter.stride(0), inter.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        b2.stride(0) if b2 is not None else 0, buf.stride(0), buf.stride(1), buf.stride(2), HAS_BIAS=b2 is not None,
        BM=BM, BN=down["BN"], BK=down["BK"], GROUP_M=down["GROUP_M"], EVEN_K=k_per_split % down["BK"] == 0
        and I % k_per_split == 0, CAST_F32=cast, IEEE=ieee, num_warps=down["warps"], num_stages=down["stages"],
        **pdl_opts(x))

    assert out.stride(1) == 1
    bn = min(1024, triton.next_power_of_2(H))
    sh, gate = shared if shared is not None else (None, None)
    assert sh is None or (sh.shape == (T, H) and sh.stride(1) == 1), "shared: [T, H], rows contiguous"
    assert gate is None or gate.shape == (T, 1), "shared gate: [T, 1]"
    common.launch(_combine_kernel)[(T, triton.cdiv(H, bn))](
        buf, out, sh if sh is not None else out, gate if gate is not None else out, H, buf.stride(0), buf.stride(1),
        out.stride(0), sh.stride(0) if sh is not None else 0, gate.stride(0) if gate is not None else 0,
        TOP_K=top_k, SPLIT_K=split, BN=bn, HAS_SHARED=sh is not None, HAS_GATE=gate is not None, num_warps=4,
        **pdl_opts(out))
    return out


def moe_triton(x: torch.Tensor, router_w: torch.Tensor, router_bias: torch.Tensor | None, w13: torch.Tensor,
               w2: torch.Tensor, *, method: str, top_k: int, renormalize: bool, scale: float, n_group: int,
               topk_group: int, gated: bool, interleaved: bool, activation: str, router_fp32: bool,
               jitter_eps: float = 0.0, config: dict | None = None, shared: tuple | None = None, router_logit_bias: torch.Tensor | None = None,
               b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, alpha: float = 1.0,
               limit: float = float("inf")) -> torch.Tensor:
    """Route + align + experts; same contract as reference.moe, plus ``shared`` as in ``experts_triton``."""
    if router_logit_bias is None and use_router_gemm(x.shape[0], router_w.shape[0], x.shape[1],
                                                     (x.dtype, router_w.dtype)):
        logits = router_logits_triton(x, router_w, router_fp32)
    else:
        logits = router_logits(x, router_w, router_fp32, router_logit_bias)
    route = dict(method=method, top_k=top_k, renormalize=renormalize, scale=scale, n_group=n_group,
                 topk_group=topk_group, jitter_eps=jitter_eps)
    if bucket_for(x.shape[0]) <= ROUTE_ALIGN_MAX_T:
        T, H = x.shape
        I = w2.shape[2]
        bm = (config or config_for(T, int(w2.shape[0]), int(H), int(I), int(top_k), w13.element_size()))["BM"]
        weights, ids, layout = route_align_triton(logits, router_bias, **route, block_m=bm)
    else:
        (weights, ids), layout = route_triton(logits, router_bias, **route), None
    return experts_triton(x, w13, w2, weights, ids, gated=gated, interleaved=interleaved, activation=activation,
                          config=config, layout=layout, shared=shared, b13=b13, b2=b2, alpha=alpha, limit=limit)
