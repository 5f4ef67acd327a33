"""MoE pass: a whole HF mixture-of-experts block -> one ``hybrid::moe_block`` call.

Found by what it holds (a router weight [E, H], experts with 3-D weights), whatever the class names and
whatever ``config._experts_implementation`` is (grouped_mm, batched_mm: the block is replaced whole, so
the experts implementation inside does not matter; eager breaks the graph: see :mod:`passes.prepare`).

Nothing is taken on trust: the routing variant and the activation are identified by running the live
router / activation on probe inputs and comparing with our reference, and the block as a whole (routed
experts + shared expert, optionally sigmoid-gated) is checked against the eager block on a probe batch.
A block that matches none of the known forms is left to Inductor with the reason.
"""
from __future__ import annotations

import itertools

import torch
from torch import fx

from graphs.modules import MOE, experts_weights, moe_parts, node_module_keys
from graphs.regions import Region, Rewrite, node_value
from kernels.moe import reference
from kernels.moe.reference import METHODS
from kernels.moe.spec import ExpertsSpec, MoESpec, RouteSpec
from kernels.numerics import close

from .base import PassContext, RegionPass, Skip, eager_probe
from .probes import identify_activation


def _probe_input(w: torch.Tensor, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, w.shape[1], generator=g, dtype=torch.float32).to(w.device)
    logits = x @ w.float().t()
    x = x * (2.0 / logits.std().clamp_min(1e-6))  # spread the logits: no near-ties in top-k
    return x.to(w.dtype)


def _router_outputs(outs, tokens: int, num_experts: int):
    """(weights [T,k], ids [T,k]) among whatever the router returns."""
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    ids = [o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point() and o.dim() == 2]
    ws = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point() and o.dim() == 2
          and o.shape[1] != num_experts]
    if len(ids) != 1 or len(ws) != 1 or ids[0].shape != ws[0].shape or ids[0].shape[0] != tokens:
        raise Skip("router does not return (weights [T, k], ids [T, k]); routing variant unknown")
    return ws[0], ids[0]


def _same_routing(w, ids, ref_w, ref_ids, dtype) -> bool:
    order, ref_order = ids.long().sort(-1), ref_ids.long().sort(-1)
    if not torch.equal(order.values, ref_order.values):
        return False
    w = w.float().gather(1, order.indices)
    ref_w = ref_w.float().gather(1, ref_order.indices)
    return close(w, ref_w, dtype, tol=1e-5 if dtype == torch.float32 else 2e-2)[0]


def _candidates(router, bias, num_experts: int, top_k: int) -> list[RouteSpec]:
    scales = sorted({float(getattr(router, "routed_scaling_factor", 1.0) or 1.0), 1.0}, reverse=True)
    n_group = int(getattr(router, "n_group", None) or getattr(router, "num_group", None) or 1)
    topk_group = int(getattr(router, "topk_group", None) or 1)
    out = []
    for method, renorm, scale, fp32 in itertools.product(METHODS, (False, True), scales, (True, False)):
        grouped = "group" in method
        if grouped and (n_group <= 1 or num_experts % n_group):
            continue
        if "sigmoid" in method and bias is None:
            continue
        out.append(RouteSpec(method, top_k, renorm, scale, n_group if grouped else 1, topk_group if grouped else 1,
                             fp32))
    return out


def identify_routing(router: torch.nn.Module, bias: torch.Tensor | None, num_experts: int,
                     top_k: int | None) -> list[RouteSpec]:
    """The routing variants this router may compute, most likely first.

    When the router returns (weights, ids) they are compared with our reference on probe inputs and only
    the matching variant is returned; when it returns bare logits (routing done in the block's own code),
    every candidate is returned and the whole-block check decides.
    """
    w = router.weight
    x = _probe_input(w, 48, seed=1234)
    with eager_probe():
        outs = router(x)
    try:
        weights, ids = _router_outputs(outs, 48, num_experts)
    except Skip:
        if top_k is None:
            raise Skip("router returns no top-k and the block declares no top_k; routing variant unknown")
        return _candidates(router, bias, num_experts, top_k)
    for spec in _candidates(router, bias, num_experts, ids.shape[1]):
        logits = reference.router_logits(x, w, spec.router_fp32)
        try:
            ref_w, ref_ids = reference.route(logits, bias.float() if "sigmoid" in spec.method else None,
                                             **spec.kwargs())
        except (ValueError, RuntimeError):
            continue
        if _same_routing(weights, ids, ref_w, ref_ids, w.dtype):
            return [spec]
    raise Skip("router matches none of the known routing variants (softmax->top-k, top-k->softmax, "
               "sigmoid+bias group-limited, softmax group-limited)")


class FuseMoE(RegionPass):
    kind = MOE
    name = "moe"

    def required_params(self, module):
        router, experts = moe_parts(module)
        params = [(f"{router}.weight", getattr(module, router).weight)]
        params += [(f"{experts}.{n}", p) for n, p in experts_weights(getattr(module, experts)).items()]
        return params

    def plan(self, ctx: PassContext, region: Region) -> Rewrite:
        block = region.module
        router_name, experts_name = moe_parts(block)
        router, experts = getattr(block, router_name), getattr(block, experts_name)
        for flag, why in (("has_bias", "expert biases"), ("is_transposed", "transposed expert weights"),
                          ("has_post_expert_norm", "a post-expert norm"), ("_is_expert_parallel", "expert parallel")):
            if getattr(experts, flag, False):
                raise Skip(f"experts with {why} are not supported by hybrid::moe yet")
        weights = experts_weights(experts)
        gated = "gate_up_proj" in weights
        w13 = weights["gate_up_proj" if gated else "up_proj"]
        num_experts = w13.shape[0]
        bias = getattr(router, "e_score_correction_bias", None)
        top_k = getattr(block, "top_k", None) or getattr(router, "top_k", None)
        specs = identify_routing(router, bias, num_experts, top_k)
        activation = identify_activation(getattr(experts, "act_fn", None))
        interleaved = not getattr(experts, "is_concatenated", True)
        shared_mlp, shared_gate = self._shared_children(block, router_name, experts_name)

        # Graph side: the shared expert (and its gate) stay in the graph; their outputs feed the op.
        keep = self._kept_nodes(region, [c for c in (shared_mlp, shared_gate) if c is not None])
        nodes = [n for n in region.nodes if n not in keep]
        sub = Region(region.kind, region.key, region.path, region.cls_name, block, nodes)
        outputs = [o for o in sub.outputs if isinstance(node_value(o), torch.Tensor)]  # sizes stay in the graph
        if len(outputs) != 1:
            raise Skip(f"the block has {len(outputs)} outputs used outside it (router logits requested, "
                       "e.g. output_router_logits=True); only the block output can be replaced")
        shared_nodes = [self._child_output(region, keep, c) if c is not None else None
                        for c in (shared_mlp, shared_gate)]
        x = self._activation_input(ctx, region, exclude=set(shared_nodes))  # the block input, unreshaped
        spec = self._check_block(block, specs, ExpertsSpec(gated, interleaved, activation), bias, router, w13,
                                 weights["down_proj"], shared_mlp, shared_gate)

        params = [ctx.param_node(t) for t in (router.weight, w13, weights["down_proj"])]
        bias_node = ctx.param_node(bias) if bias is not None and spec.route.uses_bias else None
        if bias is not None and spec.route.uses_bias and bias_node is None:
            raise Skip("score-correction bias is not an input of this graph")
        args = spec.block_args(x, params[0], bias_node, params[1], params[2], *shared_nodes)
        note = (f"{spec.describe()}{', shared expert' if shared_mlp is not None else ''}"
                f"{' (sigmoid-gated)' if shared_gate is not None else ''}")
        return Rewrite(torch.ops.hybrid.moe_block.default, args, {}, {outputs[0]: None}, note=note, nodes=nodes)

    # -- pieces -------------------------------------------------------------------------------------
    @staticmethod
    def _shared_children(block, router_name, experts_name):
        others = [(n, c) for n, c in block.named_children()
                  if n not in (router_name, experts_name) and any(True for _ in c.parameters())]
        if not others:
            return None, None
        gates = [c for _, c in others if isinstance(c, torch.nn.Linear) and c.out_features == 1]
        mlps = [c for _, c in others if not (isinstance(c, torch.nn.Linear) and c.out_features == 1)]
        if len(mlps) == 1 and len(gates) <= 1:
            return mlps[0], (gates[0] if gates else None)
        raise Skip(f"block children {[n for n, _ in others]} besides router and experts: unknown combination")

    @staticmethod
    def _kept_nodes(region: Region, children) -> set[fx.Node]:
        keys = {str(id(c)) for c in children}
        keep = {n for n in region.nodes if keys & set(node_module_keys(n))}
        stack = list(keep)
        while stack:  # their inputs computed inside the block (e.g. a reshape of x) stay as well
            for a in stack.pop().all_input_nodes:
                if a in region and a not in keep:
                    keep.add(a)
                    stack.append(a)
        return keep

    @staticmethod
    def _child_output(region: Region, keep: set, child) -> fx.Node:
        key = str(id(child))
        mine = [n for n in keep if key in node_module_keys(n)]
        outs = [n for n in mine if any(key not in node_module_keys(u) for u in n.users)]
        if len(outs) != 1:
            raise Skip("cannot find the single output of the shared expert in the graph")
        return outs[0]

    @staticmethod
    def _activation_input(ctx: PassContext, sub: Region, exclude: set) -> fx.Node:
        params = ctx.weight_nodes
        acts = [n for n in sub.inputs if n not in params and n not in exclude
                and isinstance(node_value(n), torch.Tensor) and node_value(n).dim() > 0]
        if len(acts) != 1:
            raise Skip(f"expected one activation input to the block, found {len(acts)}")
        return acts[0]

    @staticmethod
    def _check_block(block, routes, experts, bias, router, w13, w2, shared_mlp, shared_gate) -> MoESpec:
        """The eager block on a probe batch must equal our reference composition of the parts."""
        x = _probe_input(router.weight, 12, seed=4321).to(w13.dtype).view(1, 12, -1)
        flat = x.view(12, -1)
        with eager_probe():
            expected = block(x)
            expected = expected[0] if isinstance(expected, tuple) else expected
            shared = None
            if shared_mlp is not None:
                shared = shared_mlp(flat)
                if shared_gate is not None:
                    shared = torch.sigmoid(shared_gate(flat)) * shared
            msg = ""
            for route in routes:
                spec = MoESpec(route, experts)
                ours = reference.moe(flat, router.weight, bias if route.uses_bias else None, w13, w2, **spec.kwargs())
                if shared is not None:
                    ours = ours + shared
                ok, msg = close(ours.view_as(expected), expected, w13.dtype,
                                tol=1e-4 if w13.dtype == torch.float32 else 3e-2)
                if ok:
                    return spec
        if len(routes) > 1:
            raise Skip("block output matches none of the known routing variants with routed experts "
                       "(+ shared expert)")
        raise Skip(f"block output is not routed experts (+ shared expert) as understood: {msg}")
