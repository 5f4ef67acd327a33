"""Mamba1 selective scan + selective state update: Triton vs reference on awkward shapes, reference vs HF's
torch paths, continuation (scan then scan, decode steps == prefill), slots and pad rows."""
import numpy as np
import pytest
import torch
from transformers.models.mamba import modeling_mamba as hf1

from hybrid_kernels.library import interpreting
from hybrid_kernels.ssm import reference as ref
from hybrid_kernels.ssm.triton_config import CONFIG
from hybrid_kernels.ssm.triton_scan import selective_scan_triton, selective_state_update_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def fast_interpreter_scan():
    """The interpreter runs tl.associative_scan with a user combine_fn one element at a time in Python
    (~0.1 ms each). Run the same combine_fn once per step along the scan axis, vectorised over the
    other axes: same sequential semantics, ~1000x faster. Also use short chunks so T=257 crosses many."""
    if not interpreting():
        yield
        return
    from triton.runtime import interpreter

    def vectorised_scan(self, inputs):
        data = [np.moveaxis(a.handle.data, self.axis, 0) for a in inputs]
        outs = [np.empty_like(d) for d in data]
        acc = [d[0] for d in data]
        for o, a in zip(outs, acc):
            o[0] = a
        for i in range(1, data[0].shape[0]):
            prev = [self.to_tensor(np.ascontiguousarray(a), x.dtype) for a, x in zip(acc, inputs)]
            cur = [self.to_tensor(np.ascontiguousarray(d[i]), x.dtype) for d, x in zip(data, inputs)]
            res = self.combine_fn.fn(*prev, *cur)
            res = res if isinstance(res, tuple) else (res,)
            acc = [r.handle.data for r in res]
            for o, a in zip(outs, acc):
                o[i] = a
        return [self.to_tensor(np.moveaxis(o, 0, self.axis), x.dtype) for o, x in zip(outs, inputs)]

    old_scan, old_bt = interpreter.ScanOps.generic_scan, CONFIG["scan"]["BLOCK_T"]
    interpreter.ScanOps.generic_scan = vectorised_scan
    CONFIG["scan"]["BLOCK_T"] = 32
    yield
    interpreter.ScanOps.generic_scan = old_scan
    CONFIG["scan"]["BLOCK_T"] = old_bt


def rnd(*shape, dtype=torch.float32, g=None):
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


def close(a, b, tol=1e-4):
    a, b = a.float().cpu(), b.float().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1.0))
    assert err <= tol, f"max error {err:.3e} (tol {tol:.0e})"


def make_inputs(B, D, T, N, g, z=True, Dskip=True, bias=True, init=False):
    """HF-like layouts: B/C are transposed splits of x_proj's output, z a split of in_proj's output."""
    u = rnd(B, D, T, g=g)
    delta = rnd(B, D, T, g=g) * 0.5 - 1.0
    A = -(torch.rand(D, N, generator=g) * 2 + 0.2).to(DEV)
    xproj = rnd(B, T, 3 + 2 * N, g=g)
    Bm, Cm = xproj[..., 3:3 + N].transpose(1, 2), xproj[..., 3 + N:].transpose(1, 2)
    zz = rnd(B, T, 2 * D, g=g)[..., D:].transpose(1, 2) if z else None
    return dict(u=u, delta=delta, A=A, Bm=Bm, Cm=Cm, D=rnd(D, g=g) if Dskip else None, z=zz,
                delta_bias=rnd(D, g=g) * 0.1 if bias else None, delta_softplus=True,
                initial_state=rnd(B, D, N, g=g) if init else None)


@pytest.mark.parametrize("B,D,T,N,init,opts", [
    (1, 24, 257, 8, True, {}),
    (2, 40, 63, 16, False, {}),
    (1, 24, 7, 8, True, dict(z=False, Dskip=False, bias=False)),
    (2, 5, 1, 16, True, {}),
])
def test_selective_scan_triton_vs_ref(B, D, T, N, init, opts):
    g = torch.Generator().manual_seed(T + D)
    kw = make_inputs(B, D, T, N, g, init=init, **opts)
    y, s = selective_scan_triton(**kw)
    y_ref, s_ref = ref.selective_scan_ref(**kw)
    close(y, y_ref)
    close(s, s_ref)
    assert y.dtype == kw["u"].dtype and s.dtype == torch.float32


def test_selective_scan_no_softplus():
    g = torch.Generator().manual_seed(11)
    kw = make_inputs(1, 24, 40, 8, g, init=True)
    kw["delta"] = kw["delta"].abs() * 0.3
    kw["delta_softplus"] = False
    y, s = selective_scan_triton(**kw)
    y_ref, s_ref = ref.selective_scan_ref(**kw)
    close(y, y_ref)
    close(s, s_ref)


@pytest.mark.parametrize("T", [1, 33])
def test_selective_scan_ref_vs_hf(T):
    g = torch.Generator().manual_seed(T)
    kw = make_inputs(2, 12, T, 8, g)
    y_hf, s_hf = hf1.mamba_selective_scan(kw["u"], kw["delta"], kw["A"], kw["Bm"], kw["Cm"], D=kw["D"], z=kw["z"],
                                          delta_bias=kw["delta_bias"], delta_softplus=True, return_last_state=True)
    y, s = ref.selective_scan_ref(**kw)
    close(y, y_hf, 1e-5)
    close(s, s_hf, 1e-5)


def test_selective_state_update_vs_hf():
    g = torch.Generator().manual_seed(2)
    B, D, N = 3, 24, 8
    state = rnd(B, D, N, g=g)
    x, dt, z = rnd(B, D, g=g), rnd(B, D, g=g), rnd(B, D, g=g)
    A, Bm, Cm = -(torch.rand(D, N, generator=g) + 0.2).to(DEV), rnd(B, N, g=g), rnd(B, N, g=g)
    Dk, db = rnd(D, g=g), rnd(D, g=g)
    s_hf, s_ref, s_tri = state.clone(), state.clone(), state.clone()
    y_hf = hf1.mamba_selective_state_update(s_hf, x, dt, A, Bm, Cm, Dk, dt_bias=db, dt_softplus=True, z=z)
    close(ref.selective_state_update_ref(s_ref, x, dt, A, Bm, Cm, Dk, z, db, True, None), y_hf, 1e-5)
    close(selective_state_update_triton(s_tri, x, dt, A, Bm, Cm, Dk, z, db, True, None), y_hf, 1e-5)
    close(s_ref, s_hf, 1e-6)
    close(s_tri, s_hf, 1e-6)


@pytest.mark.parametrize("D,N,opts", [(40, 16, True), (24, 8, False)])
def test_selective_state_update_slots(D, N, opts):
    g = torch.Generator().manual_seed(D)
    S, B = 5, 4
    state = rnd(S, D, N, g=g)
    idx = torch.tensor([3, -1, 0, 4], dtype=torch.int32, device=DEV)
    args = (rnd(B, D, g=g), rnd(B, D, g=g), -(torch.rand(D, N, generator=g) + 0.2).to(DEV), rnd(B, N, g=g),
            rnd(B, N, g=g), rnd(D, g=g) if opts else None, rnd(B, D, g=g) if opts else None,
            rnd(D, g=g) if opts else None, opts, idx)
    s_ref, s_tri = state.clone(), state.clone()
    y_ref = ref.selective_state_update_ref(s_ref, *args)
    y_tri = selective_state_update_triton(s_tri, *args)
    close(y_tri, y_ref)
    close(s_tri, s_ref, 1e-6)
    assert float(y_tri[1].abs().max()) == 0.0
    for untouched in (1, 2):
        close(s_tri[untouched], state[untouched], 0)


@pytest.mark.skipif(DEV != "cuda", reason="bf16 needs a GPU (the interpreter's bf16 is unreliable)")
def test_selective_state_update_bf16_state():
    g = torch.Generator().manual_seed(9)
    S, B, D, N = 4, 4, 64, 16
    state = rnd(S, D, N, g=g, dtype=torch.bfloat16)
    args = (rnd(B, D, g=g, dtype=torch.bfloat16), rnd(B, D, g=g, dtype=torch.bfloat16),
            -(torch.rand(D, N, generator=g) + 0.2).to(DEV), rnd(B, N, g=g, dtype=torch.bfloat16),
            rnd(B, N, g=g, dtype=torch.bfloat16), rnd(D, g=g), None, rnd(D, g=g), True, None)
    s_ref, s_tri = state.clone(), state.clone()
    close(selective_state_update_triton(s_tri, *args), ref.selective_state_update_ref(s_ref, *args), 2e-2)
    close(s_tri, s_ref, 2e-2)


def test_selective_scan_continuation_and_decode():
    """scan(T1) then scan(T2, final state) == scan(T1 + T2); T2 decode steps == the prefill of T2."""
    g = torch.Generator().manual_seed(4)
    B, D, N, T1, T2 = 2, 24, 8, 37, 6
    kw = make_inputs(B, D, T1 + T2, N, g, init=True)
    y_all, s_all = selective_scan_triton(**kw)

    def part(sl, init):
        k = dict(kw, initial_state=init)
        for name in ("u", "delta", "Bm", "Cm", "z"):
            k[name] = kw[name][..., sl]
        return k

    y1, s1 = selective_scan_triton(**part(slice(0, T1), kw["initial_state"]))
    k2 = part(slice(T1, None), s1)
    y2, s2 = selective_scan_triton(**k2)
    close(torch.cat([y1, y2], -1), y_all)
    close(s2, s_all)
    state = s1.clone()
    ys = [selective_state_update_triton(state, k2["u"][..., t], k2["delta"][..., t], kw["A"], k2["Bm"][..., t],
                                        k2["Cm"][..., t], kw["D"], k2["z"][..., t], kw["delta_bias"], True, None)
          for t in range(T2)]
    close(torch.stack(ys, -1), y2)
    close(state, s2)
