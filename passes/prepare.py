"""HF preparation: what hybrid changes in transformers itself (not in a graph) so that dynamo traces graphs the passes
can rewrite. A stage of its own, run before the pass pipeline: by the backend on each graph (``prepare_graph``) and
by the engine on its model before it compiles (``prepare_model``).

The changes, each made at most once per process and each exact (same math as HF's code):

1. Experts with ``config._experts_implementation == "eager"``: HF's eager experts loop over ``nonzero()`` and dynamo
   breaks the graph inside every MoE block, so no graph holds a whole block. hybrid registers its own experts
   implementation, ``"hybrid"``, in HF's ``ALL_EXPERTS_FUNCTIONS`` (one ``hybrid::moe_experts_rt`` call: no graph
   break) and switches the model's config to it when a graph first shows blocks split this way. Dynamo guards on
   that config value; the backend drops dynamo's compiled code once (when the first split graph runs), so the next
   call retraces the model into whole-block graphs, which the MoE pass rewrites. The first call runs the split graphs
   as they are (correct, not fused). Eager runs of the model afterwards also use hybrid's experts implementation.
2. HF's Mamba1 scan: Mamba1 / Jamba mixers call a module-level ``mamba_selective_scan`` (mamba_ssm's kernel when
   installed, else a torch path that dynamo traces with the length as a constant: stock ``torch.compile`` recompiles
   for every new prompt length, before any backend sees a graph). hybrid replaces that function of the mixer's
   module with a wrapper that calls HF's own function when running eagerly and, while dynamo traces, the opaque
   ``hybrid::selective_scan_rt`` (same math, a shape-only fake: the length stays symbolic). Installed when a graph
   first shows such a mixer (then one retrace, as above) or by the engine before it compiles (no retrace). The
   wrapper stays for the process: any later trace of that HF module (other backends, torch.export) sees the opaque op
   too, whose implementation is hybrid's scan; an exported program then needs hybrid's ops registered.
3. The gated delta rule: HF's delta-rule mixers (Gated DeltaNet, Kimi Delta Attention) call module-level functions
   with flash-linear-attention's interface (``query, key, value, g, beta, ..., initial_state, output_final_state,
   use_qk_l2norm_in_kernel``): a torch loop over chunks or tokens that dynamo unrolls and specialises on the
   length. They are found by that signature, not by name, and proven before anything changes: each is run against
   ``hybrid::delta_rule`` on a probe (decay per head and per key channel, an initial state; only the kinds that
   agree are taken) and the live mixer is run with and without the replacement. The wrapper calls HF's function
   when running eagerly and the opaque op while dynamo traces; a mixer that fails a proof keeps HF's functions and
   the delta pass reports why.
4. MoE blocks whose experts are split over two modules of one 3-D weight each (gate-up [E, 2I | I, H], down
   [E, H, I]) beside a router [E, H], optionally with a bias [H] after the sum (``graphs.modules.split_moe_layouts``;
   JetMoE's MLP): their forward leaves dynamo's graph (``tolist`` of the expert sizes), so graphs show only the
   experts modules. On their first sight every live block is looked up and each class planned: routing, gate-up
   layout and activation proven on a probe of the live block against ``hybrid::moe_block``, for all blocks of the
   class or for none (the reason goes to the report). The class's ``forward`` is wrapped: a block with a plan runs
   ``hybrid::moe_block_rt`` (plus its bias), eagerly too; any other block runs HF's code. One retrace.
"""
from __future__ import annotations

import functools
import gc
import sys
import warnings
import weakref

import torch

from graphs.modules import experts_weights, is_delta_mixer, is_mamba1_mixer, router_linear, split_moe_layouts
from hybrid_kernels.moe.spec import ExpertsSpec, MoESpec, MoEWeights, RouteSpec
from hybrid_kernels.numerics import close

from .base import PassContext, Skip, eager_probe
from .probes import identify_activation, identify_experts

EXPERTS_NAME = "hybrid"
SCAN_NAME = "mamba_selective_scan"


# -- 1. experts --------------------------------------------------------------------------------------------------
def hybrid_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF experts-function signature: hidden [T, H], ids [T, k], weights [T, k] -> [T, H]."""
    gated = getattr(self, "has_gate", True)
    spec = getattr(self, "_hybrid_experts", None)
    if spec is None:
        spec = self._hybrid_experts = identify_experts(self, gated)
    w13 = self.gate_up_proj if gated else self.up_proj
    b13 = b2 = None
    if getattr(self, "has_bias", False):
        b13, b2 = getattr(self, "gate_up_proj_bias" if gated else "up_proj_bias"), self.down_proj_bias
    # the run-time twin: opaque to dynamo, so the token count never becomes a guard
    return torch.ops.hybrid.moe_experts_rt(hidden_states, w13, self.down_proj, b13, b2, top_k_weights.float(),
                                           top_k_index, *spec.static())


def register_experts() -> bool:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    if EXPERTS_NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, hybrid_experts_forward)
    return True


def _is_experts_of(obj, config_ids: set) -> bool:
    try:  # weak proxies to dead objects raise on any access
        return (isinstance(obj, torch.nn.Module) and id(getattr(obj, "config", None)) in config_ids
                and experts_weights(obj) is not None)
    except ReferenceError:
        return False


def _adopt_eager_experts(ctx: PassContext) -> str:
    """Switch configs whose experts use HF's eager loop to hybrid's experts implementation; returns the graph note."""
    configs = {}
    for rec in ctx.index:
        cfg = getattr(rec.module, "config", None)
        if getattr(cfg, "_experts_implementation", None) == "eager":
            configs[id(cfg)] = cfg
    if not configs:
        return ""
    with warnings.catch_warnings():  # touching every live object trips deprecation shims (torch.distributed)
        warnings.simplefilter("ignore")
        experts = [o for o in gc.get_objects() if _is_experts_of(o, set(configs))]
    if not experts:
        return ""
    why = next((f for e in experts for f in ("has_post_expert_norm", "_is_expert_parallel") if getattr(e, f, False)),
               None)
    for e in experts if why is None else ():
        try:  # the experts' math, proven once per module (hybrid_experts_forward reads it)
            e._hybrid_experts = identify_experts(e, getattr(e, "has_gate", True))
        except Skip as skip:
            why = str(skip)
            break
    if why is not None or not register_experts():
        return (f"experts implementation 'eager' breaks the graph in every MoE block ({len(experts)} experts modules) "
                f"and these experts are not supported by hybrid ({why or 'no experts interface'}): left as they are")
    for cfg in configs.values():
        cfg._experts_implementation = EXPERTS_NAME
    ctx.retrace = True
    return (f"experts implementation 'eager' loops over nonzero() and breaks the graph in every MoE block "
            f"({len(experts)} experts modules): switched the model to hybrid's registered experts implementation; "
            "the next call recompiles into whole-block graphs")


# -- 2. HF's Mamba1 scan ------------------------------------------------------------------------------------------
def _wrap_scan(original):
    @functools.wraps(original)
    def hybrid_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              return_last_state=False, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return original(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
                            *args, **kwargs)
        y, last = torch.ops.hybrid.selective_scan_rt(hidden_states, dt, A, B, C, D, z, delta_bias,
                                                     bool(delta_softplus), None)
        return (y, last) if return_last_state else y
    hybrid_selective_scan._hybrid_original = original
    return hybrid_selective_scan


def _hf_scan(mixer_cls: type):
    """HF's scan function of ``mixer_cls``'s module, if it has one and it is not wrapped yet."""
    fn = getattr(sys.modules.get(mixer_cls.__module__), SCAN_NAME, None)
    return None if fn is None or hasattr(fn, "_hybrid_original") else fn


def install_scan(mixer_cls: type) -> bool:
    """Wrap the scan of ``mixer_cls``'s HF module; True when newly installed."""
    fn = _hf_scan(mixer_cls)
    if fn is None:
        return False
    setattr(sys.modules[mixer_cls.__module__], SCAN_NAME, _wrap_scan(fn))
    return True


def _adopt_mamba1_scans(ctx: PassContext) -> str:
    """Install for the Mamba1 mixers of this graph when it first runs, then retrace; returns the graph note."""
    classes = {type(rec.module) for rec in ctx.index if rec.module is not None and is_mamba1_mixer(rec.module)}
    pending = [c for c in classes if _hf_scan(c) is not None]
    if not pending:
        return ""
    ctx.before_retrace.extend(functools.partial(install_scan, c) for c in pending)
    ctx.retrace = True
    return ("HF's Mamba1 scan specialised this graph on the length: from the next call it runs as "
            "hybrid::selective_scan_rt (one recompile, then one graph for every length)")


# -- 3. the gated delta rule ------------------------------------------------------------------------------------
DELTA_PARAMS = ("query", "key", "value", "g", "beta")
#: mixer class -> why its delta-rule functions were left as HF wrote them (read by the delta pass)
DELTA_REFUSED: dict[type, str] = {}


def hub_function(obj):
    """The Python function behind a module-level HF function: the function itself, or the one a hub-kernel wrapper
    calls (with Hugging Face's ``kernels`` package installed, ``use_kernel_forward_from_hub`` makes each such
    function an ``nn.Module`` instance whose ``forward`` calls it, so that ``kernelize`` can swap it); else None."""
    import inspect
    if inspect.isfunction(obj):
        return obj
    forward = getattr(type(obj), "forward", None) if isinstance(obj, torch.nn.Module) else None
    if not inspect.isfunction(forward) or forward.__closure__ is None:
        return None
    inner = [c.cell_contents for name, c in zip(forward.__code__.co_freevars, forward.__closure__)
             if name == "func" and inspect.isfunction(c.cell_contents)]
    return inner[0] if inner else None


def _delta_functions(mixer_cls: type) -> dict[str, object]:
    """The module-level functions of ``mixer_cls``'s module with the delta-rule interface, not yet wrapped: name ->
    the object found there (a function or its hub-kernel wrapper: ``hub_function``)."""
    import inspect
    mod = sys.modules.get(mixer_cls.__module__)
    found = {}
    for name, obj in vars(mod).items() if mod is not None else ():
        fn = hub_function(obj)
        if fn is None or hasattr(obj, "_hybrid_original"):
            continue
        params = list(inspect.signature(fn).parameters)
        if tuple(params[:5]) == DELTA_PARAMS and {"initial_state", "output_final_state"} <= set(params):
            found[name] = obj
    return found


def _wrap_delta(original, kinds: frozenset):
    import inspect
    signature = inspect.signature(hub_function(original))
    names = list(signature.parameters)
    defaults = {k: p.default for k, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}

    @functools.wraps(hub_function(original))
    def hybrid_delta_rule(*args, **kwargs):
        if not (torch.compiler.is_compiling() or getattr(hybrid_delta_rule, "_force", False)):
            return original(*args, **kwargs)
        bound = dict(defaults)
        bound.update(zip(names, args))
        bound.update(kwargs)
        q, k, v, g, beta = (bound[n] for n in DELTA_PARAMS)
        kind = "channel" if g.dim() == 4 else "head"
        if kind not in kinds:
            return original(*args, **kwargs)
        scale = bound.get("scale")
        scale = float(k.shape[-1] ** -0.5) if scale is None else float(scale)
        o, final = torch.ops.hybrid.delta_rule(q, k, v, g, beta, scale, bound.get("initial_state"),
                                               bound.get("cu_seqlens"), bool(bound.get("use_qk_l2norm_in_kernel")))
        return o.to(q.dtype), (final if bound.get("output_final_state") else None)
    hybrid_delta_rule._hybrid_original = original
    hybrid_delta_rule._hybrid_kinds = kinds
    return hybrid_delta_rule


def _probe_kinds(fn, device, dtype) -> tuple[frozenset, str]:
    """The decay kinds ("head", "channel") on which ``fn`` equals hybrid::delta_rule, and why the others do not."""
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
    B, T, H, K, V = 2, 11, 2, 16, 8
    q, k, v, beta = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), torch.rand(B, T, H, generator=gen).to(device, dtype)
    s0 = torch.randn(B, H, K, V, generator=gen).to(device)
    ok, why = set(), []
    for kind, g in (("head", -torch.rand(B, T, H, generator=gen)), ("channel", -torch.rand(B, T, H, K, generator=gen))):
        g = g.to(device, torch.float32)
        try:
            want = fn(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
            got = torch.ops.hybrid.delta_rule(q, k, v, g, beta, K ** -0.5, s0, None, True)
            good = all(close(a.to(b.dtype), b, dtype, tol=1e-4 if dtype == torch.float32 else 3e-2)[0]
                       for a, b in zip(got, want))
        except Exception as e:  # noqa: BLE001  (a function that cannot take this decay kind does not get it)
            good, e_msg = False, f"{type(e).__name__}: {e}"
        else:
            e_msg = "differs from hybrid::delta_rule"
        if good:
            ok.add(kind)
        else:
            why.append(f"{hub_function(fn).__name__} with a decay per {kind}: {e_msg}")
    return frozenset(ok), "; ".join(why)


def install_delta(mixer: torch.nn.Module) -> bool:
    """Wrap the delta-rule functions of ``mixer``'s HF module after proving them; True when newly installed."""
    cls = type(mixer)
    if cls in DELTA_REFUSED:
        return False
    fns = _delta_functions(cls)
    if not fns:
        return False
    p = next(mixer.parameters())
    dtype = p.dtype if p.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    wrapped, notes = {}, []
    with torch.no_grad():
        for name, fn in fns.items():
            kinds, why = _probe_kinds(fn, p.device, dtype)
            if kinds:
                wrapped[name] = _wrap_delta(fn, kinds)
            notes.append(why)
    if not wrapped:
        DELTA_REFUSED[cls] = "; ".join(n for n in notes if n) or "no delta-rule function agrees with hybrid's"
        return False
    mod = sys.modules[cls.__module__]
    for name, w in wrapped.items():
        setattr(mod, name, w)
    why = _probe_mixer(mixer, list(wrapped.values()))
    if why:
        for name, fn in fns.items():
            if name in wrapped:
                setattr(mod, name, fn)
        DELTA_REFUSED[cls] = why
        return False
    return True


def _probe_mixer(mixer: torch.nn.Module, wrappers: list) -> str:
    """The live mixer (no cache) with hybrid's op in place of HF's functions equals HF's own; '' or why not."""
    p = next(mixer.parameters())
    hidden = getattr(mixer, "hidden_size", None) or getattr(getattr(mixer, "config", None), "hidden_size", None)
    if hidden is None:
        return "cannot tell the mixer's hidden size for its probe"
    x = torch.randn(2, 9, hidden, generator=torch.Generator().manual_seed(3)).to(p.device, p.dtype)
    try:
        with torch.no_grad():
            want = mixer(x)
            for w in wrappers:
                w._force = True
            got = mixer(x)
    except Exception as e:  # noqa: BLE001
        return f"the mixer's probe failed with hybrid's delta rule ({type(e).__name__}: {e})"
    finally:
        for w in wrappers:
            w._force = False
    want, got = (t[0] if isinstance(t, tuple) else t for t in (want, got))
    ok, msg = close(got, want, p.dtype, tol=1e-4 if p.dtype == torch.float32 else 3e-2)
    return "" if ok else f"the mixer with hybrid's delta rule differs from HF's ({msg})"


def _adopt_delta_rules(ctx: PassContext) -> str:
    mixers = {}
    for rec in ctx.index:
        if rec.module is not None and is_delta_mixer(rec.module):
            mixers.setdefault(type(rec.module), rec.module)
    pending = [m for c, m in mixers.items() if c not in DELTA_REFUSED and _delta_functions(c)]
    if not pending:
        return ""
    ctx.before_retrace.extend(functools.partial(install_delta, m) for m in pending)
    ctx.retrace = True
    return ("HF's delta-rule functions unroll over chunks and specialise this graph on the length: from the next "
            "call they run as hybrid::delta_rule (one recompile, then one graph for every length)")


# -- 4. MoE blocks with experts split over two modules ------------------------------------------------------------
#: the name of a block's plan (``_plan_split_moe``): read by the class's wrapped forward
SPLIT_PLAN = "_hybrid_split_moe"
#: block class -> why its blocks run as HF wrote them
SPLIT_MOE_REFUSED: dict[type, str] = {}


def _attr_path(root: torch.nn.Module, target: torch.nn.Module) -> str:
    return next(n for n, m in root.named_modules() if m is target)


def _follow(root, path: str):
    for part in path.split(".") if path else ():
        root = getattr(root, part)
    return root


def _split_moe_weights(block, plan) -> MoEWeights:
    router, up, down = (_follow(block, path) for path in plan[:3])
    return MoEWeights(router.weight, getattr(router, "bias", None), None, up.weight, down.weight)


def _run_split_moe(block, plan, x: torch.Tensor, op) -> torch.Tensor:
    """``block``'s output through ``op`` (``hybrid::moe_block`` or its run-time twin), the block's bias added after."""
    out = op(*plan[4].block_args(x, _split_moe_weights(block, plan)))
    return out if plan[3] is None else out + getattr(block, plan[3])


def _wrap_split_moe(original):
    @functools.wraps(original)
    def hybrid_split_moe_forward(self, hidden_states, *args, **kwargs):
        plan = getattr(self, SPLIT_PLAN, None)
        if plan is None or args or kwargs:
            return original(self, hidden_states, *args, **kwargs)
        # the run-time twin: opaque to dynamo, so the token count never becomes a guard
        return _run_split_moe(self, plan, hidden_states, torch.ops.hybrid.moe_block_rt)
    hybrid_split_moe_forward._hybrid_original = original
    return hybrid_split_moe_forward


def _plan_split_moe(block: torch.nn.Module) -> tuple:
    """The plan (router path, gate-up path, down path, bias name, MoESpec) under which ``hybrid::moe_block`` computes
    ``block``'s forward, proven on a probe of the live block against each layout, routing and activation a split
    block can have; Skip with the reason when none agrees."""
    from .moe import _probe_input
    original = getattr(type(block).forward, "_hybrid_original", type(block).forward)
    layouts = split_moe_layouts(block)
    last = "no layout"
    for router_name, up, down, bias in layouts:
        wd = getattr(block, down).weight
        e, h = wd.shape[0], wd.shape[1]
        router = router_linear(getattr(block, router_name), e, h)
        top_k = next((int(k) for k in (getattr(o, a, None) for o in (getattr(block, router_name), block)
                                        for a in ("top_k", "num_experts_per_tok")) if isinstance(k, int)), None)
        if top_k is None:
            raise Skip("a split MoE block with no top_k attribute on its router or itself")
        x = _probe_input(router.weight, 12, 0, top_k)[None]
        try:
            with eager_probe():
                want = original(block, x)
        except Exception as exc:  # noqa: BLE001  (a block called another way, e.g. JetMoE's attention experts)
            raise Skip(f"the block's forward does not run on hidden states alone ({type(exc).__name__}: "
                       f"{' '.join(str(exc).split())[:120]})") from None
        if not isinstance(want, torch.Tensor) or want.shape != x.shape:
            raise Skip("the block does not return one tensor of its input's shape")
        act = getattr(block, "activation", None) or getattr(block, "act_fn", None)
        if act is None:
            raise Skip("a split MoE block with no activation module (activation / act_fn)")
        activation = identify_activation(act)
        gated = getattr(block, up).weight.shape[1] == 2 * wd.shape[2]
        paths = (_attr_path(block, router), up, down)
        for method, renorm in (("topk_softmax", False), ("softmax_topk", True), ("softmax_topk", False)):
            for interleaved in (False, True) if gated else (False,):
                spec = MoESpec(RouteSpec(method, top_k, renorm), ExpertsSpec(gated, interleaved, activation))
                plan = (*paths, bias, spec)
                with eager_probe():
                    got = _run_split_moe(block, plan, x, torch.ops.hybrid.moe_block)
                ok, last = close(got, want, x.dtype, tol=1e-4 if x.dtype == torch.float32 else 3e-2)
                if ok:
                    return plan
    raise Skip(f"a split MoE block that no routing and activation hybrid knows reproduces ({last})")


def install_split_moe(cls: type, plans: dict) -> bool:
    """Wrap ``cls.forward`` (once) and give each block of ``plans`` {block: plan} its plan; True when newly wrapped."""
    for block, plan in plans.items():
        setattr(block, SPLIT_PLAN, plan)
    if hasattr(cls.forward, "_hybrid_original"):
        return False
    cls.forward = _wrap_split_moe(cls.forward)
    return True


#: split experts module -> its block, for every block of a class looked up (``_find_split_blocks``)
_BLOCK_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: block -> its name in the outermost HF model that holds it (the graphs' module paths start where a graph break
#: resumed)
_PATH_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: split experts modules a lookup has seen (with a block or without one): not looked up again
_LOOKED_UP: "weakref.WeakSet" = weakref.WeakSet()


def _is_split_expert(m: torch.nn.Module) -> bool:
    params = dict(m.named_parameters())
    return list(params) == ["weight"] and params["weight"].dim() == 3


def _find_split_blocks() -> dict[type, list]:
    """Every live module with a split MoE layout, by class; their experts modules recorded in ``_BLOCK_OF``. A block's
    forward leaves dynamo's graph (JetMoE's ``tolist``), so graphs show its experts modules, never the block."""
    found: dict[type, list] = {}
    roots = []
    with warnings.catch_warnings():  # touching every live object trips deprecation shims (torch.distributed)
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if not isinstance(o, torch.nn.Module):
                    continue
                if hasattr(o, "config") and hasattr(o, "base_model_prefix"):  # an HF model: names its blocks
                    roots.append(o)
                if not split_moe_layouts(o):
                    continue
            except ReferenceError:
                continue
            found.setdefault(type(o), []).append(o)
            for child in o.children():
                if _is_split_expert(child):
                    _BLOCK_OF[child] = o
    blocks = {b for bs in found.values() for b in bs}
    for root in roots:  # the longest name wins: the outermost model's (model.layers.0.mlp, not layers.0.mlp)
        for name, m in root.named_modules():
            if m in blocks and len(name) > len(_PATH_OF.get(m, "")):
                _PATH_OF[m] = name
    return found


def plan_split_moe_class(blocks: list) -> tuple[dict, str | None]:
    """Plans for ``blocks`` (all of one class), or ({}, why) when one of them has none: a class runs hybrid's op in
    every block or in none."""
    plans = {}
    for block in blocks:
        try:
            plans[block] = _plan_split_moe(block)
        except Skip as e:
            return {}, str(e)
    return plans, None


def _adopt_split_moe(ctx: PassContext) -> str:
    """Split MoE blocks (``split_moe_layouts``) behind this graph: their regions for the report (a block with a plan
    is in the graph whole; one without shows only its experts modules); on the first sight of such experts, every
    live block is looked up and each class planned: all of its blocks, or none. Planned classes get the wrapped
    forward before one retrace."""
    from .base import DETECTED as DETECTED_SPLIT, REWRITTEN, SKIPPED, RegionResult
    blocks: dict[str, tuple[torch.nn.Module, str]] = {}  # path in this graph -> (block, class name)
    unseen = []
    for rec in ctx.index:
        m = rec.module
        if m is None:
            continue
        if split_moe_layouts(m):
            blocks.setdefault(rec.path, (m, rec.cls))
        elif _is_split_expert(m):
            if m in _BLOCK_OF:
                block = _BLOCK_OF[m]
                blocks.setdefault(rec.path.rpartition(".")[0], (block, type(block).__name__))
            elif m not in _LOOKED_UP:
                unseen.append(m)
    notes = []
    if unseen:
        found_blocks = _find_split_blocks()
        _LOOKED_UP.update(unseen)
        for cls, found in found_blocks.items():
            pending = [b for b in found if getattr(b, SPLIT_PLAN, None) is None]
            if not pending or cls in SPLIT_MOE_REFUSED:
                continue
            plans, why = plan_split_moe_class(pending)
            if why is not None:
                SPLIT_MOE_REFUSED[cls] = why
                continue
            ctx.before_retrace.append(functools.partial(install_split_moe, cls, plans))
            ctx.retrace = True
            notes.append(f"{len(plans)} {cls.__name__} blocks (experts split over two modules) leave dynamo's graph: "
                         "from the next call each runs as hybrid::moe_block (one recompile)")
        for rec in ctx.index:  # the blocks behind this graph's experts modules, now looked up
            if rec.module is not None and rec.module in _BLOCK_OF:
                block = _BLOCK_OF[rec.module]
                blocks.setdefault(rec.path.rpartition(".")[0], (block, type(block).__name__))
    planned = {id(b) for p in ctx.before_retrace if isinstance(p, functools.partial) and p.func is install_split_moe
               for b in p.args[1]}
    named = {}
    for path, (block, _) in blocks.items():
        named.setdefault(_PATH_OF.get(block, path), block)
    for path, block in sorted(named.items()):
        plan, cls_name = getattr(block, SPLIT_PLAN, None), type(block).__name__
        if plan is not None:
            ctx.results.append(RegionResult("moe", path, cls_name, REWRITTEN, f"{plan[4].describe()}, experts split "
                                            "over two modules (the block's forward replaced)", ctx.graph_id))
        elif type(block) in SPLIT_MOE_REFUSED:
            ctx.results.append(RegionResult("moe", path, cls_name, SKIPPED, SPLIT_MOE_REFUSED[type(block)],
                                            ctx.graph_id))
        elif id(block) in planned:
            ctx.results.append(RegionResult("moe", path, cls_name, DETECTED_SPLIT, "experts split over two modules: "
                                            "planned, the next call runs hybrid::moe_block", ctx.graph_id))
    return "; ".join(notes)


def prepare_split_moe(model: torch.nn.Module) -> int:
    """The engine's preparation of split MoE blocks before it compiles: every class planned, wrapped where all its
    blocks have plans; returns the classes newly wrapped."""
    by_class: dict[type, list] = {}
    for m in model.modules():
        if split_moe_layouts(m) and getattr(m, SPLIT_PLAN, None) is None:
            by_class.setdefault(type(m), []).append(m)
    done = 0
    for cls, blocks in by_class.items():
        plans, why = plan_split_moe_class(blocks)
        if why is None:
            done += install_split_moe(cls, plans)
        else:
            SPLIT_MOE_REFUSED[cls] = why
    return done


# -- the stage ----------------------------------------------------------------------------------------------------
def prepare_graph(ctx: PassContext) -> list[str]:
    """The preparation a graph calls for (run by the backend before the passes); returns its graph notes."""
    import hybrid_kernels  # noqa: F401  (registers the run-time twins the changes call)
    return [note for note in (_adopt_eager_experts(ctx), _adopt_mamba1_scans(ctx), _adopt_delta_rules(ctx),
                              _adopt_split_moe(ctx)) if note]


def prepare_model(model: torch.nn.Module) -> int:
    """The preparation a model calls for before it is compiled (the engine); returns how many changes were made."""
    import hybrid_kernels  # noqa: F401
    classes = {type(m) for m in model.modules() if is_mamba1_mixer(m)}
    mixers = {type(m): m for m in model.modules() if is_delta_mixer(m)}
    return (sum(install_scan(c) for c in classes) + sum(install_delta(m) for m in mixers.values())
            + prepare_split_moe(model))
