"""What the MoE pass does about ``config._experts_implementation == "eager"``.

HF's eager experts loop over ``nonzero()`` and dynamo breaks the graph inside every MoE block, so no graph
holds a whole block. Choice made here: hybrid registers its own experts implementation, ``"hybrid"``, in
HF's ``ALL_EXPERTS_FUNCTIONS`` (one ``hybrid::moe_experts_rt`` call: no graph break, same math) and switches
the model's config to it when it first sees a block split this way. Dynamo guards on that config value,
and hybrid drops dynamo's compiled code once (``torch._dynamo.reset_code_caches()``, when the first split
graph runs) so the next call retraces the model from its top frame into whole-block graphs, which the MoE
pass then rewrites. The first call runs the split graphs as they are (correct, not fused). Eager runs of the model afterwards also use
hybrid's experts implementation.
"""
from __future__ import annotations

import gc
import warnings

import torch

from graphs.modules import experts_weights

from .base import RegionResult

NAME = "hybrid"


def hybrid_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF experts-function signature: hidden [T, H], ids [T, k], weights [T, k] -> [T, H]."""
    from passes.moe import identify_activation
    act = getattr(self, "_hybrid_activation", None)
    if act is None:
        act = self._hybrid_activation = identify_activation(getattr(self, "act_fn", None))
    gated = getattr(self, "has_gate", True)
    w13 = self.gate_up_proj if gated else self.up_proj
    # the run-time twin: opaque to dynamo, so the token count never becomes a guard (runtime/ops/run_time.py)
    return torch.ops.hybrid.moe_experts_rt(hidden_states, w13, self.down_proj, top_k_weights.float(), top_k_index,
                                           gated, not getattr(self, "is_concatenated", True), act)


def register() -> bool:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NAME, hybrid_experts_forward)
    return True


def _eager_configs(ctx) -> list:
    configs = {}
    for rec in ctx.index:
        cfg = getattr(rec.module, "config", None)
        if getattr(cfg, "_experts_implementation", None) == "eager":
            configs[id(cfg)] = cfg
    return list(configs.values())


def _is_experts_of(obj, config_ids: set) -> bool:
    try:  # weak proxies to dead objects raise on any access
        return (isinstance(obj, torch.nn.Module) and id(getattr(obj, "config", None)) in config_ids
                and experts_weights(obj) is not None)
    except ReferenceError:
        return False


def adopt_eager_experts(ctx) -> None:
    """Switch configs whose experts use HF's eager loop to hybrid's experts implementation (see above)."""
    configs = _eager_configs(ctx)
    if not configs:
        return
    wanted = {id(c) for c in configs}
    with warnings.catch_warnings():  # touching every live object trips deprecation shims (torch.distributed)
        warnings.simplefilter("ignore")
        experts = [o for o in gc.get_objects() if _is_experts_of(o, wanted)]
    if not experts:
        return
    supported = not any(getattr(e, f, False) for e in experts for f in ("has_bias", "is_transposed",
                                                                          "has_post_expert_norm"))
    if supported and register():
        for cfg in configs:
            cfg._experts_implementation = NAME
        ctx.retrace = True
        reason = ("experts implementation 'eager' loops over nonzero() and breaks the graph in every MoE block; "
                  "switched the model to hybrid's registered experts implementation: the next call recompiles "
                  "into whole-block graphs")
        status = "skipped"
    else:
        reason = "experts implementation 'eager' breaks the graph and these experts are not supported by hybrid"
        status = "skipped"
    ctx.results.append(RegionResult("moe", f"({len(experts)} experts modules)", type(experts[0]).__name__,
                                    status, reason, ctx.graph_id))
