"""Delta pass: reports each gated delta-rule mixer (Gated DeltaNet, Kimi Delta Attention) of a graph.

The rewrite itself happens before tracing, in the HF preparation (prepare.py, part 3): the mixer's delta-rule
functions, proven on probes, trace as one opaque ``hybrid::delta_rule`` call (Triton chunked prefill / recurrent
step) while projections, conv, gates and the gated norm stay with Inductor and the linear / norm passes. This pass
finds the mixer regions and says, per region, whether its graph holds the op and, where not, why.
"""
from __future__ import annotations

import torch

from graphs.modules import DELTA

from .base import REWRITTEN, SKIPPED, PassContext, RegionPass
from .prepare import DELTA_REFUSED, _delta_functions


class FuseDelta(RegionPass):
    kind = DELTA
    name = "delta"

    def _process(self, ctx: PassContext, region) -> tuple[str, str]:
        ops = (torch.ops.hybrid.delta_rule, torch.ops.hybrid.delta_rule_step)
        calls = [n for n in region.nodes if n.target in ops or getattr(n.target, "overloadpacket", None) in ops]
        if calls:
            g = calls[0].args[3].meta.get("val") if hasattr(calls[0].args[3], "meta") else None
            kind = "key channel" if g is not None and g.dim() == 4 else "value head"
            v = calls[0].args[2].meta.get("val")
            shape = f": {v.shape[2]} value heads x {calls[0].args[1].meta['val'].shape[-1]} x {v.shape[3]}" if v is not None else ""
            return REWRITTEN, f"gated delta rule (decay per {kind}){shape} -> hybrid::delta_rule"
        cls = type(region.module)
        if cls in DELTA_REFUSED:
            return SKIPPED, f"HF's delta-rule functions kept: {DELTA_REFUSED[cls]}"
        if not _delta_functions(cls):
            return SKIPPED, ("no module-level function with the delta-rule interface (query, key, value, g, beta, "
                             "..., initial_state, output_final_state) in the mixer's module")
        return SKIPPED, "HF's delta-rule functions run as HF wrote them in this graph; the next call retraces with hybrid's"
