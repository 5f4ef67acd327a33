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

import dataclasses
import itertools

import torch
from torch import fx

from graphs.modules import MOE, experts_weights, moe_parts, node_module_keys, router_linear, router_weight
from graphs.regions import Region, Rewrite, node_value
from hybrid_kernels.moe import reference
from hybrid_kernels.moe.reference import METHODS
from hybrid_kernels.moe.spec import ExpertsSpec, MoESpec, MoEWeights, RouteSpec
from hybrid_kernels.numerics import close

from .base import PassContext, RegionPass, Skip, eager_probe
from .probes import identify_experts


#: routings whose experts are the top-k of the raw logits (their scores are monotone in them)
_BY_LOGIT_ORDER = ("softmax_topk", "topk_softmax")


def _probe_input(w: torch.Tensor, tokens: int, seed: int, top_k: int | None = None) -> torch.Tensor:
    """Probe tokens for the router weight ``w`` [E, H]: logits spread to a std of 2, and where ``top_k`` is given, the
    ``tokens`` of a pool of 8x as many whose k-th and (k+1)-th logits lie furthest apart. A near tie there flips an
    expert between two matmuls that round differently (cuBLAS picks kernels by shape), which would fail the probe of a
    routing we compute right; the tokens kept clear the bf16 rounding of the logits. Only for a routing that selects
    by the logits' order: where a bias or groups take part, tokens near the logits' ties are what tell variants
    apart."""
    pool = tokens * 8 if top_k and 0 < top_k < w.shape[0] else tokens
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(pool, w.shape[1], generator=g, dtype=torch.float32).to(w.device)
    logits = x @ w.float().t()
    x = x * (2.0 / logits.std().clamp_min(1e-6))  # spread the logits
    if pool > tokens:
        top = logits.topk(top_k + 1, dim=-1).values
        gap = (top[:, top_k - 1] - top[:, top_k]) / top.abs().amax(-1).clamp_min(1e-6)
        x = x[gap.topk(tokens).indices.sort().values]
    return x.to(w.dtype)


def _near_tie_input(w: torch.Tensor, tokens: int, seed: int) -> torch.Tensor | None:
    """Probe tokens whose logits all sit near one common value (8, spread about 0.1): the relative gaps a
    sparse mixer thresholds fall on both sides of a threshold of about 0.02. None when no input moves every
    logit alike (more experts than hidden size)."""
    wf = w.detach().float().cpu()
    if wf.shape[0] > wf.shape[1]:
        return None
    u = torch.linalg.lstsq(wf, torch.ones(wf.shape[0], 1)).solution.reshape(-1)  # w @ u = 1
    g = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randn(tokens, wf.shape[1], generator=g)
    noise = noise * (0.1 / (noise @ wf.t()).std().clamp_min(1e-6))
    return (8.0 * u + noise).to(device=w.device, dtype=w.dtype)


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


#: attribute names of a routed scaling factor, on the router or the block
_SCALES = ("routed_scaling_factor", "router_scaling_factor", "route_scale", "routed_scale", "router_scale")


def _scales(owner) -> list[float]:
    """The routed scaling factors an owner (router or block) holds."""
    return [float(v) for n in _SCALES if isinstance(v := getattr(owner, n, None), (int, float))
            and not isinstance(v, bool) and v and v != 1]


def _candidates(owners, bias, num_experts: int, top_k: int) -> list[RouteSpec]:
    """The routing variants to try, from the attributes of ``owners`` (the router, then the block)."""
    def attr(*names):
        return next((getattr(o, n) for o in owners for n in names if getattr(o, n, None) is not None), None)
    scales = sorted({f for o in owners for f in _scales(o)} | {1.0}, reverse=True)
    n_group = int(attr("n_group", "num_group") or 1)
    topk_group = int(attr("topk_group") or 1)
    jitter = attr("router_jitter_noise", "jitter_eps", "jitter_noise")
    out = []
    for method, renorm, scale, fp32 in itertools.product(METHODS, (False, True), scales, (True, False)):
        # sigmoid routing with one group is plain sigmoid top-k (with or without a correction bias); softmax routing
        # with one group is softmax_topk itself
        groups = n_group if "group" in method else 1
        if num_experts % groups or (method == "softmax_group_topk" and groups <= 1) or (
                method in ("softmax_bias_topk", "sigmoid_logit_bias_topk") and bias is None):
            continue
        if method == "sparsemixer":  # two picks whatever top_k says; the threshold from the router's attribute
            if isinstance(jitter, (int, float)) and not isinstance(jitter, bool) and jitter >= 0 and not renorm:
                out.append(RouteSpec(method, 2, False, scale, 1, 1, fp32, float(jitter)))
            continue
        out.append(RouteSpec(method, top_k, renorm, scale, groups, min(topk_group, groups), fp32))
    return out


def _logit_bias(linear: torch.nn.Module, num_experts: int) -> torch.Tensor | None:
    """The router linear's own bias [E] (a bare ``bias`` next to the weight), or None."""
    b = getattr(linear, "bias", None)
    return b if isinstance(b, torch.Tensor) and tuple(b.shape) == (num_experts,) else None


def _correction_bias(block, router, linear, experts, num_experts: int) -> torch.Tensor | None:
    """The score-correction bias: a tensor of E values held by the router (or a child of it) or by the block itself,
    other than the router linear's own bias (``e_score_correction_bias``, ``expert_bias``); None without one, Skip
    when several could be it."""
    own = _logit_bias(linear, num_experts)
    found = {id(t): t for t in [*router.parameters(), *router.buffers(), *block.parameters(recurse=False),
                                *block.buffers(recurse=False)]
             if t.numel() == num_experts and t.dim() <= 2 and t is not own}
    if len(found) > 1:
        raise Skip("more than one tensor of one value per expert in the router / block: which is the correction "
                   "bias is not known")
    return next(iter(found.values()), None)


def identify_routing(router: torch.nn.Module, linear: torch.nn.Module, bias: torch.Tensor | None, num_experts: int,
                     top_k: int | None, owners: tuple = ()) -> list[RouteSpec]:
    """The routing variants this router may compute, most likely first.

    When the router returns (weights, ids) they are compared with our reference on probe inputs and only
    the matching variant is returned; when it returns bare logits (routing done in the block's own code),
    every candidate is returned and the whole-block check decides.
    """
    w = linear.weight
    x = _probe_input(w, 48, seed=1234)
    try:
        with eager_probe():
            outs = router(x)
        weights, ids = _router_outputs(outs, 48, num_experts)
    except (Skip, TypeError):  # bare logits, or a router called with more than the input: the block check decides
        if top_k is None:
            raise Skip("router returns no top-k and the block declares no top_k; routing variant unknown")
        return _candidates(owners, bias, num_experts, top_k)
    near = None
    for spec in _candidates(owners, bias, num_experts, ids.shape[1]):
        if not _routes_alike(router, linear, spec, bias, num_experts, x, (weights, ids)):
            continue
        if spec.method == "sparsemixer":  # its threshold matters only near ties: prove it there too
            near = _near_tie_input(w, 48, seed=4321) if near is None else near
            if near is not None and not _routes_alike(router, linear, spec, bias, num_experts, near):
                continue
        return [spec]
    raise Skip("router matches none of the known routing variants (softmax->top-k, top-k->softmax, "
               "sigmoid (+ correction bias, group-limited or not), softmax group-limited, softmax + correction bias, "
               "sigmoid with the bias on the logits, sparse mixer)")


def _routes_alike(router, linear, spec: RouteSpec, bias, num_experts: int, x: torch.Tensor, outs=None) -> bool:
    """Whether the live router's (weights, ids) on ``x`` (``outs`` when already computed) are the reference's."""
    if outs is None:
        try:
            with eager_probe():
                outs = _router_outputs(router(x), x.shape[0], num_experts)
        except Skip:
            return False
    logits = reference.router_logits(x, linear.weight, spec.router_fp32, _logit_bias(linear, num_experts))
    try:
        ref_w, ref_ids = reference.route(logits, bias.float() if spec.uses_bias and bias is not None else None,
                                         **spec.kwargs())
    except (ValueError, RuntimeError):
        return False
    return _same_routing(*outs, ref_w, ref_ids, linear.weight.dtype)


def _sizes(experts, weights) -> tuple[int, int]:
    """(experts, hidden size) of an experts module's 3-D weights."""
    down = weights["down_proj"]
    return down.shape[0], down.shape[2] if getattr(experts, "is_transposed", False) else down.shape[1]


class FuseMoE(RegionPass):
    kind = MOE
    name = "moe"

    def required_params(self, module):
        router, experts = moe_parts(module)
        w = experts_weights(getattr(module, experts))
        params = [(f"{router} weight", router_weight(getattr(module, router), *_sizes(getattr(module, experts), w)))]
        params += [(f"{experts}.{n}", p) for n, p in w.items()]
        return params

    def plan(self, ctx: PassContext, region: Region) -> Rewrite:
        block = region.module
        router_name, experts_name = moe_parts(block)
        router, experts = getattr(block, router_name), getattr(block, experts_name)
        for flag, why in (("has_post_expert_norm", "a post-expert norm"), ("_is_expert_parallel", "expert parallel")):
            if getattr(experts, flag, False):
                raise Skip(f"experts with {why} are not supported by hybrid::moe yet")
        live = self._weights(block, router, experts)
        num_experts = live.w13.shape[0]
        top_k = getattr(block, "top_k", None) or getattr(router, "top_k", None)
        linear = router_linear(router, *_sizes(experts, experts_weights(experts)))
        routes = identify_routing(router, linear, live.router_bias, num_experts, top_k, owners=(router, block))
        # a block may scale the routed output itself (a routed scaling factor applied after aggregation)
        routes = list(dict.fromkeys(dataclasses.replace(r, scale=r.scale * f) for r in routes
                                    for f in [1.0, *_scales(block)]))
        experts_spec = identify_experts(experts, "gate_up_proj" in experts_weights(experts))
        hidden = live.router_w.shape[1]
        shared_mlp, shared_gate, post_norm = self._shared_children(block, router_name, experts_name, hidden)

        # Graph side: the shared expert (and its gate) stay in the graph, their outputs feed the op; a norm on
        # the block's output stays too, reading the op's output in place of the sum it normalised.
        keep = self._kept_nodes(region, [c for c in (shared_mlp, shared_gate) if c is not None])
        if post_norm is not None:
            keep |= {n for n in region.nodes if str(id(post_norm)) in node_module_keys(n)}
        nodes = [n for n in region.nodes if n not in keep]
        sub = Region(region.kind, region.key, region.path, region.cls_name, block, nodes)
        outputs = [o for o in sub.outputs if isinstance(node_value(o), torch.Tensor)]  # sizes stay in the graph
        if len(outputs) != 1 and post_norm is not None:
            raise Skip(f"the block's norm child is not applied last, to routed + shared experts ({len(outputs)} "
                       "values cross it)")
        if len(outputs) != 1:
            raise Skip(f"the block has {len(outputs)} outputs used outside it (router logits requested, "
                       "e.g. output_router_logits=True); only the block output can be replaced")
        shared_nodes = [self._child_output(region, keep, c) if c is not None else None
                        for c in (shared_mlp, shared_gate)]
        x = self._activation_input(ctx, region, exclude=set(shared_nodes))  # the block input, unreshaped
        spec = self._check_block(block, routes, experts_spec, live, shared_mlp, shared_gate, post_norm)
        live = spec._tensors(live)  # the correction bias only where the routing reads it

        def node(name, t):
            n = ctx.param_node(t)
            if t is not None and n is None:
                raise Skip(f"the block's {name} is not an input of this graph")
            return n
        args = spec.block_args(x, MoEWeights(*(node(f, t) for f, t in zip(MoEWeights._fields, live))), *shared_nodes)
        note = (f"{spec.describe()}{', shared expert' if shared_mlp is not None else ''}"
                f"{' (sigmoid-gated)' if shared_gate is not None else ''}"
                f"{', output norm kept' if post_norm is not None else ''}")
        return Rewrite(torch.ops.hybrid.moe_block.default, args, {}, {outputs[0]: None}, note=note, nodes=nodes)

    # -- pieces -------------------------------------------------------------------------------------
    @staticmethod
    def _weights(block, router, experts) -> MoEWeights:
        """The block's live tensors: router weight, its own bias, the correction bias, expert weights and biases."""
        weights = experts_weights(experts)
        linear = router_linear(router, *_sizes(experts, weights))
        gated = "gate_up_proj" in weights
        w13 = weights["gate_up_proj" if gated else "up_proj"]
        b13 = b2 = None
        if getattr(experts, "has_bias", False):
            b13 = getattr(experts, "gate_up_proj_bias" if gated else "up_proj_bias", None)
            b2 = getattr(experts, "down_proj_bias", None)
            if b13 is None or b2 is None:
                raise Skip("experts with biases whose names are not gate_up_proj_bias / up_proj_bias and down_proj_bias")
        num = w13.shape[0]
        return MoEWeights(linear.weight, _logit_bias(linear, num), _correction_bias(block, router, linear, experts, num),
                          w13, weights["down_proj"], b13, b2)

    @staticmethod
    def _shared_children(block, router_name, experts_name, hidden: int):
        """(shared expert, its sigmoid gate, a norm of the block's output) among the block's other children, each
        None when absent. Which part is which comes from shape alone; ``_check_block`` proves the composition."""
        others = [(n, c) for n, c in block.named_children()
                  if n not in (router_name, experts_name) and any(True for _ in c.parameters())]
        gates = [c for _, c in others if isinstance(c, torch.nn.Linear) and c.out_features == 1]
        norms = [c for _, c in others if "norm" in type(c).__name__.lower()
                 and all(tuple(p.shape) == (hidden,) for p in c.parameters())]
        mlps = [c for _, c in others if not any(c is o for o in gates + norms)]
        if len(mlps) <= 1 and len(gates) <= len(mlps) and len(norms) <= 1:
            return (mlps[0] if mlps else None), (gates[0] if gates else None), (norms[0] if norms else None)
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
        if len(acts) > 1 and any(not node_value(n).is_floating_point() for n in acts):
            raise Skip("the block reads token ids besides its hidden states (routing by token id, e.g. a hash "
                       "table): not a routing variant of hybrid::moe")
        if len(acts) != 1:
            raise Skip(f"expected one activation input to the block, found {len(acts)}")
        return acts[0]

    @staticmethod
    def _check_block(block, routes, experts: ExpertsSpec, live: MoEWeights, shared_mlp, shared_gate,
                     post_norm=None) -> MoESpec:
        """The eager block on a probe batch must equal our reference composition of the parts (the live output
        norm applied last, where the block has one)."""
        by_order = all(r.method in _BY_LOGIT_ORDER and r.n_group == 1 for r in routes)
        x = _probe_input(live.router_w, 12, seed=4321, top_k=routes[0].top_k if by_order else None)
        x = x.to(live.w13.dtype).view(1, 12, -1)
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
                w = spec._tensors(live)
                w13, w2 = (w.w13.transpose(1, 2), w.w2.transpose(1, 2)) if experts.transposed else (w.w13, w.w2)
                ours = reference.moe(flat, w.router_w, w.router_bias, w13, w2, **spec.kwargs(),
                                     router_logit_bias=w.router_logit_bias, b13=w.b13, b2=w.b2)
                if shared is not None:
                    ours = ours + shared
                if post_norm is not None:
                    ours = post_norm(ours)
                ok, msg = close(ours.view_as(expected), expected, live.w13.dtype,
                                tol=1e-4 if live.w13.dtype == torch.float32 else 3e-2)
                if ok:
                    return spec
        if len(routes) > 1:
            raise Skip("block output matches none of the known routing variants with routed experts "
                       "(+ shared expert)")
        raise Skip(f"block output is not routed experts (+ shared expert) as understood: {msg}")
