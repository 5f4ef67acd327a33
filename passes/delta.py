"""Delta pass: reports each gated delta-rule mixer (Gated DeltaNet, Kimi Delta Attention) of a graph.

The rewrite itself happens before tracing, in the HF preparation (prepare.py, part 3): the mixer's delta-rule
functions, proven on probes, trace as one opaque ``hybrid::delta_rule`` call (Triton chunked prefill / recurrent
step) while projections, conv, gates and the gated norm stay with Inductor and the linear / norm passes. This pass
finds the mixer regions and says, per region, whether its graph holds the op and, where not, why.

At decode it also rewrites: HF's mixer computes the new state from the cached one and copies it back into the
cache (``recurrent_states.copy_(new)``). Where the cached state is a graph input, the step is one token, and the
op and that copy are its only readers, the pair becomes ``hybrid::delta_rule_step``, which updates the state in
place: the state is read once and written once instead of read twice and written twice.
"""
from __future__ import annotations

import operator

import torch

from graphs.modules import DELTA

from torch import fx

from graphs.regions import node_value

from .base import REWRITTEN, SKIPPED, PassContext, RegionPass
from .prepare import DELTA_REFUSED, _delta_functions


class FuseDelta(RegionPass):
    kind = DELTA
    name = "delta"

    def _process(self, ctx: PassContext, region) -> tuple[str, str]:
        ops = (torch.ops.hybrid.delta_rule, torch.ops.hybrid.delta_rule_step)
        calls = [n for n in region.nodes if n.target in ops or getattr(n.target, "overloadpacket", None) in ops]
        if calls:
            g, k, v = (node_value(calls[0].args[i]) for i in (3, 1, 2))
            kind = "key channel" if g is not None and g.dim() == 4 else "value head"
            shape = f": {v.shape[2]} value heads x {k.shape[-1]} x {v.shape[3]}" if v is not None else ""
            prefill = (torch.ops.hybrid.delta_rule, torch.ops.hybrid.delta_rule.default)
            steps = sum(_in_place_step(ctx.gm.graph, n) for n in calls if n.target in prefill)
            if steps:
                return REWRITTEN, (f"gated delta rule (decay per {kind}){shape} -> hybrid::delta_rule_step "
                                   "(decode, the cached state updated in place)")
            return REWRITTEN, f"gated delta rule (decay per {kind}){shape} -> hybrid::delta_rule"
        cls = type(region.module)
        if cls in DELTA_REFUSED:
            return SKIPPED, f"HF's delta-rule functions kept: {DELTA_REFUSED[cls]}"
        if not _delta_functions(cls):
            return SKIPPED, ("no module-level function with the delta-rule interface (query, key, value, g, beta, "
                             "..., initial_state, output_final_state) in the mixer's module")
        return SKIPPED, "HF's delta-rule functions run as HF wrote them in this graph; the next call retraces with hybrid's"


_CONVERSIONS = ("to", "float", "contiguous")


def _through_conversions(n: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The node reached from ``n`` through single-user no-op conversions (``.to(fp32)`` of an fp32 state), and them."""
    chain = []
    while len(n.users) == 1:
        u = next(iter(n.users))
        val, src = node_value(u), node_value(n)
        if not (u.op == "call_method" and u.target in _CONVERSIONS and isinstance(val, torch.Tensor)
                and isinstance(src, torch.Tensor) and val.dtype == src.dtype):
            break
        chain.append(u)
        n = u
    return n, chain


def _is_copy_into(n: fx.Node, dst: fx.Node, src: fx.Node) -> bool:
    if n.op == "call_method" and n.target == "copy_":
        return len(n.args) >= 2 and n.args[0] is dst and n.args[1] is src
    return n.op == "call_function" and n.target in (torch.Tensor.copy_, torch.ops.aten.copy_.default) \
        and n.args[0] is dst and n.args[1] is src


def _in_place_step(graph: fx.Graph, call: fx.Node) -> bool:
    q, k, v, g, beta, scale, state, cu, l2 = call.args
    vv = node_value(v)
    if cu is not None or not isinstance(state, fx.Node) or state.op != "placeholder" or vv is None:
        return False
    if not (isinstance(vv.shape[1], int) and vv.shape[1] == 1):
        return False
    sv = node_value(state)
    if not isinstance(sv, torch.Tensor) or sv.dtype != torch.float32:
        return False
    outs = {u.args[1]: u for u in call.users if u.target is operator.getitem}
    if set(outs) - {0, 1} or 1 not in outs or len(call.users) != len(outs):
        return False
    end, chain = _through_conversions(outs[1])
    copies = list(end.users)
    if len(copies) != 1 or not _is_copy_into(copies[0], state, end):
        return False
    copy = copies[0]
    if set(state.users) - {call, copy}:
        return False
    with graph.inserting_after(call):
        step = graph.call_function(torch.ops.hybrid.delta_rule_step.default, (q, k, v, g, beta, scale, state, None, l2))
    step.meta["val"] = node_value(outs[0]) if 0 in outs else None
    step.meta.update({k_: call.meta[k_] for k_ in ("nn_module_stack", "stack_trace") if k_ in call.meta})
    copy.replace_all_uses_with(state)
    graph.erase_node(copy)
    for n in reversed(chain):
        graph.erase_node(n)
    graph.erase_node(outs[1])
    if 0 in outs:
        outs[0].replace_all_uses_with(step)
        graph.erase_node(outs[0])
    graph.erase_node(call)
    return True
