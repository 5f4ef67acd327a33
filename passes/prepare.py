"""HF preparation: what hybrid changes in transformers itself (not in a graph) so that dynamo traces graphs the passes
can rewrite. A stage of its own, run before the pass pipeline: by the backend on each graph (``prepare_graph``) and
by the engine on its model before it compiles (``prepare_model``).

Two changes, both made at most once per process and both exact (same math as HF's code):

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
"""
from __future__ import annotations

import functools
import gc
import sys
import warnings

import torch

from graphs.modules import experts_weights, is_mamba1_mixer

from .base import PassContext, Skip
from .probes import identify_experts

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


# -- the stage ----------------------------------------------------------------------------------------------------
def prepare_graph(ctx: PassContext) -> list[str]:
    """The preparation a graph calls for (run by the backend before the passes); returns its graph notes."""
    import kernels  # noqa: F401  (registers the run-time twins the changes call)
    return [note for note in (_adopt_eager_experts(ctx), _adopt_mamba1_scans(ctx)) if note]


def prepare_model(model: torch.nn.Module) -> int:
    """The preparation a model calls for before it is compiled (the engine); returns how many changes were made."""
    import kernels  # noqa: F401
    classes = {type(m) for m in model.modules() if is_mamba1_mixer(m)}
    return sum(install_scan(c) for c in classes)
