"""The one-row linear kernels (hybrid_kernels/linear) vs F.linear: single weights, groups of 2-3 weights sharing the
input, K not a multiple of the block, odd N, bias; the ops' dispatch (Triton only where pick_config takes the
shape, F.linear otherwise). CPU: the Triton interpreter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybrid_kernels  # noqa: F401  (registers the hybrid:: ops)
from hybrid_kernels.linear import triton_gemv as gemv
from hybrid_kernels.linear.triton_gemv import linear_triton, pick_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _data(Ns, K, M, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    ws = [(torch.randn(n, K, generator=g) / K ** 0.5).to(DEV, dtype) for n in Ns]
    return x, ws


def _close(got, x, w, bias=None, tol=1e-5):
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert got.shape == want.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("Ns,K", [((33,), 130), ((72,), 1024), ((24, 9), 72), ((5, 17, 40), 520)])
@pytest.mark.parametrize("block_k", [64, 512])
def test_gemv_matches_linear(Ns, K, block_k):
    x, ws = _data(Ns, K, 1, torch.float32, sum(Ns) + K + block_k)
    cfg = dict(gemv.GEMV, block_k=block_k, block_n=4)
    for y, w in zip(linear_triton(x, ws, config=cfg), ws):
        _close(y, x, w)


def test_gemv_bias_and_bf16():
    x, (w,) = _data((37,), 300, 1, torch.bfloat16, 3)
    bias = torch.randn(37).to(DEV, torch.bfloat16)
    _close(linear_triton(x, [w], bias, config=dict(gemv.GEMV, block_k=128))[0], x, w, bias, tol=2e-2)


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("N,K", [(33, 130), (100, 256)])
def test_dot_kernel_matches_linear(M, N, K):
    x, (w,) = _data((N,), K, M, torch.float32, M * N + K)
    bias = torch.randn(N).to(DEV)
    _close(linear_triton(x, [w], bias, config=dict(gemv.DOT_MID, block_k=64))[0], x, w, bias)


def test_pick_config_leaves_cublas_shapes():
    assert pick_config(1, [2048], 2048) == gemv.GEMV
    assert pick_config(1, [102400], 2048) == gemv.DOT_BIG
    assert pick_config(1, [3072, 576], 2048) == gemv.GEMV
    assert pick_config(2, [2048], 2048) is None          # more rows: cuBLAS, except lm_head-sized weights
    assert pick_config(8, [102400], 2048) == gemv.DOT_BIG
    assert pick_config(17, [102400], 2048) is None      # the dot kernel's tile holds 16 rows
    assert pick_config(1, [2048], 10944) is None         # long K wants a split-K: cuBLAS
    assert pick_config(1, [64] * 4, 256) is None         # at most three weights per launch
    assert pick_config(1, [2560], 5120, gated=True) == gemv.GEMV_GATED
    assert pick_config(8, [2560], 5120, gated=True) is None  # more rows: the norm kernel, then cuBLAS
    assert pick_config(1, [2560, 64], 5120, gated=True) is None
    assert pick_config(1, [3072, 576], 2048, norm=True) == gemv.GEMV_NORM  # the RMSNorm prologue: one row,
    assert pick_config(1, [10944, 10944], 2048, norm=True) == gemv.GEMV_NORM  # groups too,
    assert pick_config(1, [102400], 2048, norm=True) is None  # not an lm_head (the dot kernel after the norm's)
    assert pick_config(2, [2048], 2048, norm=True) is None
    assert pick_config(1, [10944, 10944], 2048, norm=True, glu=True) == gemv.GEMV_GLU_BIG  # GLU: 4 warps, and
    assert pick_config(1, [2816, 2816], 2048, norm=True, glu=True) == gemv.GEMV_NORM      # wide steps when big
    assert pick_config(2, [2816, 2816], 2048, norm=True, glu=True) is None


def test_ops_dispatch(monkeypatch):
    x, ws = _data((24, 9), 72, 1, torch.bfloat16, 5)
    x3 = x.view(1, 1, 72)
    # F.linear where the kernels do not take the call: more rows, fp32, or (on the CPU) no forced interpreter
    x2 = torch.randn(2, 3, 72).to(DEV, torch.bfloat16)
    assert torch.equal(torch.ops.hybrid.linear(x2, ws[0], None), F.linear(x2, ws[0]))
    xf, wf = x3.float(), ws[0].float()
    assert torch.equal(torch.ops.hybrid.linear(xf, wf, None), F.linear(xf, wf))
    if DEV == "cpu":
        assert torch.equal(torch.ops.hybrid.linear(x3, ws[0], None), F.linear(x3, ws[0]))
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    calls = []
    real = gemv._gemv_kernel
    monkeypatch.setattr("hybrid_kernels.linear.triton_gemv._gemv_kernel", _Spy(real, calls))
    y = torch.ops.hybrid.linear(x3, ws[0], None)
    assert y.shape == (1, 1, 24) and len(calls) == 1
    _close(y.view(1, 24), x, ws[0], tol=2e-2)
    ys = torch.ops.hybrid.linear_group(x3, ws)
    assert [t.shape for t in ys] == [(1, 1, 24), (1, 1, 9)] and len(calls) == 2  # one launch for the group
    for t, w in zip(ys, ws):
        _close(t.view(1, -1), x, w, tol=2e-2)


class _Spy:
    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def test_broadcast_bias_takes_f_linear(monkeypatch):
    monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    x, (w,) = _data((8,), 64, 1, torch.bfloat16, 9)
    bias = torch.arange(8.0).to(DEV, torch.bfloat16)[:1]  # F.linear broadcasts a [1] bias
    assert torch.equal(torch.ops.hybrid.linear(x, w, bias), F.linear(x, w, bias))


def _gated_want(x, z, g, eps, w, bias=None):
    from hybrid_kernels.ssm.reference import gated_rms_norm_ref
    h = gated_rms_norm_ref(x.float(), z.float(), g.float(), eps, x.shape[-1])
    return F.linear(h, w.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("N,K,block_k", [(33, 130, 128), (40, 512, 128), (9, 300, 1024)])
def test_gated_prologue_matches_norm_then_linear(N, K, block_k):
    """HF's gated RMSNorm (one group) as the kernels' prologue: x, z with a row stride (z a slice of a wider
    projection, as Mamba2's gate is), bias, fp32 so the comparison is tight."""
    M = 1
    g = torch.Generator().manual_seed(N + K + block_k)
    x = (torch.randn(M, K, generator=g) * 3).to(DEV)
    z = torch.randn(M, K + 7, generator=g).to(DEV)[:, 5:K + 5]
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV)
    bias = torch.randn(N, generator=g).to(DEV)
    got = linear_triton(x, [w], bias, config=dict(gemv.GEMV_GATED, block_k=block_k), gate=(z, nw, 1e-5))[0]
    want = _gated_want(x, z, nw, 1e-5, w, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_gated_norm_linear_op(monkeypatch):
    """The op: fused launch where the kernels take it (one launch, bf16 within rounding of norm-then-linear, fp32
    activations into a bf16 weight); two groups or two rows fall back to the norm op then hybrid::linear."""
    from hybrid_kernels.ssm import ops
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 1, 96, generator=g).to(DEV)
    z = torch.randn(1, 1, 96, generator=g).to(DEV, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(96, generator=g)).to(DEV, torch.bfloat16)
    w = (torch.randn(40, 96, generator=g) / 96 ** 0.5).to(DEV, torch.bfloat16)
    op = torch.ops.hybrid.gated_norm_linear
    want = _gated_want(x, z, nw, 1e-6, w)
    if DEV == "cpu":
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    gated = []
    real = ops.linear_triton
    monkeypatch.setattr(ops, "linear_triton", lambda *a, gate=None, **k: gated.append(gate is not None) or
                        real(*a, gate=gate, **k))
    y = op(x, z, nw, 1e-6, 96, w, None)
    assert y.shape == (1, 1, 40) and y.dtype == torch.bfloat16 and gated == [True]
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    for xs, zs, group in ((x, z, 48), (x.expand(2, 1, 96), z.expand(2, 1, 96), 96)):
        from hybrid_kernels.ssm.reference import gated_rms_norm_ref
        y = op(xs, zs, nw, 1e-6, group, w, None)
        ref = F.linear(gated_rms_norm_ref(xs, zs, nw, 1e-6, group).to(torch.bfloat16), w)
        assert True not in gated[1:] and y.shape == ref.shape
        torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def _conv_case(M, N, K, C, W, KW, seed, bias, conv_bias=None, layout="rows"):
    """x, in_proj weight/bias, the state's backing pool and the state view, conv weight/bias. layout "rows": state
    rows of a cache slot pool, strided along W too; "channels_last": [M, C, W] with the channels innermost."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV)
    b = torch.randn(N, generator=g).to(DEV) if bias else None
    if layout == "rows":
        pool = torch.randn(M + 2, C, W + 2, generator=g).to(DEV)
        state = pool[1:M + 1, :, 1:W + 1]
    else:
        pool = torch.randn(M, W, C, generator=g).to(DEV)
        state = pool.transpose(1, 2)
    cw = torch.randn(C, KW, generator=g).to(DEV)
    cb = torch.randn(C, generator=g).to(DEV) if (bias if conv_bias is None else conv_bias) else None
    return x, w, b, pool, state, cw, cb


@pytest.mark.parametrize("M,N,K,C,c0,W,KW,bias,conv_bias,layout", [
    (1, 70, 130, 40, 9, 4, 4, True, True, "rows"), (3, 64, 96, 33, 16, 5, 4, False, True, "channels_last"),
    (16, 50, 64, 50, 0, 4, 3, True, False, "rows"), (2, 48, 64, 31, 17, 4, 4, False, False, "channels_last")])
def test_dot_conv_epilogue_matches_linear_then_conv(M, N, K, C, c0, W, KW, bias, conv_bias, layout):
    """The projection + conv-update kernel vs F.linear then the conv update's reference: projection, conv output and
    the state (shifted in place through a strided view; the pool around it untouched). Conv channels straddle
    program tiles."""
    from hybrid_kernels.ssm.reference import causal_conv1d_update_ref
    x, w, b, pool, state, cw, cb = _conv_case(M, N, K, C, W, KW, M * N + C, bias, conv_bias, layout)
    want_pool = pool.clone()
    want_state = want_pool[1:M + 1, :, 1:W + 1] if layout == "rows" else want_pool.transpose(1, 2)
    want_y = F.linear(x, w, b)
    want_c = causal_conv1d_update_ref(want_y[:, c0:c0 + C], want_state, cw, cb, "silu", None)
    y, c = gemv.linear_conv_triton(x, w, b, state, cw, cb, c0, config=dict(gemv.DOT_MID, block_n=16,
                                                                                block_k=64))
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c, want_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, want_pool, rtol=1e-5, atol=1e-5)  # the new column: our projection


def test_linear_conv_op(monkeypatch):
    """The op (bf16): fused where the dot kernel takes the projection, the two ops otherwise; both agree with
    F.linear + the conv reference in fp32, and both update the state in place."""
    from hybrid_kernels.ssm import ops
    from hybrid_kernels.ssm.reference import causal_conv1d_update_ref
    x, w, b, pool, state, cw, cb = (t.to(torch.bfloat16) for t in _conv_case(1, 70, 130, 40, 4, 4, 5, True))
    state = pool[1:2, :, 1:5]
    if DEV == "cpu":
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    fused = []
    real = ops.linear_conv_triton
    monkeypatch.setattr(ops, "linear_conv_triton", lambda *a, **k: fused.append(1) or real(*a, **k))
    for take in (True, False):
        monkeypatch.setattr(ops, "conv_config", lambda M, N, K: dict(gemv.DOT_MID, block_k=64) if take else None)
        want_pool = pool.float()
        want_y = F.linear(x.float(), w.float(), b.float())
        want_c = causal_conv1d_update_ref(want_y[:, 9:49], want_pool[1:2, :, 1:5], cw.float(), cb.float(), "silu",
                                          None)
        y, c = torch.ops.hybrid.linear_conv(x.view(1, 1, -1), w, b, state, cw, cb, 9)
        assert len(fused) == 1 and y.shape == (1, 1, 70) and c.shape == (1, 40) and c.dtype == torch.bfloat16
        for got, want in ((y.view(1, -1), want_y), (c, want_c), (pool, want_pool)):
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def _norm_want(x, r, nw, eps, round_input, ws, bias=None, normed=False):
    """RMSNorm (of x + r) by its torch reference, then F.linear in fp32; and the sum (and the norm's output)."""
    from hybrid_kernels.linear.reference import add_rms_norm_ref
    h, s = add_rms_norm_ref(x, r, nw, eps, round_input, ws[0].dtype)
    ys = [F.linear(h.float(), w.float(), None if bias is None else bias.float()) for w in ws]
    return (ys, s, h) if normed else (ys, s)


@pytest.mark.parametrize("Ns,K,block_k,res,rnd", [
    ((33,), 130, 64, None, False), ((40, 9), 520, 512, torch.float32, True), ((5, 17, 40), 72, 64, torch.bfloat16, True),
    ((24,), 300, 1024, torch.bfloat16, False), ((40, 9, 17), 1024, 512, torch.bfloat16, True),
    ((33,), 512, 512, torch.float32, True)])
def test_norm_prologue_matches_norm_then_linear(Ns, K, block_k, res, rnd):
    """HF's RMSNorm (of the residual add x + r) as the gemv kernel's prologue: groups of 1-3 weights, K not a
    multiple of the block (and multiples), the sum written in the add's dtype (fp32 residual stream + bf16 output, or bf16 + bf16),
    the norm's input rounded to the weights' dtype or not; the norm's output written too (for other readers). bf16
    weights; the interpreter rounds bf16 stores down, so the sum and the norm's output are compared within one bf16
    step."""
    g = torch.Generator().manual_seed(K + block_k)
    x = (torch.randn(1, K, generator=g) * 3).to(DEV, res or torch.bfloat16)
    r = None if res is None else torch.randn(1, K, generator=g).to(DEV, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, torch.bfloat16)
    ws = [(torch.randn(n, K, generator=g) / K ** 0.5).to(DEV, torch.bfloat16) for n in Ns]
    bias = torch.randn(Ns[0], generator=g).to(DEV, torch.bfloat16) if len(Ns) == 1 else None
    s = None if r is None else torch.empty(1, K, dtype=torch.promote_types(x.dtype, r.dtype), device=DEV)
    h = torch.full((1, K), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = linear_triton(x, ws, bias, config=dict(gemv.GEMV_NORM, block_k=block_k),
                        norm=(nw, 1e-5, r, s, rnd, h))
    want, want_s, want_h = _norm_want(x, r, nw, 1e-5, rnd, ws, bias, normed=True)
    for y, t in zip(got, want):
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), t, rtol=2e-2, atol=2e-2 * t.abs().max().item())
    if s is not None:
        assert s.dtype == want_s.dtype
        torch.testing.assert_close(s.float(), want_s.float(), rtol=1e-2, atol=0)
    torch.testing.assert_close(h.float(), want_h.float(), rtol=2e-2, atol=1e-2)


def test_norm_linear_op(monkeypatch):
    """The op: one launch at one row (the prologue), [ys..., sum]; at three rows the row-wise norm kernel, then
    hybrid::linear / linear_group; both within bf16 rounding of the reference; no residual: no sum."""
    from hybrid_kernels.linear import ops
    if DEV == "cpu":
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    fused = []
    real = ops.linear_triton
    monkeypatch.setattr(ops, "linear_triton", lambda *a, norm=None, **k: fused.append(norm is not None) or
                        real(*a, norm=norm, **k))
    g = torch.Generator().manual_seed(5)
    K = 96
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, torch.bfloat16)
    ws = [(torch.randn(n, K, generator=g) / K ** 0.5).to(DEV, torch.bfloat16) for n in (40, 24)]
    for rows in (1, 3):
        x = torch.randn(rows, 1, K, generator=g).to(DEV)  # an fp32 residual stream
        r = torch.randn(rows, 1, K, generator=g).to(DEV, torch.bfloat16)
        fused.clear()
        out = torch.ops.hybrid.norm_linear(x, r, nw, 1e-6, True, ws, None)
        want, want_s = _norm_want(x, r, nw, 1e-6, True, ws)
        assert [o.shape for o in out] == [(rows, 1, 40), (rows, 1, 24), (rows, 1, K)]
        assert out[2].dtype == torch.float32 and fused == ([True] if rows == 1 else [])
        for y, t in zip(out, want):
            torch.testing.assert_close(y.float(), t, rtol=2e-2, atol=2e-2 * t.abs().max().item())
        torch.testing.assert_close(out[2], want_s)
        out = torch.ops.hybrid.norm_linear(x, r, nw, 1e-6, True, ws, None, True)  # + the norm's output
        want, _, want_h = _norm_want(x, r, nw, 1e-6, True, ws, normed=True)
        assert len(out) == 4 and out[3].shape == (rows, 1, K) and out[3].dtype == torch.bfloat16
        torch.testing.assert_close(out[3].float(), want_h.float(), rtol=1e-2, atol=1e-2)
    out = torch.ops.hybrid.norm_linear(x[:1].to(torch.bfloat16), None, nw, 1e-6, False, ws[:1], None)
    assert len(out) == 1 and out[0].shape == (1, 1, 40)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("N,K,res,normed", [(37, 130, torch.float32, True), (40, 512, None, False),
                                            (24, 300, torch.bfloat16, True)])
def test_norm_linear_glu(rows, N, K, res, normed, monkeypatch):
    """norm_linear(glu=True): a gated MLP's silu(gate) * up from the norm's output, the gemv kernel's epilogue at one
    row (one output instead of two, then the sum and the norm's output as before), the norm kernel + linears + one
    silu * mul launch at three rows; odd N, K not a multiple of the block; against the eager ops in fp32 on the
    reference norm (bf16 weights)."""
    from hybrid_kernels.linear import ops
    if DEV == "cpu":
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    glu_launches = []
    real = ops.linear_triton
    monkeypatch.setattr(ops, "linear_triton", lambda *a, glu=False, **k: glu_launches.append(glu) or
                        real(*a, glu=glu, **k))
    g = torch.Generator().manual_seed(N + K)
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, torch.bfloat16)
    ws = [(torch.randn(N, K, generator=g) / K ** 0.5 * 3).to(DEV, torch.bfloat16) for _ in range(2)]
    x = torch.randn(rows, 1, K, generator=g).to(DEV, res or torch.bfloat16)
    r = None if res is None else torch.randn(rows, 1, K, generator=g).to(DEV, torch.bfloat16)
    out = torch.ops.hybrid.norm_linear(x, r, nw, 1e-6, True, ws, None, normed, True)
    (gate, up), want_s, want_h = _norm_want(x, r, nw, 1e-6, True, ws, normed=True)
    want = F.silu(gate.to(torch.bfloat16)) * up.to(torch.bfloat16)
    assert [o.shape for o in out] == [(rows, 1, N)] + [(rows, 1, K)] * ((r is not None) + normed)
    assert glu_launches == ([True] if rows == 1 else [])
    torch.testing.assert_close(out[0].float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
    if r is not None:
        torch.testing.assert_close(out[1], want_s)
    if normed:
        torch.testing.assert_close(out[-1].float(), want_h.float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="two weights of one shape"):
        torch.ops.hybrid.norm_linear(x, r, nw, 1e-6, True, [ws[0], ws[1][:-1]], None, normed, True)


def test_add_rms_norm_kernel_matches_reference():
    """The row-wise fallback kernel: rows of odd width, fp32 + bf16 and bf16 + bf16 sums, rounding on and off."""
    from hybrid_kernels.linear.reference import add_rms_norm_ref
    from hybrid_kernels.linear.triton_norm import add_rms_norm_triton
    g = torch.Generator().manual_seed(9)
    for xdt, rdt, rnd in ((torch.float32, torch.bfloat16, True), (torch.bfloat16, torch.bfloat16, False),
                          (torch.float32, None, False)):
        x = (torch.randn(5, 130, generator=g) * 2).to(DEV, xdt)
        r = None if rdt is None else torch.randn(5, 130, generator=g).to(DEV, rdt)
        nw = (1 + 0.1 * torch.randn(130, generator=g)).to(DEV, torch.bfloat16)
        h, s = add_rms_norm_triton(x, r, nw, 1e-5, rnd, torch.bfloat16)
        wh, ws = add_rms_norm_ref(x, r, nw, 1e-5, rnd, torch.bfloat16)
        torch.testing.assert_close(h.float(), wh.float(), rtol=2e-2, atol=2e-2)
        assert (s is None) == (ws is None)
        if s is not None:
            torch.testing.assert_close(s.float(), ws.float(), rtol=1e-2, atol=0)
