"""A gated MLP's activation -> the prologue of its down projection (``hybrid::glu_linear``).

HF's gated MLPs (Llama, DeepSeek's dense MLP and shared experts) compute ``down_proj(act_fn(gate_proj(x)) *
up_proj(x))``. After passes/linear.py the two projections are one launch, and Inductor runs silu(gate) * up as a
kernel of its own before the down projection's: at one row a fixed cost of 1-2 us for a few KB of data.
``hybrid::glu_linear`` computes the activation as the gemv kernel's prologue, rounded as the eager ops round
(runtime/ops/linear/kernels.py ``_glu``); more rows, or a weight the gemv kernel does not take, run the eager ops
and then ``hybrid::linear``.

What fires: ``hybrid::linear(F.silu(gate) * up, weight, bias)`` (the product either way round) where the activation
and the product have no other reader, gate and up have one shape and dtype (no broadcast), and the one-row gemv
kernel takes the weight (``pick_config``: K <= 8192, below 40 MB), so the rewrite never trades Inductor's fused
kernel for two eager ones at decode. Runs after passes/linear.py; the explain report's graph note counts the fused
activations and says why the others were not.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from graphs.regions import node_value

from .base import PassContext

KIND = "glu"
_SILU = {F.silu, torch._C._nn.silu}
_MUL = {operator.mul, torch.mul}


def _silu_input(n) -> fx.Node | None:
    """gate when n is ``F.silu(gate)`` (not in place), else None."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or n.target not in _SILU or len(n.args) != 1:
        return None
    if n.kwargs.get("inplace", False) or set(n.kwargs) - {"inplace"}:
        return None
    return n.args[0]


def _why_not(lin: fx.Node) -> str | tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """(silu, mul, gate, up) when the linear's input is a fusable SiLU-gated product, a reason when it is one that
    cannot be fused, None when it is no SiLU-gated product at all."""
    from runtime.ops.linear.kernels import pick_config
    mul = lin.args[0]
    if not isinstance(mul, fx.Node) or mul.op != "call_function" or mul.target not in _MUL or len(mul.args) != 2 \
            or mul.kwargs:
        return None
    a, b = mul.args
    silu, up = (a, b) if _silu_input(a) is not None else (b, a)
    gate = _silu_input(silu)
    if gate is None or not isinstance(up, fx.Node):
        return None
    if len(silu.users) != 1 or len(mul.users) != 1:
        return "the activation or the product has other readers"
    gv, uv, wv = node_value(gate), node_value(up), node_value(lin.args[1])
    if not all(isinstance(v, torch.Tensor) for v in (gv, uv, wv)) or gv.shape != uv.shape or gv.dtype != uv.dtype:
        return "gate and up differ in shape or dtype"
    N, K = wv.shape
    if pick_config(1, [N], K, glu=True) is None:
        return f"the one-row kernel does not take a {N} x {K} weight"
    return silu, mul, gate, up


class FuseGLU:
    kind = KIND
    name = "glu"

    def run(self, ctx: PassContext) -> int:
        graph = ctx.gm.graph
        linears = [n for n in graph.nodes if n.op == "call_function" and n.target == torch.ops.hybrid.linear.default]
        fused, why = 0, {}
        for lin in linears:
            found = _why_not(lin)
            if found is None:
                continue
            if isinstance(found, str):
                why[found] = why.get(found, 0) + 1
                continue
            silu, mul, gate, up = found
            with graph.inserting_before(lin):
                call = graph.call_function(torch.ops.hybrid.glu_linear.default, (gate, up, *lin.args[1:]))
            call.meta.update(lin.meta)
            lin.replace_all_uses_with(call)
            for n in (lin, mul, silu):
                graph.erase_node(n)
            fused += 1
        if fused:
            graph.lint()
            ctx.gm.recompile()
        if fused or why:
            left = "; ".join(f"{k} left where {reason}" for reason, k in why.items())
            ctx.notes.append(f"{fused} SiLU-gated MLP activations -> the down projection's prologue "
                             f"(hybrid::glu_linear){'; ' + left if left else ''}")
        return fused
