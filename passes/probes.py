"""Probes that prove what a live module computes, shared by several passes and the HF preparation: the module runs
eagerly on random inputs and its output is compared with a kernels reference. A module that fails a probe is left
as it is (the caller says why)."""
from __future__ import annotations

import torch

from hybrid_kernels.linear.reference import add_rms_norm_ref
from hybrid_kernels.moe import reference as moe_reference
from hybrid_kernels.moe.reference import ACTIVATIONS, ELEMENTWISE, activation_fn
from hybrid_kernels.moe.spec import ExpertsSpec
from hybrid_kernels.numerics import close

from .base import Skip, eager_probe


def identify_activation(act: torch.nn.Module | None) -> str:
    """The name (hybrid_kernels.moe.reference.ACTIVATIONS) of the activation ``act`` computes, or Skip."""
    if act is None:
        raise Skip("experts module has no act_fn")
    t = torch.linspace(-6, 6, 97)
    with eager_probe():
        got = act(t)
    for name in ELEMENTWISE:
        if torch.allclose(got, activation_fn(name)(t), atol=1e-6, rtol=1e-5):
            return name
    raise Skip(f"expert activation {type(act).__name__} is not one of {', '.join(ELEMENTWISE)}")


def rmsnorm_eps(m: torch.nn.Module | None) -> float | None:
    """eps of a module that holds one 1-D ``weight`` parameter, no buffers and no children, else None."""
    if m is None or next(m.children(), None) is not None or next(m.buffers(recurse=False), None) is not None:
        return None
    params = dict(m.named_parameters(recurse=False))
    if list(params) != ["weight"] or params["weight"].dim() != 1:
        return None
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return float(eps) if isinstance(eps, (float, int)) and not isinstance(eps, bool) else None


def rmsnorm_problem(m: torch.nn.Module, eps: float, dtype: torch.dtype) -> str | None:
    """None when the module computes HF's RMSNorm on ``dtype`` input, else why not."""
    w = m.weight
    g = torch.Generator(device="cpu").manual_seed(11)
    x = torch.randn(2, 3, w.shape[0], generator=g) * 2 + 0.5
    x[1] *= 1e-3  # rows with mean(x^2) near eps: a module that uses another eps than the one it holds shows there
    x = x.to(w.device, dtype)
    with eager_probe():
        got = m(x)
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        return "its output is not one tensor shaped like its input"
    want = add_rms_norm_ref(x, None, w, eps, False, got.dtype)[0]
    ok, msg = close(got, want, dtype, tol=1e-5 if dtype == torch.float32 else 1e-2)
    return None if ok else f"its math is not RMSNorm's w * (x * rsqrt(mean(x^2) + eps)) ({msg})"


def _softcaps(experts: torch.nn.Module) -> tuple[float, float] | None:
    """(gate cap, up cap) of a soft-capped SwiGLU held by the experts' ``act_fn`` (children ``gate_softcap`` and
    ``up_softcap`` with a float ``softcap``), else None; what they compute is proven by the probe."""
    act = getattr(experts, "act_fn", None)
    caps = [getattr(getattr(act, n, None), "softcap", None) for n in ("gate_softcap", "up_softcap")]
    ok = all(isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in caps)
    return (float(caps[0]), float(caps[1])) if ok else None


def _number(obj, names: tuple[str, ...], default: float) -> float:
    """The first of ``obj``'s attributes ``names`` that holds a number, as a float, else ``default``."""
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return default


def identify_experts(experts: torch.nn.Module, gated: bool) -> ExpertsSpec:
    """How the experts combine gate and up (HF's ``_apply_gate``: act_fn(gate) * up by default, clamped SwiGLU in
    gpt-oss), proven on a probe of the live method; ungated experts: their ``act_fn``."""
    transposed = bool(getattr(experts, "is_transposed", False))
    concatenated = bool(getattr(experts, "is_concatenated", True))
    apply_gate = getattr(experts, "_apply_gate", None)
    if not gated or apply_gate is None:
        return ExpertsSpec(gated, gated and not concatenated, identify_activation(getattr(experts, "act_fn", None)),
                           transposed)
    # the clamped SwiGLU's constants, by the names HF's families give them (gpt-oss: alpha / limit); a constant set
    # to None (a family's "no clipping on this layer") counts as absent
    alpha = _number(experts, ("alpha", "swiglu_alpha"), 1.0)
    limit = _number(experts, ("limit", "swiglu_limit"), float("inf"))
    g = torch.Generator(device="cpu").manual_seed(7)
    t = torch.randn(5, 24, generator=g) * 4
    if 0 < limit < float("inf"):  # rows past the limit: a clamp must show
        t = torch.cat([t, torch.randn(5, 24, generator=g) * 2 * limit])
    with eager_probe():
        got = apply_gate(t)
    consts = {"swiglu_clamp": (alpha, limit), "swiglu_softcap": _softcaps(experts),
              "swiglu_limit": (1.0, limit) if 0 < limit < float("inf") else None}
    for interleaved in (not concatenated, concatenated):
        for act in ACTIVATIONS:
            if act in consts and consts[act] is None:
                continue
            cand = ExpertsSpec(True, interleaved, act, transposed, *consts.get(act, ()))
            want = moe_reference.glu(*moe_reference.split_gate_up(t, interleaved), act, cand.alpha, cand.limit)
            if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, atol=1e-5,
                                                                                              rtol=1e-5):
                return cand
    raise Skip(f"the experts' gate ({type(experts).__name__}._apply_gate) is none of act(gate) * up for "
               f"{', '.join(ACTIVATIONS)}")
