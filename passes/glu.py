"""A gated MLP's activation -> the epilogue of its gate + up projection (``hybrid::norm_linear(glu=True)``).

HF's gated MLPs (Llama, DeepSeek's dense MLP and shared experts) compute ``down_proj(act_fn(gate_proj(x)) *
up_proj(x))``. After passes/norm.py the norm before them and both projections are one launch (``hybrid::norm_linear``
with two weights), and Inductor runs ``silu(gate) * up`` as a kernel of its own: at one row a fixed cost of 2-3 us for
a few KB of data. With ``glu=True`` each gemv program computes the same rows of gate and up and stores the product
(hybrid_kernels/linear/triton_gemv.py, rounded as the eager ops round); more rows run the two linears and one silu * mul
launch, as Inductor would.

What fires: ``F.silu(gate) * up`` (either way round, not in place) where gate and up are the two outputs of one
``hybrid::norm_linear`` of two weights of one shape without bias, each read only by the activation / the product, and
the activation read only by the product. Runs after passes/norm.py; the explain report's graph note counts the fused
activations and says why others were not. (A silu-gated product reads the outputs of a plain ``hybrid::linear_group``
only where the norm before it did not fuse: left to Inductor.)
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from graphs.regions import node_value

from .base import Pass, PassContext, PassResult

KIND = "glu"
_SILU = {F.silu, torch._C._nn.silu}
_MUL = {operator.mul, torch.mul}


def _silu_input(n) -> fx.Node | None:
    """x when n is ``F.silu(x)`` (not in place), else None."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or n.target not in _SILU or len(n.args) != 1:
        return None
    if n.kwargs.get("inplace", False) or set(n.kwargs) - {"inplace"}:
        return None
    return n.args[0]


def _output_of(n: fx.Node) -> tuple[fx.Node, int] | None:
    """(call, i) when n is output i of a ``hybrid::norm_linear`` / ``hybrid::linear_group`` call."""
    if n.op != "call_function" or n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
        return None
    call = n.args[0]
    ops = (torch.ops.hybrid.norm_linear.default, torch.ops.hybrid.linear_group.default)
    return (call, n.args[1]) if call.op == "call_function" and call.target in ops else None


def _match(mul: fx.Node) -> str | tuple | None:
    """(call, silu, gate, up, gate's output index) when ``mul`` is a fusable silu-gated product, a reason when it is
    one that is not, None when it is no silu-gated product of a hybrid linear's outputs."""
    if mul.op != "call_function" or mul.target not in _MUL or len(mul.args) != 2 or mul.kwargs:
        return None
    a, b = mul.args
    silu, up = (a, b) if _silu_input(a) is not None else (b, a)
    gate = _silu_input(silu)
    if gate is None or not isinstance(up, fx.Node):
        return None
    g, u = _output_of(gate), _output_of(up)
    if g is None or u is None:
        return None
    if g[0] is not u[0] or {g[1], u[1]} != {0, 1}:
        return "gate and up are not the two outputs of one launch"
    call = g[0]
    if call.target is not torch.ops.hybrid.norm_linear.default:
        return "gate and up are a plain linear group (the norm before them is not fused)"
    if len(call.args) < 6:
        return "the launch's weights are not given by position"
    weights = call.args[5]
    bias = call.args[6] if len(call.args) > 6 else call.kwargs.get("bias")
    glu = call.args[8] if len(call.args) > 8 else call.kwargs.get("glu", False)
    if len(weights) != 2 or bias is not None or glu:
        return "the launch has other weights or a bias"
    if any(len(n.users) != 1 for n in (gate, up, silu)):
        return "gate, up or the activation has other readers"
    gv, uv = node_value(gate), node_value(up)
    if gv.shape != uv.shape or gv.dtype != uv.dtype or node_value(weights[0]).shape != node_value(weights[1]).shape:
        return "gate and up differ in shape or dtype"
    return call, silu, gate, up, g[1]


class FuseGLU(Pass):
    kind = KIND
    name = "glu"

    def apply(self, ctx: PassContext) -> PassResult:
        graph = ctx.gm.graph
        fused, why = 0, {}
        for mul in list(graph.nodes):
            found = _match(mul)
            if found is None:
                continue
            if isinstance(found, str):
                why[found] = why.get(found, 0) + 1
                continue
            call, silu, gate, up, gate_index = found
            args = list(call.args) + [None, False, False][len(call.args) - 6:]  # bias, return_normed, glu
            weights = list(args[5])
            args[5] = weights if gate_index == 0 else weights[::-1]
            args[8] = True
            with graph.inserting_after(call):
                new = graph.call_function(torch.ops.hybrid.norm_linear.default, tuple(args), dict(call.kwargs))
            new.meta.update({k: v for k, v in call.meta.items() if k not in ("val", "example_value")})
            vals = list(node_value(call))
            new.meta["example_value"] = [node_value(mul)] + vals[2:]
            with graph.inserting_after(new):
                y = graph.call_function(operator.getitem, (new, 0))
            y.meta.update(mul.meta)
            mul.replace_all_uses_with(y)
            for n in (mul, silu, gate, up):
                graph.erase_node(n)
            for item in list(call.users):  # the sum and the norm's output move down by one
                with graph.inserting_after(new):
                    moved = graph.call_function(operator.getitem, (new, item.args[1] - 1))
                moved.meta.update(item.meta)
                item.replace_all_uses_with(moved)
                graph.erase_node(item)
            graph.erase_node(call)
            fused += 1
        notes = []
        if fused or why:
            left = "; ".join(f"{k} left to Inductor where {reason}" for reason, k in why.items())
            notes.append(f"{fused} SiLU-gated MLP activations -> the epilogue of their gate + up launch "
                         f"(hybrid::norm_linear glu){'; ' + left if left else ''}")
        return PassResult(fused, notes=notes)
