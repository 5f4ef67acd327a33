"""Mamba2 SSD chunked scan + state update: Triton vs reference on awkward shapes (T across chunk
boundaries, odd P/H, G = 1 and 3, both C.B^T variants), reference vs HF's mamba2_chunk_scan and
mamba2_selective_state_update, independence from chunk_size, continuation and decode == prefill."""
import pytest
import torch
from transformers.models.mamba2 import modeling_mamba2 as hf2

from hybrid_kernels.ssm import reference as ref
from hybrid_kernels.ssm.triton_config import CONFIG
from hybrid_kernels.ssm.triton_ssd import ssd_scan_triton, ssd_state_update_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INF = float("inf")


def rnd(*shape, dtype=torch.float32, g=None):
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


def close(a, b, tol=1e-4):
    a, b = a.float().cpu(), b.float().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1.0))
    assert err <= tol, f"max error {err:.3e} (tol {tol:.0e})"


@pytest.fixture(autouse=True)
def callers_chunk(monkeypatch):
    """The tests pick chunk lengths (to cross chunk edges at small T): honour them, not the tuned CHUNK."""
    monkeypatch.setitem(CONFIG["ssd"], "CHUNK", 0)


@pytest.fixture(params=[True, False], ids=["cb", "no_cb"])
def cb_variant(request):
    old = CONFIG["ssd"]["CB"]
    CONFIG["ssd"]["CB"] = request.param
    yield request.param
    CONFIG["ssd"]["CB"] = old


def make_inputs(B, T, H, P, G, N, g, init=False, z=False, Dskip=True, bias=True):
    """HF-like layouts: x, B, C are views of one conv output row, dt a split of in_proj's output."""
    xbc = rnd(B, T, H * P + 2 * G * N, g=g)
    x = xbc[..., :H * P].view(B, T, H, P)
    Bm = xbc[..., H * P:H * P + G * N].view(B, T, G, N)
    Cm = xbc[..., H * P + G * N:].view(B, T, G, N)
    dt = rnd(B, T, H + 3, g=g)[..., 3:] * 0.5
    A = -(torch.rand(H, generator=g) * 2 + 0.3).to(DEV)
    return dict(x=x, dt=dt, A=A, Bm=Bm, Cm=Cm, D=rnd(H, g=g) if Dskip else None,
                z=rnd(B, T, H, P, g=g) if z else None, dt_bias=rnd(H, g=g) * 0.5 if bias else None,
                dt_softplus=True, dt_min=0.0, dt_max=INF, initial_states=rnd(B, H, P, N, g=g) if init else None)


@pytest.mark.parametrize("B,T,H,P,G,N,chunk,init,z", [
    (1, 257, 3, 12, 1, 16, 64, True, False),
    (2, 63, 6, 12, 3, 8, 16, False, True),
    (1, 7, 4, 16, 2, 16, 32, True, True),
    (2, 1, 3, 12, 3, 8, 16, True, False),
])
def test_ssd_triton_vs_ref(cb_variant, B, T, H, P, G, N, chunk, init, z):
    g = torch.Generator().manual_seed(T + H)
    kw = make_inputs(B, T, H, P, G, N, g, init=init, z=z)
    y, s = ssd_scan_triton(chunk_size=chunk, **kw)
    y_ref, s_ref = ref.ssd_scan_ref(chunk_size=chunk, **kw)
    close(y, y_ref)
    close(s, s_ref)
    assert y.shape == kw["x"].shape and y.dtype == kw["x"].dtype and s.dtype == torch.float32


def test_ssd_triton_options():
    """No D, no dt bias, no softplus, an active dt clamp."""
    g = torch.Generator().manual_seed(3)
    kw = make_inputs(1, 45, 3, 12, 1, 8, g, init=True, Dskip=False, bias=False)
    kw.update(dt=kw["dt"].abs(), dt_softplus=False, dt_min=0.05, dt_max=0.4)
    y, s = ssd_scan_triton(chunk_size=16, **kw)
    y_ref, s_ref = ref.ssd_scan_ref(chunk_size=16, **kw)
    close(y, y_ref)
    close(s, s_ref)


@pytest.mark.parametrize("T,G,init", [(37, 3, True), (64, 1, False)])
def test_ssd_ref_vs_hf(T, G, init):
    g = torch.Generator().manual_seed(T)
    kw = make_inputs(2, T, 6, 4, G, 8, g, init=init)
    y_hf, s_hf = hf2.mamba2_chunk_scan(kw["x"], kw["dt"], kw["A"], kw["Bm"], kw["Cm"], 16, D=kw["D"],
                                       dt_bias=kw["dt_bias"], initial_states=kw["initial_states"],
                                       dt_softplus=True, dt_limit=(0.01, 2.0), return_final_states=True)
    kw.update(dt_min=0.01, dt_max=2.0)
    y, s = ref.ssd_scan_ref(chunk_size=16, **kw)
    close(y, y_hf, 1e-5)
    close(s, s_hf, 1e-5)


def test_ssd_chunk_size_independence():
    g = torch.Generator().manual_seed(8)
    kw = make_inputs(1, 100, 3, 12, 1, 16, g, init=True, z=True)
    outs = [ssd_scan_triton(chunk_size=c, **kw) for c in (16, 32, 64)]
    refs = [ref.ssd_scan_ref(chunk_size=c, **kw) for c in (8, 100)]
    for y, s in outs[1:] + refs:
        close(y, outs[0][0])
        close(s, outs[0][1])


def test_ssd_state_update_vs_hf():
    """HF's decode call expands dt/A/D/dt_bias over the head dim; ours takes them per head."""
    g = torch.Generator().manual_seed(4)
    B, H, P, G, N = 3, 6, 12, 3, 8
    state = rnd(B, H, P, N, g=g)
    x, dt, Bm, Cm = rnd(B, H, P, g=g), rnd(B, H, g=g), rnd(B, G, N, g=g), rnd(B, G, N, g=g)
    A, Dk, db = -(torch.rand(H, generator=g) + 0.3).to(DEV), rnd(H, g=g), rnd(H, g=g)
    s_hf, s_ref, s_tri = state.clone(), state.clone(), state.clone()
    y_hf = hf2.mamba2_selective_state_update(
        s_hf, x, dt[..., None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N), Bm, Cm,
        Dk[:, None].expand(-1, P), dt_bias=db[:, None].expand(-1, P), dt_softplus=True)
    args = (x, dt, A, Bm, Cm, Dk, None, db, True, 0.0, INF, None)
    close(ref.ssd_state_update_ref(s_ref, *args), y_hf, 1e-5)
    close(ssd_state_update_triton(s_tri, *args), y_hf, 1e-5)
    close(s_ref, s_hf, 1e-6)
    close(s_tri, s_hf, 1e-6)
    # A given as HF's A_log parameter (A = -exp(A_log), computed in the kernel): same step
    a_log = torch.log(-A)
    s_ref2, s_tri2 = state.clone(), state.clone()
    args_log = (x, dt, a_log, Bm, Cm, Dk, None, db, True, 0.0, INF, None, True)
    close(ref.ssd_state_update_ref(s_ref2, *args_log), y_hf, 1e-5)
    close(ssd_state_update_triton(s_tri2, *args_log), y_hf, 1e-5)
    close(s_tri2, s_hf, 1e-6)


def test_ssd_state_update_slots():
    g = torch.Generator().manual_seed(6)
    S, B, H, P, G, N = 5, 4, 3, 12, 3, 16
    state = rnd(S, H, P, N, g=g)
    idx = torch.tensor([2, 4, -1, 0], dtype=torch.int32, device=DEV)
    args = (rnd(B, H, P, g=g), rnd(B, H, g=g), -(torch.rand(H, generator=g) + 0.3).to(DEV), rnd(B, G, N, g=g),
            rnd(B, G, N, g=g), rnd(H, g=g), rnd(B, H, P, g=g), rnd(H, g=g), True, 0.01, 1.5, idx)
    s_ref, s_tri = state.clone(), state.clone()
    y_ref = ref.ssd_state_update_ref(s_ref, *args)
    y_tri = ssd_state_update_triton(s_tri, *args)
    close(y_tri, y_ref)
    close(s_tri, s_ref, 1e-6)
    assert float(y_tri[2].abs().max()) == 0.0
    for untouched in (1, 3):
        close(s_tri[untouched], state[untouched], 0)


@pytest.mark.skipif(DEV != "cuda", reason="bf16 needs a GPU (the interpreter's bf16 is unreliable)")
def test_ssd_bf16():
    g = torch.Generator().manual_seed(12)
    kw = make_inputs(1, 1000, 8, 64, 1, 128, g, init=True)
    kw_bf = {k: (v.bfloat16() if isinstance(v, torch.Tensor) and k in ("x", "dt", "Bm", "Cm") else v)
             for k, v in kw.items()}
    y, s = ssd_scan_triton(chunk_size=256, **kw_bf)
    y_ref, s_ref = ref.ssd_scan_ref(chunk_size=256, **kw_bf)
    close(y, y_ref, 3e-2)
    close(s, s_ref, 3e-2)


def test_ssd_continuation_and_decode():
    """scan(T1) then scan(T2, final) == scan(T1 + T2); T2 decode steps == the prefill of T2."""
    g = torch.Generator().manual_seed(10)
    B, H, P, G, N, T1, T2 = 2, 3, 12, 1, 16, 41, 5
    kw = make_inputs(B, T1 + T2, H, P, G, N, g, init=True, z=True)
    y_all, s_all = ssd_scan_triton(chunk_size=16, **kw)

    def part(sl, init):
        k = dict(kw, initial_states=init)
        for name in ("x", "dt", "Bm", "Cm", "z"):
            k[name] = kw[name][:, sl]
        return k

    y1, s1 = ssd_scan_triton(chunk_size=16, **part(slice(0, T1), kw["initial_states"]))
    k2 = part(slice(T1, None), s1)
    y2, s2 = ssd_scan_triton(chunk_size=16, **k2)
    close(torch.cat([y1, y2], 1), y_all)
    close(s2, s_all)
    state = s1.clone()
    ys = [ssd_state_update_triton(state, k2["x"][:, t], k2["dt"][:, t], kw["A"], k2["Bm"][:, t], k2["Cm"][:, t],
                                  kw["D"], k2["z"][:, t], kw["dt_bias"], True, 0.0, INF, None) for t in range(T2)]
    close(torch.stack(ys, 1), y2)
    close(state, s2)


@pytest.mark.parametrize("block_p,block_n", [(16, 16), (32, 16), (None, None)], ids=["16x16", "32x16", "default"])
def test_ssd_states_split_into_tiles(monkeypatch, block_p, block_n):
    """The sequential states kernel split over several (P, N) tiles per head, ragged at both edges; "default"
    takes the shipped tile, halved in N because only B * H = 6 programs would run."""
    if block_p is not None:
        monkeypatch.setitem(CONFIG["ssd"], "STATE_BLOCK_P", block_p)
        monkeypatch.setitem(CONFIG["ssd"], "STATE_BLOCK_N", block_n)
    g = torch.Generator().manual_seed(3)
    kw = make_inputs(2, 77, 3, 40, 1, 40 if block_p else 80, g, init=True, z=True)
    y, s = ssd_scan_triton(chunk_size=32, **kw)
    y_ref, s_ref = ref.ssd_scan_ref(chunk_size=32, **kw)
    close(y, y_ref)
    close(s, s_ref)
