"""RMSNorm -> the prologue of the one linear launch that reads it (``hybrid::norm_linear``), with the residual add
before the norm when there is one.

A decoder layer starts with ``residual + out`` then an RMSNorm whose output only a projection reads (DeepSeek's
``q_proj`` + ``kv_a_proj``, Mixtral's q/k/v, a dense MLP's gate + up). Inductor runs
the add and the norm as one small kernel before the projection's; at one row that kernel is a fixed cost of 2-3 us
for 10-20 KB of data. ``hybrid::norm_linear`` computes the sum and the norm as the gemv kernel's prologue (each
program reads the whole row anyway; one writes the sum, which the graph still reads as the next residual), and runs
the norm kernel, then the linears, where that kernel does not take the call (more rows).

What fires: a module that holds one 1-D ``weight`` and no children and has an ``eps`` / ``variance_epsilon`` (an RMSNorm,
by what it holds), called once in the graph, whose math a probe proves (the live module on random input against
``w * (t * rsqrt(mean(t^2) + eps)).to(t.dtype)``: Gemma's ``1 + w`` or a LayerNorm fail it); its output must reach
a ``hybrid::linear`` / ``hybrid::linear_group`` (what passes/linear.py emits) through casts and identity slices, the
one-row kernel must take that linear (not an lm_head-sized weight: ``pick_config``), and the norm's input must be in
the weights' dtype or fp32. When others read the norm's output too (DeepSeek's MoE block: the shared experts' gate +
up, and the router and routed experts), the linear must read it as it is and the op also writes it for them
(``return_normed``: the gemv's first programs write it, 64 columns each). Runs after passes/linear.py; the explain
report's graph note counts the fused norms and says why the others were not.
"""
from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from graphs.regions import Region, find_regions, node_value
from hybrid_kernels.linear.triton_gemv import pick_config

from .base import Pass, PassContext, PassResult
from .linear import may_mutate
from .probes import rmsnorm_eps, rmsnorm_problem

KIND = "norm"


def _is_cast(n: fx.Node) -> bool:
    """``t.to(dtype)`` / ``t.float()`` style casts that keep the shape."""
    return n.op == "call_method" and n.target in ("to", "float", "bfloat16", "half") and len(n.all_input_nodes) == 1


def _is_identity_slice(n: fx.Node) -> bool:
    """``t[:, -1:, :]`` and the like that keep the whole tensor here (same shape as their input)."""
    if n.op != "call_function" or n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
        return False
    if not all(isinstance(i, slice) for i in (n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],))):
        return False
    src, out = node_value(n.args[0]), node_value(n)
    return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and _same_shape(src, out)


def _is_add(n: fx.Node) -> bool:
    if n.op != "call_function" or n.target not in (operator.add, torch.add) or n.kwargs or len(n.args) != 2:
        return False
    a, b = (node_value(x) for x in n.args)
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_shape(a, b) \
        and a.is_floating_point() and b.is_floating_point()


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Shapes equal for every size the graph takes, decided without a guard: comparing symbolic sizes with ``==``
    would make dynamo guard on the answer, and a step whose sizes answer otherwise (a packed step whose tokens are
    all last tokens) would compile another graph."""
    return a.dim() == b.dim() and statically_known_true(sym_eq(tuple(a.shape), tuple(b.shape)))


class FuseNorm(Pass):
    kind = KIND
    name = "norm"

    def apply(self, ctx: PassContext) -> PassResult:
        graph = ctx.gm.graph
        consumers = {torch.ops.hybrid.linear.default, torch.ops.hybrid.linear_group.default}
        linears = [n for n in graph.nodes if n.op == "call_function" and n.target in consumers]
        if not linears:
            return PassResult()
        regions = find_regions(ctx.gm, ctx.index, lambda m: KIND if rmsnorm_eps(m) is not None else None)
        if not regions:
            return PassResult()
        by_output = {r.outputs[0]: r for r in regions if len(r.outputs) == 1}
        fused, why = 0, {}
        for r in regions:  # (a norm whose output nothing reads is one a region pass took apart: not reported)
            if len(r.outputs) > 1:
                why[r.path] = f"{len(r.outputs)} outputs (called more than once in this graph?)"
            elif r.outputs:
                why[r.path] = "no hybrid linear reads it"
        for lin in linears:
            chain = [lin.args[0]]  # the linear's input back to the norm's output: casts and identity slices
            while chain[-1] not in by_output and (_is_cast(chain[-1]) or _is_identity_slice(chain[-1])):
                chain.append(chain[-1].args[0])
            region = by_output.get(chain[-1])
            if region is None:
                continue
            reason = self._fuse(ctx, lin, chain, region)
            if reason is None:
                fused += 1
                why.pop(region.path, None)
            else:
                why[region.path] = reason
        by_reason: dict[str, list[str]] = {}
        for path, reason in why.items():
            by_reason.setdefault(reason, []).append(path)
        left = "; ".join(f"{len(ps)} where {reason} ({', '.join(sorted(ps)[:3])}{', ...' if len(ps) > 3 else ''})"
                         for reason, ps in by_reason.items())
        return PassResult(fused, notes=[f"{fused} RMSNorm (+ residual add) -> prologue of the linear that reads it "
                                        f"(hybrid::norm_linear)" + (f"; left to Inductor: {left}" if left else "")])

    def _fuse(self, ctx: PassContext, lin: fx.Node, chain: list[fx.Node], region: Region) -> str | None:
        """Rewrite one norm + linear, or say why not."""
        graph = ctx.gm.graph
        out = chain[-1]  # the norm's output; others may read it when the linear reads it as it is (no cast between)
        if any(len(n.users) != 1 for n in chain[:-1]) or (len(out.users) > 1 and len(chain) > 1):
            return "its output is read by more than the linear, through a cast"
        normed = len(out.users) > 1  # the op also writes the norm's output, for the other readers
        m = region.module
        eps = rmsnorm_eps(m)
        weight = ctx.param_node(m.weight)
        # a 0-d input is a scalar dynamo lifted (the eps under dynamic shapes): the module's own value is used
        acts = [n for n in region.inputs if n is not weight and isinstance(node_value(n), torch.Tensor)
                and node_value(n).dim() > 0]
        if weight is None or weight not in region.inputs or len(acts) != 1:
            return "cannot tell its input and weight apart"
        t = acts[0]
        weights = list(lin.args[1]) if isinstance(lin.args[1], (list, tuple)) else [lin.args[1]]
        tv, wv = node_value(t), node_value(weights[0])
        if tv.dtype not in (wv.dtype, torch.float32):
            return f"its input is {tv.dtype}, neither the linear's {wv.dtype} nor fp32"
        if normed and node_value(out).dtype != wv.dtype:
            return f"others read its {node_value(out).dtype} output, the op writes it in the linear's {wv.dtype}"
        Ns = [node_value(w).shape[0] for w in weights]
        if pick_config(1, Ns, wv.shape[1], norm=True) is None:
            return (f"the one-row prologue does not take its linear ({'+'.join(map(str, Ns))} x {wv.shape[1]}: an "
                    "lm_head-sized weight or K > 8192, where the norm kernel, then the dot kernel or cuBLAS, are faster)")
        problem = rmsnorm_problem(m, eps, tv.dtype)
        if problem:
            return problem
        # the norm's source: t, or what t casts (when only the norm reads the cast); a residual add there becomes part
        # of the prologue (what else reads the sum reads the op's copy)
        src = t.args[0] if _is_cast(t) and all(u in region for u in t.users) else t
        add = src if _is_add(src) else None
        x, residual = (add.args[0], add.args[1]) if add is not None else (src, None)
        bias = lin.args[2] if lin.target is torch.ops.hybrid.linear.default and len(lin.args) > 2 else None
        nodes = list(graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        anchor = add if add is not None else src
        if anchor.op == "placeholder":  # the call goes after every placeholder
            anchor = [n for n in nodes if n.op == "placeholder"][-1]
        # the call computes the norm where its input is made: nothing up to the linear may write in place (into the
        # input, the sum, or anything else: the order of such writes against the norm would change)
        readers = [u for u in out.users if u is not lin and u not in chain]
        last = max(order[n] for n in [lin, *readers])
        if any(map(may_mutate, nodes[order[anchor] + 1:last])):
            return "something between its input and its readers may write in place"
        late = [p for p in [weight, *weights, *([bias] if bias is not None else [])] if order[p] > order[anchor]]
        if any(p.op != "get_attr" for p in late):
            return "a weight of its linear is computed after the norm's input"
        with graph.inserting_after(anchor):
            call = graph.call_function(torch.ops.hybrid.norm_linear.default,
                                       (x, residual, weight, eps, tv.dtype != torch.float32, weights, bias, normed))
        for p in late:  # frozen weights: get_attr nodes placed at their first use
            call.prepend(p)
        ys = node_value(lin)
        ys = list(ys) if isinstance(ys, (list, tuple)) else [ys]
        call.meta.update({k: v for k, v in lin.meta.items() if k != "example_value" and k != "val"})
        call.meta["example_value"] = ys + ([node_value(add)] if add is not None else []) + (
            [node_value(out)] if normed else [])
        if normed:  # the other readers take the op's copy of the norm's output (its last output)
            with graph.inserting_after(call):
                h = graph.call_function(operator.getitem, (call, len(call.meta["example_value"]) - 1))
            h.meta.update(out.meta)
            for u in readers:
                u.replace_input_with(out, h)
        if lin.target is torch.ops.hybrid.linear.default:
            with graph.inserting_after(call):
                item = graph.call_function(operator.getitem, (call, 0))
            item.meta.update(lin.meta)
            lin.replace_all_uses_with(item)
        else:
            lin.replace_all_uses_with(call)
        graph.erase_node(lin)
        for n in chain[:-1]:  # the linear's input first: each is the only user of the next
            graph.erase_node(n)
        for n in reversed(region.nodes):
            graph.erase_node(n)
        if t is not src:
            graph.erase_node(t)
        if add is not None:
            with graph.inserting_after(call):
                s = graph.call_function(operator.getitem, (call, len(ys)))
            s.meta.update(add.meta)
            add.replace_all_uses_with(s)
            graph.erase_node(add)
        return None
