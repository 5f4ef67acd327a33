"""Comparing tensors the way the project agrees to: relative error of the whole tensor against a
reference, with a tolerance that depends on the dtype the computation ran in."""
from __future__ import annotations

import torch

#: ||out - ref|| / ||ref|| allowed per dtype (fp32 rewrites are near-exact; bf16/fp16 carry rounding)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def close(out, ref, dtype: torch.dtype | None = None, tol: float | None = None) -> tuple[bool, str]:
    """(ok, message) for tensors, or tuples/lists of them; integer tensors must match exactly."""
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            return False, "structure differs"
        for i, (o, r) in enumerate(zip(out, ref)):
            ok, msg = close(o, r, dtype, tol)
            if not ok:
                return False, f"[{i}] {msg}"
        return True, ""
    if not isinstance(ref, torch.Tensor):
        return (out == ref), f"{out!r} != {ref!r}"
    if not isinstance(out, torch.Tensor):
        return False, f"expected a tensor, got {type(out).__name__}"
    if not ref.is_floating_point():
        ok = out.shape == ref.shape and torch.equal(out.cpu(), ref.cpu())
        return ok, "" if ok else "integer tensors differ"
    limit = tol if tol is not None else TOLERANCE.get(dtype or ref.dtype, 1e-5)
    err = rel_err(out, ref)
    return err <= limit, f"relative error {err:.2e} (limit {limit:.0e})"
