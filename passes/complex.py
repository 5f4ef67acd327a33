"""Complex arithmetic in the graph -> real arithmetic, so Inductor can fuse it.

DeepSeek-V2 applies RoPE in complex numbers: ``freqs_cis = torch.polar(ones, freqs)``, then
``view_as_real(view_as_complex(x.reshape(..., -1, 2)) * freqs_cis)``. Inductor generates no code for complex
tensors: each complex op runs as its own eager aten kernel (5-6 per layer plus the inputs they need
materialised), and nothing around them fuses. This pass carries every complex value of such a chain as a pair
of real tensors (re, im) and rewrites it:

    polar(r, t)           -> (r * cos t, r * sin t)
    view_as_complex(x)    -> (x[..., 0], x[..., 1])
    z * w, z + w, z - w   -> the usual formulas (either side may be real or a Python number)
    z.to(device), views   -> applied to both halves (a complex tensor's shape is its halves' shape)
    view_as_real(z)       -> stack((re, im), -1)

Same arithmetic as aten's complex kernels (a*c - b*d, a*d + b*c per element, in the complex dtype's real
dtype), up to FMA contraction. All or nothing: when any complex value reaches an op not listed (or a graph
output, or a dtype change), the graph keeps its complex ops, and the explain report's note for the graph says
which op stopped it. It runs after the region passes, which see HF's graph as it was traced.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from graphs.regions import node_value

from .base import Pass, PassContext, PassResult

KIND = "complex"
#: methods that act on a complex tensor's shape only: applied to the real and imaginary halves alike
SHAPE_METHODS = {"unsqueeze", "squeeze", "view", "reshape", "expand", "transpose", "permute", "contiguous",
                 "flatten", "clone"}
SHAPE_FUNCTIONS = {torch.unsqueeze, torch.squeeze, torch.reshape, torch.transpose, torch.permute, torch.flatten,
                   operator.getitem}
ARITH = {operator.mul: "mul", torch.mul: "mul", operator.add: "add", torch.add: "add", operator.sub: "sub",
         torch.sub: "sub"}


def _is_complex(a) -> bool:
    v = node_value(a) if isinstance(a, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.is_complex()


def _mutating(n: fx.Node) -> bool:
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return name.endswith("_") and not name.startswith("__") or "out" in n.kwargs


def _why_not(n: fx.Node) -> str | None:
    """None when this complex-valued node (or consumer of one) can be lowered, else what stops it."""
    if any(isinstance(a, complex) for a in (*n.args, *n.kwargs.values())):
        return "a Python complex constant"
    if n.op == "call_function":
        if n.target is torch.view_as_real and not n.kwargs:
            # stack() copies where view_as_real is a view: an in-place write through it would be lost
            return "an in-place write into view_as_real's result" if any(map(_mutating, n.users)) else None
        if n.target in (torch.polar, torch.view_as_complex) and not n.kwargs:
            return None
        if n.target in ARITH and not n.kwargs and len(n.args) == 2:
            return None
        if n.target in SHAPE_FUNCTIONS and _is_complex(n.args[0]) and not any(_is_complex(a) for a in n.args[1:]) \
                and not n.kwargs:
            return None
    if n.op == "call_method" and n.args and _is_complex(n.args[0]):
        if n.target in SHAPE_METHODS and not any(isinstance(a, torch.dtype) for a in n.args[1:]):
            return None
        if n.target == "to" and all(not isinstance(a, torch.dtype) for a in n.args[1:]) \
                and "dtype" not in n.kwargs:
            return None
    if n.op == "output":
        return "a complex graph output"
    return f"{n.op} {getattr(n.target, '__name__', n.target)}"


class LowerComplex(Pass):
    kind = KIND
    name = "complex"

    def apply(self, ctx: PassContext) -> PassResult:
        graph = ctx.gm.graph
        cplx = [n for n in graph.nodes if _is_complex(n)]
        if not cplx:
            return PassResult()
        users = {u for n in cplx for u in n.users}
        blockers = sorted({w for n in set(cplx) | users if (w := _why_not(n)) is not None})
        if blockers:
            return PassResult(notes=[f"complex ops kept: complex values reach {', '.join(blockers)} (Inductor runs "
                                     "complex ops as eager aten kernels)"])
        pairs: dict[fx.Node, tuple] = {}
        for n in list(graph.nodes):
            if n in pairs or not (_is_complex(n) or n.target is torch.view_as_real):
                continue
            with graph.inserting_before(n):
                if n.target is torch.view_as_real:
                    re, im = pairs[n.args[0]]
                    n.replace_all_uses_with(graph.call_function(torch.stack, ((re, im), -1)))
                else:
                    pairs[n] = _lower(graph, n, pairs)
        for n in reversed(list(graph.nodes)):  # the complex chain is dead now
            if (_is_complex(n) or n.target is torch.view_as_real) and not n.users:
                graph.erase_node(n)
        return PassResult(1, notes=[f"{len(cplx)} complex ops lowered to real arithmetic (Inductor can fuse them)"])


def _lower(graph: fx.Graph, n: fx.Node, pairs: dict) -> tuple:
    """(re, im) nodes for the complex node n; its complex inputs are in ``pairs`` already."""
    f = graph.call_function
    if n.target is torch.polar:
        r, t = n.args
        return f(operator.mul, (r, f(torch.cos, (t,)))), f(operator.mul, (r, f(torch.sin, (t,))))
    if n.target is torch.view_as_complex:
        x = n.args[0]
        return f(torch.select, (x, -1, 0)), f(torch.select, (x, -1, 1))
    if n.target in ARITH:
        a, b = (pairs.get(x, x) for x in n.args)
        op = ARITH[n.target]
        if op == "mul":
            if isinstance(a, tuple) and isinstance(b, tuple):
                (ar, ai), (br, bi) = a, b
                return (f(operator.sub, (f(operator.mul, (ar, br)), f(operator.mul, (ai, bi)))),
                        f(operator.add, (f(operator.mul, (ar, bi)), f(operator.mul, (ai, br)))))
            z, s = (a, b) if isinstance(a, tuple) else (b, a)
            return f(operator.mul, (z[0], s)), f(operator.mul, (z[1], s))
        fn = operator.add if op == "add" else operator.sub
        if isinstance(a, tuple) and isinstance(b, tuple):
            return f(fn, (a[0], b[0])), f(fn, (a[1], b[1]))
        if isinstance(a, tuple):  # z -/+ real: the real half moves, the imaginary half takes the broadcast shape
            return f(fn, (a[0], b)), _broadcast(graph, a[1], b)
        im = b[1] if op == "add" else f(operator.neg, (b[1],))
        return f(fn, (a, b[0])), _broadcast(graph, im, a)
    re, im = pairs[n.args[0]]  # shape functions / methods and .to(device): the same on both halves
    rest = n.args[1:]
    if n.op == "call_method":
        return (graph.call_method(n.target, (re, *rest), dict(n.kwargs)),
                graph.call_method(n.target, (im, *rest), dict(n.kwargs)))
    return f(n.target, (re, *rest), dict(n.kwargs)), f(n.target, (im, *rest), dict(n.kwargs))


def _broadcast(graph: fx.Graph, half, other):
    """``half`` with the shape it takes next to ``other`` in an elementwise op (adding zeros keeps inf/NaN)."""
    if not isinstance(other, fx.Node):
        return half
    return graph.call_function(operator.add, (half, graph.call_function(torch.zeros_like, (other,))))

