"""Linear layers at one row (decode at batch 1): y = x @ w^T (+ bias), x [1, K], w [N, K].

At decode a linear layer's time is its weight's bytes over the memory bandwidth, plus a fixed cost per kernel.
For the mid-sized projections of these models (2-52 MB) cuBLAS's one-row kernels leave bandwidth unused and some run
a split-K reduction as a second kernel (bench/README.md). Here:

- ``_gemv_kernel``: each program owns BLOCK_N output columns and streams their [BLOCK_N, K] slab of the weight
  once, BLOCK_K at a time (products and a row sum on the CUDA cores, fp32). Small BLOCK_N gives every SM several
  programs, so no split-K. Up to three weights that share the input run in one launch (``q_proj`` +
  ``kv_a_proj``, ``gate_proj`` + ``up_proj``, ``q/k/v_proj``): one kernel's fixed cost instead of three.
- ``_skinny_dot_kernel``: the row (or up to 16 rows) in a 16-row tensor-core tile, wider BLOCK_N; faster for
  weights of 40 MB and more at one row, and for lm_head-sized weights (128 MB and more) at up to 16 rows.
  Its CONV epilogue is Mamba2's conv update: at decode the in projection owns each conv channel's column, so it also
  shifts that channel's state and writes the conv output (one launch).
- ``_gate``: HF's gated RMSNorm (Mamba2, one group) as a prologue of the gemv kernels (``gate=`` of
  ``linear_triton``): Mamba2's norm and out projection in one launch.

On Hopper both launch with programmatic dependent launch (``library.pdl_opts``): a kernel may be scheduled while the
one before it drains; it waits (``library.pdl_start``) before its first load.

``pick_config`` says which (configs from sweeps: bench/TUNING.md, "Linear") or None where cuBLAS is as fast (more
rows, K > 8192: those need a split-K). Reference: ``torch.nn.functional.linear`` (tests/kernels/test_linear.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_kernels.library import interpreting, pdl_opts, pdl_start
from hybrid_kernels.triton_shared import conv_step_load, conv_step_store, silu

#: input dtypes the kernels take (fp32 would run the tensor-core path in tf32)
DTYPES = (torch.bfloat16, torch.float16)
MAX_K = 8192
MAX_GROUP = 3


@triton.jit
def _gate(x, z_ptrs, g_ptrs, ok):
    """Gated RMSNorm as a prologue (HF MambaRMSNormGated, one group): h = x * silu(z) feeds the dot as h * g,
    and the caller sums h^2 over the row as it goes and scales the row's result by rsqrt(mean(h^2) + eps) at the end,
    so the norm costs no pass of its own. h * g stays fp32 (HF rounds the normalised h and its product with g to
    the input dtype before the projection): the same function, more precise."""
    z = tl.load(z_ptrs, mask=ok, other=0.0).to(tl.float32)
    return _weighted(x * silu(z), g_ptrs, ok)


@triton.jit
def _weighted(h, g_ptrs, ok):
    """A norm prologue's two products: h * g feeds the dot, h^2 adds up to the row's mean square."""
    g = tl.load(g_ptrs, mask=ok, other=0.0).to(tl.float32)
    return h * g, h * h


@triton.jit
def _norm_in(x, r_ptrs, s_ptrs, g_ptrs, ok, store, HAS_RES: tl.constexpr, ROUND: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm as a prologue (HF's LlamaRMSNorm / MambaRMSNorm), like ``_gate``: -> (x * g, x^2). HAS_RES: the norm's
    input is first the residual add x + r, rounded to s's dtype (the add's result dtype) and, where ``store``, written
    to s (one program writes it: the graph still reads the sum as the next residual). ROUND: the norm's input is
    rounded to ``dtype`` (the weights' dtype), where HF casts the sum down before the norm."""
    return _weighted(_norm_input(x, r_ptrs, s_ptrs, ok, store, HAS_RES, ROUND, dtype), g_ptrs, ok)


@triton.jit
def _norm_input(x, r_ptrs, s_ptrs, ok, store, HAS_RES: tl.constexpr, ROUND: tl.constexpr, dtype: tl.constexpr):
    """The norm's input t (fp32) from x: + r rounded to s's dtype (stored to s where ``store``), rounded to dtype."""
    if HAS_RES:
        x = (x + tl.load(r_ptrs, mask=ok, other=0.0).to(tl.float32)).to(s_ptrs.dtype.element_ty)
        if store:
            tl.store(s_ptrs, x, mask=ok)
        x = x.to(tl.float32)
    if ROUND:
        x = x.to(dtype).to(tl.float32)
    return x


@triton.jit
def _write_normed(x_ptr, r_ptr, s_ptr, g_ptr, h_ptr, rstd, K, pid, HAS_RES: tl.constexpr, ROUND: tl.constexpr,
                  dtype: tl.constexpr):
    """The norm's output h = g * round(t * rstd) (HF's RMSNorm, rounded as ``add_rms_norm_ref``) written to h_ptr, for
    readers other than the linear (an MoE block's router and experts). Every program holds the same rstd; each writes
    64 columns (a second read of them, from L2), K / 64 programs in all, the first ones, which finish before the last
    wave, so no program adds a serial pass over the whole row to the launch's tail (its cost: bench/norm_group.py)."""
    HB: tl.constexpr = 64
    for k in range(pid * HB, K, tl.num_programs(0) * HB):
        cols = k + tl.arange(0, HB)
        ok = cols < K
        t = _norm_input(tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32), r_ptr + cols, s_ptr + cols, ok,
                        False, HAS_RES, ROUND, dtype)
        hv = t * rstd
        if ROUND:
            hv = hv.to(dtype).to(tl.float32)
        g = tl.load(g_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(h_ptr + cols, (hv * g).to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, y0_ptr, y1_ptr, y2_ptr, b_ptr, z_ptr, g_ptr, eps, N0, N1, N2, K,
                 s0, s1, s2, NUM_W: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                 r_ptr=None, s_ptr=None, NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False,
                 ROUND: tl.constexpr = False, h_ptr=None, WRITE_H: tl.constexpr = False, GLU: tl.constexpr = False):
    """GLU (two weights of N0 rows, gate then up): each program computes the same rows of both and stores
    silu(gate) * up to y0, rounded as the eager ops round (each linear's output, the activation, the product)."""
    pdl_start(PDL)  # launched early (programmatic dependent launch): wait for the kernel before
    pid = tl.program_id(0)
    nb0 = tl.cdiv(N0, BLOCK_N)
    nb1 = tl.cdiv(N1, BLOCK_N)
    # which weight this program's columns belong to (programs of weight 0 first, then 1, then 2)
    w_ptr, y_ptr, N, stride, n0 = w0_ptr, y0_ptr, N0, s0, pid * BLOCK_N
    if NUM_W > 1:
        if pid >= nb0:
            w_ptr, y_ptr, N, stride, n0 = w1_ptr, y1_ptr, N1, s1, (pid - nb0) * BLOCK_N
    if NUM_W > 2:
        if pid >= nb0 + nb1:
            w_ptr, y_ptr, N, stride, n0 = w2_ptr, y2_ptr, N2, s2, (pid - nb0 - nb1) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if GLU:
        u_rows = w1_ptr + rn.to(tl.int64)[:, None] * s1
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + rk
        if EVEN_K:
            x = tl.load(x_ptr + cols).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            if GLU:
                u = tl.load(u_rows + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
            if GLU:
                u = tl.load(u_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :],
                            other=0.0).to(tl.float32)
        if GATED:
            x, h2 = _gate(x, z_ptr + cols, g_ptr + cols, cols < K)
            sq += h2
        if NORM:
            x, h2 = _norm_in(x, r_ptr + cols, s_ptr + cols, g_ptr + cols, cols < K, pid == 0, HAS_RES, ROUND,
                             w0_ptr.dtype.element_ty)
            sq += h2
        acc += w * x[None, :]
        if GLU:
            acc_u += u * x[None, :]
    y = tl.sum(acc, axis=1)
    if GLU:
        y_u = tl.sum(acc_u, axis=1)
    if GATED or NORM:
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + tl.cast(eps, tl.float32))
        y = y * rstd
        if GLU:
            y_u = y_u * rstd
        if WRITE_H:
            _write_normed(x_ptr, r_ptr, s_ptr, g_ptr, h_ptr, rstd, K, pid, HAS_RES, ROUND, w0_ptr.dtype.element_ty)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=row_ok, other=0.0).to(tl.float32)
    if GLU:
        dt = y_ptr.dtype.element_ty
        a = silu(y.to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y = a * y_u.to(dt).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _skinny_dot_acc(x_ptr, w_ptr, M, N, K, stride_x, stride_w, rm, rn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    F32_DOT: tl.constexpr):
    """x [M <= 16, K] times the weight rows rn: a [16, len(rn)] fp32 tile."""
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([16, rn.shape[0]], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + rk
        if EVEN_K:
            x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (cols < K)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        if F32_DOT:  # fp32 inputs (no tf32), and the interpreter (bf16 is unreliable there): exact fp32 products
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit(do_not_specialize=["M"])
def _skinny_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                       st_ptr, cw_ptr, cb_ptr, c_ptr, C0, C, ss_b, ss_c, ss_w, scw_c, scw_k, sc_b,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       F32_DOT: tl.constexpr, PDL: tl.constexpr, CONV: tl.constexpr = False,
                       CONV_BIAS: tl.constexpr = False, KW: tl.constexpr = 1, W: tl.constexpr = 1,
                       WP: tl.constexpr = 1, CONV_ROWS: tl.constexpr = 16):
    """y = x @ w^T (+ bias) for up to 16 rows. CONV: Mamba's depthwise causal conv update as the epilogue (decode):
    output columns C0 .. C0 + C - 1 are conv channels, each owned by one program, which appends the column's value
    (rounded to y's dtype, as HF's projection is) to the channel's state row [W] in place and writes
    silu(conv + conv bias) to c [M, C]; y keeps every column as projected. The conv's loads (state, taps, bias) are
    issued before the main loop, so its only cost at the end is the arithmetic and the stores."""
    pdl_start(PDL)
    rm = tl.arange(0, 16)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = (rm < M)[:, None]
    if CONV:  # the conv's loads go out before the main loop: the epilogue then only computes and stores
        ch = rn - C0
        ch_ok = (ch >= 0) & (ch < C) & (rn < N)
        rc = tl.arange(0, CONV_ROWS)  # one row (decode at batch 1): [1, BLOCK_N] tiles, not 16 rows of registers
        ok = (rc < M)[:, None] & ch_ok[None, :]
        st = st_ptr + rc.to(tl.int64)[:, None] * ss_b + ch[None, :] * ss_c
        shifted, taps = conv_step_load(st, ss_w, ok, cw_ptr + ch[None, :] * scw_c, scw_k, ch_ok[None, :], KW, W, WP)
        conv = tl.zeros([CONV_ROWS, BLOCK_N], dtype=tl.float32)
        if CONV_BIAS:
            conv += tl.load(cb_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)[None, :]
    acc = _skinny_dot_acc(x_ptr, w_ptr, M, N, K, stride_x, stride_w, rm, rn, BLOCK_K, EVEN_K, F32_DOT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], out, mask=m_ok & (rn < N)[None, :])
    if CONV:
        new = out.to(tl.float32)
        if CONV_ROWS == 1:
            new = tl.sum(tl.where(rm[:, None] == 0, new, 0.0), axis=0, keep_dims=True)
        conv = silu(conv_step_store(st, ss_w, ok, shifted, taps, new, conv, W, WP))
        tl.store(c_ptr + rc.to(tl.int64)[:, None] * sc_b + ch[None, :], conv.to(c_ptr.dtype.element_ty), mask=ok)


#: launch configs, each the best of a sweep (bench/linear.py --sweep / --gated / --norm / --glu; bench/TUNING.md):
#: one row below 40 MB, one row from 40 MB, and 2-16 rows of lm_head-sized weights
GEMV = dict(kind="gemv", block_n=4, block_k=512, warps=8, stages=3)
DOT_MID = dict(kind="dot", block_n=32, block_k=128, warps=4, stages=4)
DOT_BIG = dict(kind="dot", block_n=64, block_k=256, warps=4, stages=3)
#: gated norm prologue (Mamba2's out_proj): wider steps, so the x / z / norm-weight loads weigh less per step
GEMV_GATED = dict(kind="gemv", block_n=8, block_k=1024, warps=8, stages=4)
#: RMSNorm prologue, one row
GEMV_NORM = dict(kind="gemv", block_n=8, block_k=512, warps=4, stages=4)
#: gate + up with the GLU epilogue (each program reads the rows of both), one row, both weights 40 MB and more
GEMV_GLU_BIG = dict(kind="gemv", block_n=4, block_k=1024, warps=4, stages=4)


def pick_config(M: int, Ns: list[int], K: int, gated: bool = False, norm: bool = False,
                glu: bool = False) -> dict | None:
    """Launch config for x [M, K] times the weights [N_i, K] (one launch), or None: leave it to cuBLAS.
    2-16 rows: only weights of 128 MB and more (lm_head), where the 16-row tile beats cuBLAS; below that cuBLAS is as
    fast. gated (a gated RMSNorm prologue, one weight): one row, weights below 40 MB (the swept shapes); None means
    the norm kernel, then ``hybrid::linear``. Where each threshold comes from: bench/TUNING.md."""
    if K > MAX_K or not 1 <= len(Ns) <= MAX_GROUP or (gated and len(Ns) != 1):
        return None
    if glu:  # the gemv's epilogue, one row (swept with the norm prologue, the only way passes/glu.py emits it)
        total = sum(Ns) * K * 2
        if M != 1 or (norm and total >= 128 << 20):
            return None
        return GEMV_GLU_BIG if total >= 40 << 20 else GEMV_NORM
    if norm:  # one row, weights below 128 MB: the gemv kernel (the dot kernel's prologue is slower). lm_head-sized
        # weights are slower as this gemv than on the dot kernel (every program rereads the input row), by more than
        # the norm kernel costs: None there, and below one row (the norm kernel, then hybrid::linear)
        return GEMV_NORM if M == 1 and sum(Ns) * K * 2 < 128 << 20 else None
    nbytes = Ns[0] * K * 2
    if gated:  # one row: at 2-16 rows the dot kernel (prologue in the dot operand's layout, redundant per warp) and
        # a multi-row CUDA-core gemv stay far from the bandwidth: cuBLAS
        return GEMV_GATED if M == 1 and nbytes < 40 << 20 else None
    if 1 < M <= 16 and len(Ns) == 1 and nbytes >= 128 << 20:
        return DOT_BIG
    if M != 1:
        return None
    if len(Ns) > 1:
        return GEMV
    return DOT_BIG if nbytes >= 128 << 20 else DOT_MID if nbytes >= 40 << 20 else GEMV


def _launch_opts(cfg: dict, x: torch.Tensor) -> dict:
    """Warps, stages and programmatic dependent launch (``library.pdl``) for a launch of config ``cfg``."""
    return dict(num_warps=cfg["warps"], num_stages=cfg["stages"], **pdl_opts(x))


def linear_triton(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None = None,
                  config: dict | None = None, gate: tuple | None = None, norm: tuple | None = None,
                  glu: bool = False) -> list[torch.Tensor]:
    """x [M, K] (rows contiguous), weights [N_i, K] (rows contiguous; 1-3 of them, gemv: M == 1; bias only with one
    weight) -> [x @ w_i^T (+ bias)] in the weights' dtype.

    gate = (z [M, K] (rows contiguous), norm weight [K], eps): the input is first HF's gated RMSNorm of x
    (one group of K; see ``_gate``), x and z in any float dtype. One weight only.
    norm = (norm weight [K], eps, r, s, round[, h]): the input is first HF's RMSNorm of x, or of x + r when r (like x)
    is given, the sum written to s [M, K] (its dtype: the add's); round: the norm's input rounded to the weights' dtype
    (see ``_norm_in``); h [M, K]: the norm's output written there too (``_write_normed``). The gemv kernel (one row).
    glu (two weights of one shape, gate then up, one row): [silu(x @ gate^T) * (x @ up^T)] instead, one output."""
    M, K = x.shape
    Ns = [w.shape[0] for w in weights]
    cfg = config or pick_config(M, Ns, K, gate is not None, norm is not None, glu)
    assert cfg is not None, f"no Triton config for M={M}, N={Ns}, K={K}: use F.linear"
    assert all(w.shape[1] == K and w.stride(1) == 1 for w in weights) and x.stride(1) == 1, \
        "x and the weights must have contiguous rows of K"
    assert bias is None or len(weights) == 1, "bias only with a single weight"
    assert gate is None or (len(weights) == 1 and gate[0].shape == x.shape and gate[0].stride(1) == 1
                            and gate[1].shape == (K,) and gate[1].stride(0) == 1), "gate: z like x, norm weight [K]"
    assert not glu or (len(weights) == 2 and Ns[0] == Ns[1] and bias is None and gate is None), \
        "glu: gate and up weights of one shape, no bias"
    ys = [torch.empty(M, n, dtype=weights[0].dtype, device=x.device) for n in Ns[:1 if glu else None]]
    if M == 0:
        return ys
    b = bias if bias is not None else x  # a valid pointer, never read
    z, g, eps = gate if gate is not None else (x, x, 0.0)
    even_k = K % cfg["block_k"] == 0
    opts = _launch_opts(cfg, x)
    if cfg["kind"] == "gemv":
        assert M == 1, "the gemv kernel takes one row"
        bn = cfg["block_n"]
        w3, y3, n3 = (weights + [weights[0]] * 2)[:3], (ys + [ys[0]] * 2)[:3], (Ns + [0, 0])[:3]
        grid = (sum(triton.cdiv(n, bn) for n in Ns[:1 if glu else None]),)
        extra = {}
        if norm is not None:
            g, eps, r, s, rnd, *h = norm
            h = h[0] if h else None
            assert gate is None and g.shape == (K,) and g.stride(0) == 1, "norm: weight [K], no gate"
            assert (r is None) == (s is None) and (r is None or r.shape == s.shape == x.shape and
                                                   r.stride(1) == s.stride(1) == 1), "norm: r and s like x"
            assert h is None or (h.shape == x.shape and h.stride(1) == 1), "norm: h like x"
            extra = dict(r_ptr=x if r is None else r, s_ptr=x if s is None else s, NORM=True, HAS_RES=r is not None,
                         ROUND=bool(rnd), h_ptr=x if h is None else h, WRITE_H=h is not None)
        _gemv_kernel[grid](x, *w3, *y3, b, z, g, float(eps), *n3, K, *(w.stride(0) for w in w3),
                           NUM_W=len(weights), HAS_BIAS=bias is not None, GATED=gate is not None, BLOCK_N=bn,
                           BLOCK_K=cfg["block_k"], EVEN_K=even_k, GLU=glu, **extra, **opts)
        return ys
    assert not glu, "glu: the gemv kernel (one row) only"
    assert len(weights) == 1 and M <= 16, "the dot kernel takes one weight and at most 16 rows"
    w, y = weights[0], ys[0]
    assert gate is None and norm is None, "the dot kernel has no norm prologue (the gemv kernel has)"
    bn = max(16, cfg["block_n"])
    _skinny_dot_kernel[(triton.cdiv(Ns[0], bn),)](x, w, b, y, M, Ns[0], K, x.stride(0), w.stride(0), y.stride(0),
                                                  *[x] * 4, *[0] * 8, HAS_BIAS=bias is not None, BLOCK_N=bn,
                                                  BLOCK_K=cfg["block_k"], EVEN_K=even_k,
                                                  F32_DOT=interpreting() or w.dtype == torch.float32, **opts)
    return ys


@triton.jit(do_not_specialize=["n"])
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dt = y_ptr.dtype.element_ty
    a = silu(tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(y_ptr + offs, (a * tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)).to(dt), mask=ok)


def silu_mul_triton(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for contiguous g, u of one shape and dtype, rounded as the eager ops round; one launch (what Inductor
    fuses them into where ``hybrid::norm_linear(glu=True)`` does not take the rows into the gemv kernel)."""
    assert g.shape == u.shape and g.dtype == u.dtype and g.is_contiguous() and u.is_contiguous()
    y = torch.empty_like(g)
    if g.numel():
        _silu_mul_kernel[(triton.cdiv(g.numel(), 1024),)](g, u, y, g.numel(), BLOCK=1024, num_warps=4)
    return y


def conv_config(M: int, N: int, K: int) -> dict | None:
    """Config for the projection + conv-update kernel: where ``pick_config`` takes the rows to the dot kernel."""
    cfg = pick_config(M, [N], K)
    return cfg if cfg is not None and cfg["kind"] == "dot" else None


def linear_conv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                       conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, c0: int,
                       config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x @ weight^T (+ bias), x [M <= 16, K]; then Mamba's causal conv update (silu) on the columns c0 .. c0 + C - 1
    (C = conv_weight.shape[0]): conv_state [M, C, W] (rows = x's rows) updated in place, conv_weight [C, KW],
    KW <= W. -> (y [M, N], silu(conv) [M, C]), in the weight's dtype."""
    M, K = x.shape
    N = weight.shape[0]
    C, KW = conv_weight.shape
    W = conv_state.shape[-1]
    cfg = config or conv_config(M, N, K)
    assert cfg is not None and cfg["kind"] == "dot", f"no dot config for M={M}, N={N}, K={K}"
    assert conv_state.shape[:2] == (M, C) and KW <= W and 0 <= c0 and c0 + C <= N, "conv state / weight shapes"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and the weight must have contiguous rows"
    y = torch.empty(M, N, dtype=weight.dtype, device=x.device)
    out = torch.empty(M, C, dtype=weight.dtype, device=x.device)
    if M == 0:
        return y, out
    opts = _launch_opts(cfg, x)
    bn = max(16, cfg["block_n"])
    _skinny_dot_kernel[(triton.cdiv(N, bn),)](
        x, weight, bias if bias is not None else x, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        conv_state, conv_weight, conv_bias if conv_bias is not None else conv_weight, out, c0, C, *conv_state.stride(),
        *conv_weight.stride(), out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=cfg["block_k"],
        EVEN_K=K % cfg["block_k"] == 0, F32_DOT=interpreting() or weight.dtype == torch.float32, CONV=True,
        CONV_BIAS=conv_bias is not None, KW=KW, W=W, WP=triton.next_power_of_2(W),
        CONV_ROWS=1 if M == 1 else 16, **opts)
    return y, out
