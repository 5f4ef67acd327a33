"""SSM ops as ``hybrid::`` ops: gated RMSNorm (Triton / reference / HF), every op through the dispatcher,
under fake tensors on both paths (no value-dependent code), one torch.compile on the CPU, and a compile of
every kernel for sm_90 through Triton's CUDA backend + ptxas (catches what the interpreter accepts but a GPU
compile rejects)."""
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.mamba2 import modeling_mamba2

import hybrid_kernels.ssm  # noqa: F401  (registers torch.ops.hybrid.*)
from hybrid_kernels.ssm import reference as ref
from hybrid_kernels.ssm.triton_norm import gated_rms_norm_triton

#: HF's gated RMSNorm (renamed Mamba2RMSNormGated in transformers 5.25)
MambaRMSNormGated = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
INF = float("inf")


def rnd(*shape, dtype=torch.float32, g=None):
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


def close(a, b, tol=1e-5):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1.0))
    assert err <= tol, f"max error {err:.3e} (tol {tol:.0e})"


def hf_gated_norm(hidden: int, group_size: int, eps: float):
    """HF's gated norm and the group size it applies: transformers 5.1x normalises the whole row."""
    if "group_size" in inspect.signature(MambaRMSNormGated.__init__).parameters:
        return MambaRMSNormGated(hidden, group_size, eps=eps), group_size
    return MambaRMSNormGated(hidden, eps=eps), hidden


@pytest.mark.parametrize("shape,gs,gate", [((2, 7, 48), 16, True), ((5, 40), 40, False), ((3, 2, 1, 24), 6, True)])
def test_gated_rms_norm(shape, gs, gate):
    g = torch.Generator().manual_seed(gs)
    x = rnd(*shape, g=g)
    z = rnd(*shape[:-1], shape[-1] + 8, g=g)[..., 8:] if gate else None  # a strided split, like HF's gate
    norm, gs = hf_gated_norm(shape[-1], gs, 1e-5)
    norm = norm.to(DEV)
    norm.weight.data = rnd(shape[-1], g=g)
    y_hf = norm(x, z)
    close(ref.gated_rms_norm_ref(x, z, norm.weight, 1e-5, gs), y_hf, 0)
    close(gated_rms_norm_triton(x, z, norm.weight, 1e-5, gs), y_hf)


@pytest.mark.parametrize("xd,wd", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                   (torch.float32, torch.bfloat16)])
def test_gated_rms_norm_ref_dtypes_vs_hf(xd, wd):
    g = torch.Generator().manual_seed(1)
    x, z = rnd(3, 32, g=g).to(xd), rnd(3, 32, g=g).to(xd)
    norm, gs = hf_gated_norm(32, 16, 1e-6)
    norm.weight.data = torch.randn(32, generator=g).to(wd)
    norm = norm.to(DEV)
    y_hf, y = norm(x, z), ref.gated_rms_norm_ref(x, z, norm.weight, 1e-6, gs)
    assert y.dtype == y_hf.dtype
    close(y, y_hf, 0)


def _op_cases(g):
    """(op name, args, names of mutated args) for every op, small shapes."""
    B, C, T, K, D, N, H, P, G = 2, 12, 9, 4, 8, 4, 4, 8, 2
    idx = torch.tensor([1, -1], dtype=torch.int32, device=DEV)
    return [
        ("causal_conv1d", (rnd(B, C, T, g=g), rnd(C, K, g=g), rnd(C, g=g), rnd(B, C, K, g=g), "silu", K), ()),
        ("causal_conv1d_update", (rnd(B, C, g=g), rnd(3, C, K, g=g), rnd(C, K, g=g), None, "silu", idx), (1,)),
        ("selective_scan", (rnd(B, D, T, g=g), rnd(B, D, T, g=g), -torch.rand(D, N, generator=g).to(DEV) - 0.2,
                            rnd(B, N, T, g=g), rnd(B, N, T, g=g), rnd(D, g=g), rnd(B, D, T, g=g), rnd(D, g=g),
                            True, rnd(B, D, N, g=g)), ()),
        ("selective_state_update", (rnd(3, D, N, g=g), rnd(B, D, g=g), rnd(B, D, g=g),
                                    -torch.rand(D, N, generator=g).to(DEV) - 0.2, rnd(B, N, g=g), rnd(B, N, g=g),
                                    rnd(D, g=g), None, rnd(D, g=g), True, idx), (0,)),
        ("ssd_scan", (rnd(B, T, H, P, g=g), rnd(B, T, H, g=g), -torch.rand(H, generator=g).to(DEV) - 0.3,
                      rnd(B, T, G, N, g=g), rnd(B, T, G, N, g=g), 16, rnd(H, g=g), None, rnd(H, g=g), True, 0.0,
                      INF, rnd(B, H, P, N, g=g)), ()),
        ("ssd_state_update", (rnd(3, H, P, N, g=g), rnd(B, H, P, g=g), rnd(B, H, g=g),
                              -torch.rand(H, generator=g).to(DEV) - 0.3, rnd(B, G, N, g=g), rnd(B, G, N, g=g),
                              rnd(H, g=g), rnd(B, H, P, g=g), rnd(H, g=g), True, 0.0, INF, idx), (0,)),
        ("gated_rms_norm", (rnd(B, T, 16, g=g), rnd(B, T, 16, g=g), rnd(16, g=g), 1e-5, 8), ()),
    ]


REFS = {"causal_conv1d": ref.causal_conv1d_ref, "causal_conv1d_update": ref.causal_conv1d_update_ref,
        "selective_scan": ref.selective_scan_ref, "selective_state_update": ref.selective_state_update_ref,
        "ssd_scan": ref.ssd_scan_ref, "ssd_state_update": ref.ssd_state_update_ref,
        "gated_rms_norm": ref.gated_rms_norm_ref}


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def test_ops_match_references():
    """torch.ops.hybrid.* (reference body on the CPU, Triton on a GPU) == the references, outputs and
    mutated states alike."""
    for name, args, mutated in _op_cases(torch.Generator().manual_seed(0)):
        a_op, a_ref = _clone(args), _clone(args)
        out = getattr(torch.ops.hybrid, name)(*a_op)
        exp = REFS[name](*a_ref)
        for o, e in zip(out if isinstance(out, tuple) else (out,), exp if isinstance(exp, tuple) else (exp,)):
            close(o, e, 1e-4)
        for i in mutated:
            close(a_op[i], a_ref[i], 1e-5)


@pytest.mark.parametrize("triton_path", [False, True], ids=["reference", "triton"])
def test_ops_under_fake_tensors(triton_path, monkeypatch):
    """Both op bodies run on fake tensors (what torch.compile / export do): nothing reads values, and the
    output shapes and dtypes match the real run. On the CPU the Triton path is forced with
    HYBRID_TRITON_ON_CPU and its launches are captured instead of run (the interpreter would launch
    even on fake tensors; on a GPU wrap_triton's fake path skips the launch itself)."""
    from hybrid_kernels.ssm import triton_conv as conv
    from hybrid_kernels.ssm import triton_norm as norm
    from hybrid_kernels.ssm import triton_scan as scan
    from hybrid_kernels.ssm import triton_ssd as ssd

    if triton_path and DEV == "cpu":
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
        launches = []

        class _Capture:
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                return lambda *a, **kw: launches.append(self.kernel.__name__)

        for mod in (conv, scan, ssd, norm):
            monkeypatch.setattr(mod, "wrap_triton", _Capture)
    cases = _op_cases(torch.Generator().manual_seed(0))
    reals = [REFS[name](*_clone(args)) for name, args, _ in cases]
    with FakeTensorMode() as mode:
        for (name, args, _), real in zip(cases, reals):
            fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            outs = [getattr(torch.ops.hybrid, name)(*fargs)]
            if name == "ssd_scan":  # its registered fake is shape-only: the body (what Inductor lowers) runs too
                outs.append((ssd.ssd_scan_triton if triton_path else REFS[name])(*fargs))
            for out in outs:
                for o, e in zip(out if isinstance(out, tuple) else (out,), real if isinstance(real, tuple) else (real,)):
                    assert o.shape == e.shape and o.dtype == e.dtype, (name, o.shape, e.shape, o.dtype, e.dtype)
    if triton_path and DEV == "cpu":
        assert len(launches) >= len(cases), launches


def test_torch_compile_decode_step():
    """One compile: a Mamba2 decode step (conv update + SSD state update, both mutating cache inputs, then
    the gated norm) under torch.compile == eager, caches included."""
    g = torch.Generator().manual_seed(2)
    B, H, P, G, N, K = 2, 4, 8, 1, 8, 4
    C = H * P + 2 * G * N
    conv_w, conv_b, A, Dk, db, nw = (rnd(C, K, g=g), rnd(C, g=g), -torch.rand(H, generator=g).to(DEV) - 0.3,
                                     rnd(H, g=g), rnd(H, g=g), rnd(H * P, g=g))

    def step(xbc, dt, z, conv_state, ssm_state, idx):
        xbc = torch.ops.hybrid.causal_conv1d_update(xbc, conv_state, conv_w, conv_b, "silu", idx)
        x, Bm, Cm = torch.split(xbc, [H * P, G * N, G * N], dim=-1)
        y = torch.ops.hybrid.ssd_state_update(ssm_state, x.view(B, H, P), dt, A, Bm.view(B, G, N),
                                              Cm.view(B, G, N), Dk, None, db, True, 0.0, INF, idx)
        return torch.ops.hybrid.gated_rms_norm(y.view(B, H * P), z, nw, 1e-5, H * P)

    inputs = (rnd(B, C, g=g), rnd(B, H, g=g), rnd(B, H * P, g=g), rnd(3, C, K, g=g), rnd(3, H, P, N, g=g),
              torch.tensor([2, 0], dtype=torch.int32, device=DEV))
    eager_in, comp_in = _clone(inputs), _clone(inputs)
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):  # the second call runs on the states the first one wrote
        close(compiled(*comp_in), step(*eager_in), 1e-5)
    close(comp_in[3], eager_in[3], 1e-6)
    close(comp_in[4], eager_in[4], 1e-6)


def test_mamba2_decode_step_fused_projections(monkeypatch):
    """hybrid::mamba2_mixer_step at one row (bf16) with its projections fused, the in projection + conv update
    (dot kernel, forced: the tiny weight would take the gemv) and the gated norm + out projection (gemv prologue),
    vs the same step on the reference ops: output and both states, which the step writes in place."""
    from hybrid_kernels.linear import triton_gemv as lin_kernels
    from hybrid_kernels.ssm import ops as ssm_ops
    from hybrid_kernels.ssm.spec import Mamba2Spec, Mamba2Weights
    g = torch.Generator().manual_seed(5)
    Hd, H, P, G, N, K = 48, 4, 16, 1, 16, 4
    d_inner, C = H * P, H * P + 2 * G * N
    bf = torch.bfloat16
    args = dict(hidden=rnd(1, 1, Hd, dtype=bf, g=g), in_proj_w=(rnd(d_inner + C + H, Hd, g=g) / Hd ** 0.5).to(bf),
                conv_w=rnd(C, 1, K, dtype=bf, g=g), conv_b=rnd(C, dtype=bf, g=g),
                dt_bias=rnd(H, g=g), A_log=torch.rand(H, generator=g).to(DEV), D=rnd(H, g=g),
                norm_w=(1 + 0.1 * rnd(d_inner, g=g)).to(bf), out_proj_w=(rnd(Hd, d_inner, g=g) / d_inner ** 0.5).to(bf))
    states = (rnd(1, C, K, dtype=bf, g=g), rnd(1, H, P, N, g=g))

    a = args
    weights = Mamba2Weights(a["in_proj_w"], None, a["conv_w"], a["conv_b"], a["dt_bias"], a["A_log"], a["D"],
                            a["norm_w"], a["out_proj_w"], None)
    spec = Mamba2Spec(head_dim=P, groups=G, chunk_size=256, eps=1e-5, norm_group=d_inner)

    def step(conv_state, ssm_state):
        return torch.ops.hybrid.mamba2_mixer_step(*spec.step_args(a["hidden"], None, weights, conv_state, ssm_state))

    want_states = _clone(states)
    want = step(*want_states)  # reference ops (on the GPU: the kernels, the in projection unfused)
    if DEV == "cpu":
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    fused = []
    monkeypatch.setattr(ssm_ops, "conv_config", lambda M, N_, K_: dict(lin_kernels.DOT_MID, block_k=16))
    real_conv, real_lin = ssm_ops.linear_conv_triton, ssm_ops.linear_triton
    monkeypatch.setattr(ssm_ops, "linear_conv_triton", lambda *a, **k: fused.append("conv") or real_conv(*a, **k))
    monkeypatch.setattr(ssm_ops, "linear_triton", lambda *a, gate=None, **k: (
        fused.append("gated") if gate is not None else None) or real_lin(*a, gate=gate, **k))
    got_states = _clone(states)
    got = step(*got_states)
    assert fused == ["conv", "gated"]
    close(got, want, 2e-2)  # bf16: 0.9% / 0.5% / 0.7% measured on the CPU
    close(got_states[0], want_states[0], 1e-2)
    close(got_states[1], want_states[1], 2e-2)


@pytest.mark.parametrize("t1,t2", [(5, 7), (13, 3), (1, 9)])
@pytest.mark.parametrize("triton_path", [False, True], ids=["reference", "triton"])
def test_mamba2_chunk_continues_the_prefill(t1, t2, triton_path, monkeypatch):
    """hybrid::mamba2_mixer_chunk, independent of HF's cache behaviour: a prompt prefilled as t1 tokens
    (hybrid::mamba2_mixer, fresh states) then t2 tokens continuing from those states equals one prefill of all
    t1 + t2 tokens: outputs and both final states. Chunk size 4, so the chunks straddle SSD chunk boundaries."""
    if triton_path and DEV == "cpu":
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    g = torch.Generator().manual_seed(t1 * 31 + t2)
    B, Hd, H, P, G, N, K = 2, 24, 3, 8, 1, 8, 4
    d_inner, C = H * P, H * P + 2 * G * N
    from hybrid_kernels.ssm.spec import Mamba2Spec, Mamba2Weights
    w = Mamba2Weights(in_proj_w=rnd(d_inner + C + H, Hd, g=g) / Hd ** 0.5, in_proj_b=None, conv_w=rnd(C, 1, K, g=g),
                      conv_b=rnd(C, g=g), dt_bias=rnd(H, g=g), A_log=torch.rand(H, generator=g).to(DEV),
                      D=rnd(H, g=g), norm_w=1 + 0.1 * rnd(d_inner, g=g), out_proj_w=rnd(Hd, d_inner, g=g) / d_inner ** 0.5,
                      out_proj_b=None)
    spec = Mamba2Spec(head_dim=P, groups=G, chunk_size=4, eps=1e-5, norm_group=d_inner)
    x = rnd(B, t1 + t2, Hd, g=g)
    out, conv, ssm = torch.ops.hybrid.mamba2_mixer(*spec.prefill_args(x, None, w, K))
    out1, conv1, ssm1 = torch.ops.hybrid.mamba2_mixer(*spec.prefill_args(x[:, :t1], None, w, K))
    out2 = torch.ops.hybrid.mamba2_mixer_chunk(*spec.chunk_args(x[:, t1:], None, w, conv1, ssm1))
    close(torch.cat([out1, out2], 1), out, 1e-4)
    close(conv1, conv, 1e-5)
    close(ssm1, ssm, 1e-4)


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path).exists()
    except Exception:
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="Triton's CUDA backend / ptxas not installed")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ssm.py"), "--compile-check"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
