"""Routing for the routed-MoE pipeline (``experts.moe_triton``'s steps 1-2): router logits, top-k routing and the
token -> expert alignment, all on the device with no host sync and every size a function of shapes only.

1. Router logits: ``_router_gemv_kernel`` for up to 4 tokens (up to 64 where the dot must be exact fp32),
   ``_router_gemm_kernel`` for few tokens and small routers, else ``F.linear``; then ``_route_kernel``: scores,
   bias, group limit, top-k, renorm, scale.
2. ``align_triton``: pairs (t, j) sorted by expert, each expert's segment padded to a multiple of BM (padding =
   sentinel T*k); ``block_expert_ids`` names each BM-row block's expert. Up to ``ROUTE_ALIGN_MAX_T`` tokens
   (decode) routing and this run in one launch (``_route_align_kernel``); at one token its layout comes from the
   ids in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_kernels.library import pdl_opts, pdl_start, size_hint
from . import triton_common as common
from .triton_common import bucket_for, mma
from .reference import METHODS, check_route_args

# Up to this many tokens the router logits are matrix-vector products on the CUDA cores (_router_gemv_kernel).
ROUTER_GEMV_MAX_T = 4
# ... and up to this many when the dot must be exact fp32 (an fp32 router weight, as recent transformers keep
# DeepSeek's, or an fp32 model): the [16, 16]-tile kernel then multiplies on the CUDA cores too, on only
# cdiv(T, 16) * cdiv(E, 16) programs, several times slower than one program per (token, expert) (bench/TUNING.md).
ROUTER_GEMV_F32_MAX_T = 64
# Largest (T*k) * next_pow2(E) handled by the single-program alignment kernel; above it: 3 kernels.
ALIGN_SINGLE_MAX = 16384

_METHOD_ID = {m: i for i, m in enumerate(METHODS)}
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ----------------------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _argmax_first(v, cols, EP: tl.constexpr):
    """Per row: (max, lowest column holding it)."""
    m = tl.max(v, axis=1)
    idx = tl.min(tl.where(v == m[:, None], cols[None, :], EP), axis=1)
    return m, idx


@triton.jit(do_not_specialize=["T"])
def _router_gemm_kernel(x_ptr, rw_ptr, out_ptr, T, E, H, stride_xt, stride_xh, stride_re, stride_rh,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        IEEE: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr = False):
    """logits [T, E] fp32 = x @ w.T for one [BLOCK_T, BLOCK_E] tile, both operands in DOT_DTYPE (bf16 x bf16
    products are exact in the fp32 accumulator: F.linear(x.float(), w.float()) up to summation order); ROUND:
    then rounded to x's dtype, as F.linear(x, w.to(x.dtype)) returns it."""
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rmask = rows < T
    cmask = cols < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    ks = tl.arange(0, BK)
    for k0 in range(0, H, BK):
        kk = k0 + ks
        km = kk < H
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + kk[None, :] * stride_xh, mask=rmask[:, None] & km[None, :],
                     other=0.0).to(DOT_DTYPE)
        wt = tl.load(rw_ptr + cols[:, None] * stride_re + kk[None, :] * stride_rh, mask=cmask[:, None] & km[None, :],
                     other=0.0).to(DOT_DTYPE)
        acc = mma(xt, tl.trans(wt), acc, IEEE)
    if ROUND:
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * E + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _router_gemv_kernel(x_ptr, rw_ptr, out_ptr, E, H, stride_xt, stride_xh, stride_re, stride_rh, BK: tl.constexpr,
                        ROUND: tl.constexpr, PDL: tl.constexpr = False):
    """One (token, expert) logit on the CUDA cores (fp32 products of the widened operands, exact for 16-bit
    inputs): at a few tokens the router is a matrix-vector product, and a [16, 16] tensor-core tile per program
    would leave all but E / 16 SMs idle."""
    pdl_start(PDL)
    t = tl.program_id(0)
    e = tl.program_id(1)
    ks = tl.arange(0, BK)
    acc = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + ks
        km = kk < H
        xv = tl.load(x_ptr + t * stride_xt + kk * stride_xh, mask=km, other=0.0).to(tl.float32)
        wv = tl.load(rw_ptr + e * stride_re + kk * stride_rh, mask=km, other=0.0).to(tl.float32)
        acc += wv * xv
    logit = tl.sum(acc, axis=0)
    if ROUND:
        logit = logit.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * E + e, logit)


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_lt, stride_le, scale, eps,
                  E: tl.constexpr, EP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                  METHOD: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    _route_rows(logits_ptr, bias_ptr, w_ptr, ids_ptr, tl.program_id(0) * BLOCK_T, T, stride_lt, stride_le, scale, eps,
                E, EP, TOP_K, KP, METHOD, RENORM, HAS_BIAS, N_GROUP, TOPK_GROUP, BLOCK_T)


@triton.jit(do_not_specialize=["T", "MAX_PADDED", "MAX_BLOCKS"])
def _route_align_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_post_ptr, T,
                        stride_lt, stride_le, scale, eps, MAX_PADDED, MAX_BLOCKS,
                        E: tl.constexpr, EP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                        METHOD: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                        N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
                        BM: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr, BB: tl.constexpr,
                        PDL: tl.constexpr = False, ONE_ROW: tl.constexpr = False):
    """Decode's routing in one launch: route every row (BLOCK_T at a time), then align the T * k pairs from the
    ids this program just wrote; the barrier makes every thread's id stores visible to the loads that follow.
    Correct at any T; chosen at a few tokens (``route_align_triton``), where separate route and align launches are
    two fixed costs of a few microseconds each in a decode-sized MoE layer.
    ONE_ROW (T == 1): the k experts are distinct, so the layout is k one-pair blocks in expert order, written from
    the ids in registers: no store, barrier and reload of the ids, no counting pass. The same layout as align's."""
    pdl_start(PDL)
    if ONE_ROW:
        id_acc = _route_rows(logits_ptr, bias_ptr, w_ptr, ids_ptr, 0, T, stride_lt, stride_le, scale, eps, E, EP,
                             TOP_K, KP, METHOD, RENORM, HAS_BIAS, N_GROUP, TOPK_GROUP, BLOCK_T)
        _one_row_layout(id_acc, sorted_ptr, block_expert_ptr, num_post_ptr, MAX_PADDED, MAX_BLOCKS, TOP_K, KP,
                        BLOCK_T, BM, TAIL, BB)
    else:
        for row0 in range(0, T, BLOCK_T):
            _route_rows(logits_ptr, bias_ptr, w_ptr, ids_ptr, row0, T, stride_lt, stride_le, scale, eps, E, EP, TOP_K,
                        KP, METHOD, RENORM, HAS_BIAS, N_GROUP, TOPK_GROUP, BLOCK_T)
        tl.debug_barrier()
        _align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_post_ptr, T * TOP_K, MAX_PADDED, MAX_BLOCKS, E, EP,
                     BM, BLOCK, TAIL, BB)


@triton.jit
def _one_row_layout(id_acc, sorted_ptr, block_expert_ptr, num_post_ptr, MAX_PADDED, MAX_BLOCKS,
                    TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BM: tl.constexpr,
                    TAIL: tl.constexpr, BB: tl.constexpr):
    """align's layout of one token's k distinct experts from its ids [BLOCK_T, KP] (row 0): pair j heads block
    rank(j) (its expert's place among the k in ascending order), every other slot holds the sentinel k, block b < k
    belongs to the expert of rank b, the rest to -1; each address is written once (no ordering between threads)."""
    kc = tl.arange(0, KP)
    kv = kc < TOP_K
    ids0 = tl.sum(tl.where(tl.arange(0, BLOCK_T)[:, None] == 0, id_acc, 0), axis=0)        # [KP]
    rank = tl.sum(((ids0[None, :] < ids0[:, None]) & kv[None, :]).to(tl.int32), axis=1)     # [KP]
    tl.store(sorted_ptr + rank * BM, kc, mask=kv)
    for p0 in range(0, MAX_PADDED, TAIL):
        p = p0 + tl.arange(0, TAIL)
        head = (p % BM == 0) & (p // BM < TOP_K)
        tl.store(sorted_ptr + p, tl.full([TAIL], TOP_K, tl.int32), mask=(p < MAX_PADDED) & ~head)
    tl.store(block_expert_ptr + rank, ids0, mask=kv)
    for b0 in range(0, MAX_BLOCKS, BB):
        b = b0 + tl.arange(0, BB)
        tl.store(block_expert_ptr + b, tl.full([BB], -1, tl.int32), mask=(b >= TOP_K) & (b < MAX_BLOCKS))
    tl.store(num_post_ptr, TOP_K * BM)


@triton.jit
def _softplus(x):
    """torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)), log1p exact to a few ulps as
    log(u) * y / (u - 1) with u = 1 + y (the rounding of u cancels)."""
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    lp = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _route_rows(logits_ptr, bias_ptr, w_ptr, ids_ptr, row0, T, stride_lt, stride_le, scale, eps,
                E: tl.constexpr, EP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                METHOD: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows [row0, row0 + BLOCK_T) of logits [T, E] -> weights fp32 / ids int32 [T, TOP_K].
    METHOD: 0 softmax_topk, 1 topk_softmax, 2 sigmoid_group_topk, 3 softmax_group_topk, 4 softmax_bias_topk,
    5 sigmoid_logit_bias_topk, 6 sparsemixer (``eps``: its jitter eps), 7 sqrtsoftplus_bias_topk."""
    rows = row0 + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, EP)
    rmask = rows < T
    cmask = cols < E
    ninf = float("-inf")
    x = tl.load(logits_ptr + rows[:, None] * stride_lt + cols[None, :] * stride_le,
                mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    x = tl.where(cmask[None, :], x, ninf)
    if METHOD == 2:
        score = 1.0 / (1.0 + tl.exp(-x))
        choice = score
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    elif METHOD == 1 or METHOD == 6:
        score = x
        choice = x
    elif METHOD == 7:
        score = tl.sqrt(_softplus(x))
        choice = score
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    elif METHOD == 5:
        score = 1.0 / (1.0 + tl.exp(-x))
        choice = x
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    else:
        m = tl.max(x, axis=1)
        p = tl.exp(x - m[:, None])
        p = tl.where(cmask[None, :], p, 0.0)
        score = p / tl.sum(p, axis=1)[:, None]
        choice = score
        if METHOD == 4 and HAS_BIAS:
            choice = choice + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(cmask[None, :], choice, ninf)

    if METHOD == 2 or METHOD == 3:  # group-limited: keep the TOPK_GROUP best groups
        GS: tl.constexpr = E // N_GROUP
        grp = cols // GS  # padded columns get groups >= N_GROUP
        gscore = tl.full([BLOCK_T, EP], ninf, tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = (grp == g)[None, :]
            v = tl.where(in_g, choice, ninf)
            m1, i1 = _argmax_first(v, cols, EP)
            if METHOD == 2 and GS >= 2:
                v2 = tl.where(cols[None, :] == i1[:, None], ninf, v)
                sc = m1 + tl.max(v2, axis=1)
            else:
                sc = m1
            gscore = tl.where(in_g, sc[:, None], gscore)
        keep = tl.zeros([BLOCK_T, EP], dtype=tl.int32) != 0
        for r in tl.static_range(TOPK_GROUP):
            cand = tl.where(keep, ninf, gscore)
            mg = tl.max(cand, axis=1)
            gi = tl.min(tl.where((cand == mg[:, None]) & (grp < N_GROUP)[None, :] & (~keep), grp[None, :],
                                 N_GROUP), axis=1)
            keep = keep | (grp[None, :] == gi[:, None])
        if METHOD == 2:
            choice = tl.where(keep, choice, ninf)
        else:  # group_limited_greedy zeroes the dropped groups' probabilities
            score = tl.where(keep, score, 0.0)
            choice = tl.where(cmask[None, :], score, ninf)

    kcols = tl.arange(0, KP)
    w_acc = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    id_acc = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    avail = cmask[None, :] & (rows >= 0)[:, None]
    for j in tl.static_range(TOP_K):
        cand = tl.where(avail, choice, ninf)
        m = tl.max(cand, axis=1)
        idx = tl.min(tl.where((cand == m[:, None]) & avail, cols[None, :], EP), axis=1)
        sel = cols[None, :] == idx[:, None]
        if METHOD == 6:  # softmax over the pick and the not-yet-picked logits within the threshold, at the pick
            thr = 2.0 * tl.cast(eps, tl.float32)
            far = (m[:, None] - x) / tl.maximum(tl.abs(x), m[:, None]) > thr  # NaN (0 / 0) compares False
            val = 1.0 / tl.sum(tl.where(avail & ~far, tl.exp(x - m[:, None]), 0.0), axis=1)
        else:
            val = tl.sum(tl.where(sel, score, 0.0), axis=1)
        w_acc = tl.where(kcols[None, :] == j, val[:, None], w_acc)
        id_acc = tl.where(kcols[None, :] == j, idx[:, None], id_acc)
        avail = avail & (~sel)
    kvalid = (kcols < TOP_K)[None, :]
    if METHOD == 1:
        wm = tl.max(tl.where(kvalid, w_acc, ninf), axis=1)
        ex = tl.where(kvalid, tl.exp(w_acc - wm[:, None]), 0.0)
        w_acc = ex / tl.sum(ex, axis=1)[:, None]
    elif RENORM:
        denom = tl.sum(tl.where(kvalid, w_acc, 0.0), axis=1)
        if METHOD == 2 or METHOD == 4 or METHOD == 7:
            denom = denom + 1e-20
        w_acc = w_acc / denom[:, None]
    w_acc = w_acc * tl.cast(scale, tl.float32)  # the scalar may arrive as fp64 under Inductor
    omask = rmask[:, None] & kvalid
    offs = rows[:, None] * TOP_K + kcols[None, :]
    tl.store(w_ptr + offs, w_acc, mask=omask)
    tl.store(ids_ptr + offs, id_acc, mask=omask)
    return id_acc


def _route_launch(logits: torch.Tensor, bias: torch.Tensor | None, method: str, top_k: int, renormalize: bool,
                  scale: float, n_group: int, topk_group: int, jitter_eps: float):
    """(weights, ids, kernel arguments, kernel constexprs, block_t) shared by the two routing launchers."""
    assert logits.dim() == 2, f"logits must be [T, E], got {tuple(logits.shape)}"
    T, E = logits.shape[0], int(logits.shape[1])
    top_k, n_group, topk_group = int(top_k), int(n_group), int(topk_group)  # schema ints arrive as SymInt-able
    check_route_args(E, method, top_k, n_group, topk_group, jitter_eps)
    if bias is not None:
        assert bias.shape == (E,), f"bias must be [E]={E}, got {tuple(bias.shape)}"
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    EP = triton.next_power_of_2(E)
    # few tokens: a small tile in one warp (its reductions stay in the warp)
    block_t = max(2, min(32, 2048 // EP, common.pow2_at_least(bucket_for(T))))
    grouped = method.endswith("group_topk")
    args = (logits, bias if bias is not None else logits, weights, ids)
    meta = dict(E=E, EP=EP, TOP_K=top_k, KP=max(2, triton.next_power_of_2(top_k)), METHOD=_METHOD_ID[method],
                RENORM=bool(renormalize), HAS_BIAS=bias is not None, N_GROUP=n_group if grouped else 1,
                TOPK_GROUP=topk_group if grouped else 1, BLOCK_T=block_t,
                num_warps=max(1, min(4, block_t * EP // 512)))
    return weights, ids, args, meta, block_t


def route_triton(logits: torch.Tensor, bias: torch.Tensor | None, *, method: str, top_k: int, renormalize: bool,
                 scale: float, n_group: int = 1, topk_group: int = 1,
                 jitter_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k]); same contract as reference.route."""
    weights, ids, args, meta, block_t = _route_launch(logits, bias, method, top_k, renormalize, scale, n_group,
                                                      topk_group, jitter_eps)
    T = logits.shape[0]
    if T == 0:
        return weights, ids
    common.launch(_route_kernel)[(triton.cdiv(T, block_t),)](
        *args, T, logits.stride(0), logits.stride(1), float(scale), float(jitter_eps), **meta, **pdl_opts(logits))
    return weights, ids


#: route and align in one launch (``route_align_triton``) up to this many tokens (a bucket bound: the kernel is
#: correct at any T, one program routes them all)
ROUTE_ALIGN_MAX_T = 16


def route_align_triton(logits: torch.Tensor, bias: torch.Tensor | None, *, method: str, top_k: int,
                       renormalize: bool, scale: float, n_group: int, topk_group: int, block_m: int,
                       jitter_eps: float = 0.0):
    """``route_triton`` then ``align_triton(ids, E, block_m)`` in one single-program launch (decode: a few
    tokens) -> (weights, ids, (sorted_token_ids, block_expert_ids, num_tokens_post_padded))."""
    weights, ids, args, meta, _ = _route_launch(logits, bias, method, top_k, renormalize, scale, n_group, topk_group,
                                                jitter_eps)
    T, E = logits.shape[0], int(logits.shape[1])
    N = T * int(top_k)
    max_padded, max_blocks, _ = align_sizes(N, E, block_m)
    dev = logits.device
    layout = (torch.empty(max_padded, dtype=torch.int32, device=dev),
              torch.empty(max_blocks, dtype=torch.int32, device=dev), torch.empty(1, dtype=torch.int32, device=dev))
    if T == 0:
        return weights, ids, layout
    block = max(16, min(256, common.pow2_at_least(size_hint(N))))
    common.launch(_route_align_kernel)[(1,)](
        *args, *layout, T, logits.stride(0), logits.stride(1), float(scale), float(jitter_eps), max_padded,
        max_blocks, **meta,
        BM=block_m, BLOCK=block, TAIL=1024, BB=64, ONE_ROW=bool(T == 1), **pdl_opts(logits))
    return weights, ids, layout


#: the router GEMM runs in Triton up to this many tokens and weight elements (E * H): one kernel of [16 tokens x
#: 16 experts] tiles over the whole H, in place of the fp32 casts of x and of the weight and cuBLAS's GEMV +
#: reduction (4 kernels). Larger T or routers (DeepSeek-V3: 256 x 7168) keep cuBLAS.
ROUTER_GEMM_MAX_T = 64
ROUTER_GEMM_MAX_WEIGHT = 1 << 20


def use_router_gemm(T, E: int, H: int, dtypes=()) -> bool:
    return (bucket_for(T) <= ROUTER_GEMM_MAX_T and E * H <= ROUTER_GEMM_MAX_WEIGHT
            and all(d in _TL_DTYPE for d in dtypes))


def router_logits_triton(x: torch.Tensor, router_w: torch.Tensor, router_fp32: bool) -> torch.Tensor:
    """x [T, H], router weight [E, H] -> fp32 logits [T, E] as reference.router_logits computes them."""
    T, H = x.shape
    E = int(router_w.shape[0])
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T == 0:
        return logits
    rnd = not router_fp32 and x.dtype != torch.float32  # F.linear(x, w.to(x.dtype)) rounds to x.dtype
    if router_fp32:  # F.linear(x.float(), w.float()): 16-bit operands of one dtype multiply exactly in fp32
        dot_dtype = torch.float32 if x.dtype == torch.float32 or router_w.dtype != x.dtype else x.dtype
    else:  # F.linear(x, w.to(x.dtype)), rounded to x.dtype
        dot_dtype = x.dtype
    gemv_max = ROUTER_GEMV_F32_MAX_T if dot_dtype == torch.float32 else ROUTER_GEMV_MAX_T
    if bucket_for(T) <= gemv_max:  # a few tokens (a bucket bound: no guard of its own): one matrix-vector
        # product per token, one program per expert (faster than several experts per program or tensor-core tiles
        # at these sizes: bench/TUNING.md)
        common.launch(_router_gemv_kernel)[(T, E)](
            x, router_w, logits, E, H, x.stride(0), x.stride(1), router_w.stride(0), router_w.stride(1),
            BK=512, ROUND=rnd, num_warps=4, num_stages=3, **pdl_opts(x))
        return logits
    if common.cast_f32(dot_dtype):
        dot_dtype = torch.float32
    common.launch(_router_gemm_kernel)[(triton.cdiv(T, 16), triton.cdiv(E, 16))](
        x, router_w, logits, T, E, H, x.stride(0), x.stride(1), router_w.stride(0), router_w.stride(1),
        BLOCK_T=16, BLOCK_E=16, BK=128, DOT_DTYPE=_TL_DTYPE[dot_dtype], IEEE=dot_dtype == torch.float32,
        ROUND=rnd, num_warps=4, num_stages=4, **pdl_opts(x))
    return logits


# ----------------------------------------------------------------------------------------------------------
# Alignment: sorted_token_ids / block_expert_ids / num_tokens_post_padded
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _chunk_onehot(ids_ptr, start, N, BLOCK: tl.constexpr, EP: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    valid = offs < N
    e = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    onehot = ((e[:, None] == tl.arange(0, EP)[None, :]) & valid[:, None]).to(tl.int32)  # [BLOCK, EP]
    return offs, valid, onehot


@triton.jit
def _scatter_chunk(sorted_ptr, offs, valid, onehot, base):
    """Each pair goes to base[its expert] + (number of earlier pairs of the chunk with the same expert)."""
    rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1), axis=1)
    pos = tl.sum(onehot * base[None, :], axis=1) + rank
    tl.store(sorted_ptr + pos, offs.to(tl.int32), mask=valid)


@triton.jit
def _write_layout(sorted_ptr, block_expert_ptr, num_post_ptr, counts, N, MAX_PADDED, MAX_BLOCKS,
                  E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, TAIL: tl.constexpr, BB: tl.constexpr):
    """From per-expert counts [EP]: segment starts, num_post, padding sentinels, block experts. Returns starts."""
    cols = tl.arange(0, EP)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_post_ptr, total)
    # per-expert padding: [starts + counts, ends)
    r = tl.arange(0, BM)
    pad_pos = (starts + counts)[:, None] + r[None, :]
    tl.store(sorted_ptr + pad_pos, tl.full([EP, BM], 0, tl.int32) + N,
             mask=(r[None, :] < (padded - counts)[:, None]) & (cols < E)[:, None])
    # tail past the last segment: [total, MAX_PADDED)
    for p0 in range(total, MAX_PADDED, TAIL):
        p = p0 + tl.arange(0, TAIL)
        tl.store(sorted_ptr + p, tl.full([TAIL], 0, tl.int32) + N, mask=p < MAX_PADDED)
    # block b's expert = number of experts whose segment ends at or before b*BM (empty segments included)
    for b0 in range(0, MAX_BLOCKS, BB):
        b = b0 + tl.arange(0, BB)
        first = b * BM
        ex = tl.sum(((ends[None, :] <= first[:, None]) & (cols < E)[None, :]).to(tl.int32), axis=1)
        ex = tl.where(first < total, ex, -1)
        tl.store(block_expert_ptr + b, ex, mask=b < MAX_BLOCKS)
    return starts


@triton.jit(do_not_specialize=["N", "MAX_PADDED", "MAX_BLOCKS"])
def _align_single_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_post_ptr, N, MAX_PADDED, MAX_BLOCKS,
                         E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr,
                         TAIL: tl.constexpr, BB: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    _align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_post_ptr, N, MAX_PADDED, MAX_BLOCKS, E, EP, BM, BLOCK,
                 TAIL, BB)


@triton.jit
def _align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_post_ptr, N, MAX_PADDED, MAX_BLOCKS,
                 E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr,
                 TAIL: tl.constexpr, BB: tl.constexpr):
    """All N pairs in one program, BLOCK at a time: count, lay out, scatter (in order: a stable sort)."""
    counts = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(0, N, BLOCK):
        counts += tl.sum(_chunk_onehot(ids_ptr, c0, N, BLOCK, EP)[2], axis=0)
    running = _write_layout(sorted_ptr, block_expert_ptr, num_post_ptr, counts, N, MAX_PADDED, MAX_BLOCKS,
                            E, EP, BM, TAIL, BB)
    for c0 in range(0, N, BLOCK):
        offs, valid, onehot = _chunk_onehot(ids_ptr, c0, N, BLOCK, EP)
        _scatter_chunk(sorted_ptr, offs, valid, onehot, running)
        running += tl.sum(onehot, axis=0)


@triton.jit(do_not_specialize=["N"])
def _align_count_kernel(ids_ptr, counts_ptr, N, EP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    _, _, onehot = _chunk_onehot(ids_ptr, pid * BLOCK, N, BLOCK, EP)
    tl.store(counts_ptr + pid * EP + tl.arange(0, EP), tl.sum(onehot, axis=0))


@triton.jit(do_not_specialize=["N", "NB", "MAX_PADDED", "MAX_BLOCKS"])
def _align_offsets_kernel(counts_ptr, base_ptr, sorted_ptr, block_expert_ptr, num_post_ptr, N, NB,
                          MAX_PADDED, MAX_BLOCKS, E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr,
                          CB: tl.constexpr, TAIL: tl.constexpr, BB: tl.constexpr):
    cols = tl.arange(0, EP)
    totals = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(0, NB, CB):
        c = c0 + tl.arange(0, CB)
        totals += tl.sum(tl.load(counts_ptr + c[:, None] * EP + cols[None, :], mask=(c < NB)[:, None], other=0),
                         axis=0)
    starts = _write_layout(sorted_ptr, block_expert_ptr, num_post_ptr, totals, N, MAX_PADDED, MAX_BLOCKS,
                           E, EP, BM, TAIL, BB)
    running = starts
    for c0 in range(0, NB, CB):
        c = c0 + tl.arange(0, CB)
        cnt = tl.load(counts_ptr + c[:, None] * EP + cols[None, :], mask=(c < NB)[:, None], other=0)
        base = running[None, :] + tl.cumsum(cnt, axis=0) - cnt
        tl.store(base_ptr + c[:, None] * EP + cols[None, :], base, mask=(c < NB)[:, None])
        running += tl.sum(cnt, axis=0)


@triton.jit(do_not_specialize=["N"])
def _align_scatter_kernel(ids_ptr, base_ptr, sorted_ptr, N, EP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs, valid, onehot = _chunk_onehot(ids_ptr, pid * BLOCK, N, BLOCK, EP)
    base = tl.load(base_ptr + pid * EP + tl.arange(0, EP))
    _scatter_chunk(sorted_ptr, offs, valid, onehot, base)


def align_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int, int]:
    """(max_padded, max_blocks, grid_blocks): buffer bounds and a tighter bound on the number of used blocks
    (sum_e cdiv(c_e, BM) <= (T*k + min(E, T*k) * (BM - 1)) / BM)."""
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_blocks = triton.cdiv(max_padded, block_m)
    grid_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m
    return max_padded, max_blocks, max(grid_blocks, 1)


def align_triton(ids: torch.Tensor, num_experts: int, block_m: int, *, path: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_token_ids int32 [max_padded], block_expert_ids int32 [max_blocks],
    num_tokens_post_padded int32 [1]). Pairs (t, j) are flattened to t*k+j and stably sorted by expert; each
    expert's segment is padded to a multiple of block_m with the sentinel T*k (so is the tail past the last
    segment); block_expert_ids is -1 past num_tokens_post_padded. ``path`` forces "single" or "multi" (tests)."""
    assert ids.dim() == 2, f"ids must be [T, k], got {tuple(ids.shape)}"
    assert block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m={block_m} must be a power of two"
    ids = ids.contiguous()
    N = ids.numel()
    E = num_experts
    EP = triton.next_power_of_2(E)
    max_padded, max_blocks, _ = align_sizes(N, E, block_m)
    dev = ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    TAIL, BB = 1024, 64
    if path is None:
        path = "single" if N * EP <= ALIGN_SINGLE_MAX else "multi"
    if path == "single":
        block = common.pow2_at_least(max(N, 16))
        common.launch(_align_single_kernel)[(1,)](
            ids, sorted_ids, block_expert, num_post, N, max_padded, max_blocks, E=E, EP=EP, BM=block_m,
            BLOCK=block, TAIL=TAIL, BB=BB, num_warps=4 if block * EP <= 4096 else 8, **pdl_opts(ids))
        return sorted_ids, block_expert, num_post
    block = max(16, min(1024, 8192 // EP))
    nb = triton.cdiv(N, block)
    counts = torch.empty(nb, EP, dtype=torch.int32, device=dev)
    base = torch.empty(nb, EP, dtype=torch.int32, device=dev)
    common.launch(_align_count_kernel)[(nb,)](ids, counts, N, EP=EP, BLOCK=block, num_warps=4)
    cb = max(1, min(common.pow2_at_least(nb), 4096 // EP))
    common.launch(_align_offsets_kernel)[(1,)](
        counts, base, sorted_ids, block_expert, num_post, N, nb, max_padded, max_blocks, E=E, EP=EP, BM=block_m,
        CB=cb, TAIL=TAIL, BB=BB, num_warps=8)
    common.launch(_align_scatter_kernel)[(nb,)](ids, base, sorted_ids, N, EP=EP, BLOCK=block, num_warps=4)
    return sorted_ids, block_expert, num_post
