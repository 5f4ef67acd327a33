"""Linear layers -> ``hybrid::linear`` / ``hybrid::linear_group``, which run Triton one-row kernels at decode.

At batch 1 every projection is a one-row GEMM whose time is its weight's bytes plus a fixed cost per kernel;
cuBLAS's one-row kernels leave bandwidth on the table for 2-50 MB weights and some add a split-K reduction
kernel. The ops choose per call (hybrid_kernels/linear/ops.py): one row on CUDA in fp16/bf16 -> Triton, anything else
(prefill, bigger batches, the CPU) -> ``F.linear`` unchanged. Where the graph fixes the row count at a value the
kernels never take (a static prefill, a static decode at batch 8), the linear stays F.linear for Inductor: the op
would only add host time per call where no CUDA graph hides it (its dispatch, and the norm and GLU passes' ops built
on it).

Siblings that read the same input with bias-free weights (``q_proj`` + ``kv_a_proj_with_mqa``, ``gate_proj`` +
``up_proj``, ``q/k/v_proj``) become one ``linear_group`` call: one launch instead of two or three. Only linears
whose weight is a module parameter are touched (a computed weight is left as it is), only where input, weight
and result share one dtype (under autocast F.linear's casting stays), and siblings are grouped only when nothing
between them may write in place. It runs after the region passes, on the linears they left in the graph; the
explain report's note for the graph counts them.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from graphs.regions import is_inplace, node_value
from hybrid_kernels.linear.triton_gemv import pick_config

from .base import Pass, PassContext, PassResult

KIND = "linear"
_LINEAR = {torch._C._nn.linear, F.linear}
MAX_GROUP = 3


def _parts(n: fx.Node):
    """(x, weight, bias) of a linear call node, or None when it is not one this pass can take."""
    if n.op != "call_function" or n.target not in _LINEAR or set(n.kwargs) - {"weight", "bias"}:
        return None
    args = list(n.args) + [None] * (3 - len(n.args))
    x, w, b = args[0], n.kwargs.get("weight", args[1]), n.kwargs.get("bias", args[2])
    xv, wv, out = node_value(x), node_value(w), node_value(n)
    if not all(isinstance(v, torch.Tensor) for v in (xv, wv, out)) or wv.dim() != 2:
        return None
    bv = node_value(b)
    if not (out.dtype == xv.dtype == wv.dtype) or (isinstance(bv, torch.Tensor) and bv.dtype != xv.dtype):
        return None  # autocast (or mixed dtypes): F.linear's own casting rules apply
    return x, w, b


def _fixed_rows_untaken(x: fx.Node, w: fx.Node) -> bool:
    """Is the row count of x a fixed number (a graph compiled for static shapes) at which ``pick_config`` takes no
    Triton kernel? Then every call of the op would run ``F.linear``: an opaque call (host time per launch without
    CUDA graphs) that Inductor's own mm does as well. Symbolic row counts (the engine's graphs, dynamo's dynamic
    recompiles) keep the op: it decides per call."""
    xv, wv = node_value(x), node_value(w)
    if not all(isinstance(d, int) for d in xv.shape) or xv.dim() == 0 or xv.shape[-1] == 0:
        return False
    return pick_config(xv.numel() // xv.shape[-1], [wv.shape[0]], xv.shape[-1]) is None


def may_mutate(n: fx.Node) -> bool:
    """Could this node write into a tensor (in place, through an out= argument, or an opaque module call)?"""
    if n.op == "call_module":
        return True
    if n.op not in ("call_function", "call_method"):
        return False
    if n.target is operator.setitem or is_inplace(n) or "out" in n.kwargs:
        return True
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if name.endswith("_") and not name.startswith("__"):
        return True
    t = n.target
    return isinstance(t, torch._ops.OpOverloadPacket) and any(getattr(t, o)._schema.is_mutable for o in t.overloads())


class DecodeLinear(Pass):
    kind = KIND
    name = "linear"

    def apply(self, ctx: PassContext) -> PassResult:
        graph = ctx.gm.graph
        notes = []
        weights = ctx.weight_nodes
        found = [(n, p) for n in graph.nodes if (p := _parts(n)) is not None and p[1] in weights
                 and (p[2] is None or p[2] in weights)]
        fixed = {n for n, p in found if _fixed_rows_untaken(p[0], p[1])}
        if fixed:
            notes.append(f"{len(fixed)} linear layers left to Inductor: their row count is fixed in this graph "
                         "and the Triton kernels take no call at it (the op would run F.linear)")
            found = [(n, p) for n, p in found if n not in fixed]
        if not found:
            return PassResult(notes=notes)
        parts = dict(found)
        groups: dict[tuple, list[fx.Node]] = {}
        singles = []
        for n, (x, w, b) in found:
            wv = node_value(w)
            if b is None:
                groups.setdefault((x, wv.dtype, wv.shape[1]), []).append(n)
            else:
                singles.append(n)
        launches = grouped = 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        nodes = list(graph.nodes)
        for members in groups.values():
            for i in range(0, len(members), MAX_GROUP):
                chunk = members[i:i + MAX_GROUP]
                # one launch computes every member where the first stands: nothing in between may write into
                # the input or a weight
                between = nodes[order[chunk[0]] + 1:order[chunk[-1]]]
                if len(chunk) == 1 or any(map(may_mutate, between)):
                    singles.extend(chunk)
                    continue
                x = chunk[0].args[0]  # now: an earlier group may have replaced the node it read
                for m in chunk[1:]:  # frozen weights are get_attr nodes placed at their first use: move them up
                    w = parts[m][1]
                    if w.op == "get_attr" and order[w] > order[chunk[0]]:
                        chunk[0].prepend(w)
                        order[w] = order[chunk[0]] - 0.5
                with graph.inserting_before(chunk[0]):  # the earliest: members are in graph order
                    call = graph.call_function(torch.ops.hybrid.linear_group.default,
                                               (x, [parts[m][1] for m in chunk]))
                    call.meta["example_value"] = [node_value(m) for m in chunk]
                for j, m in enumerate(chunk):
                    with graph.inserting_before(m):
                        item = graph.call_function(operator.getitem, (call, j))
                    item.meta.update(m.meta)
                    m.replace_all_uses_with(item)
                    graph.erase_node(m)
                launches += 1
                grouped += len(chunk)
        for m in singles:
            _, w, b = parts[m]
            x = m.args[0]  # now: the input may be a grouped linear's output, replaced above
            with graph.inserting_before(m):
                call = graph.call_function(torch.ops.hybrid.linear.default, (x, w, b))
            call.meta.update(m.meta)
            m.replace_all_uses_with(call)
            graph.erase_node(m)
        total = len(found)
        notes.append(f"{total} linear layers -> hybrid::linear ({grouped} of them in {launches} shared-input "
                     "launches): Triton kernels at one row, F.linear otherwise")
        return PassResult(total, notes=notes)
