"""Graph passes, one per file, run in the fixed order of :data:`PIPELINE`."""
from .base import PassContext, RegionPass, RegionResult, Skip
from .complex import LowerComplex
from .glu import FuseGLU
from .linear import DecodeLinear
from .mla import FuseMLA
from .moe import FuseMoE
from .norm import FuseNorm
from .ssm import FuseSSM

#: The one ordered list of passes. Regions of different kinds never overlap, so the order only fixes
#: the order of the explain report and of graph edits; the whole-graph passes (complex arithmetic lowered to
#: real, the linears left over routed through hybrid::linear, then the RMSNorms before them fused into those linears,
#: then gated MLPs' activations into their gate + up launch) come last, so the region passes see the graph as HF's
#: code traced it.
PIPELINE: list = [FuseMLA(), FuseSSM(), FuseMoE(), LowerComplex(), DecodeLinear(), FuseNorm(), FuseGLU()]
PASS_NAMES = [p.name for p in PIPELINE]


def run_pipeline(ctx: PassContext, enabled: dict[str, bool]) -> dict[str, int]:
    counts = {}
    for p in PIPELINE:
        if enabled.get(p.name, True):
            counts[p.name] = p.run(ctx)
        else:
            for r in ctx.regions(p.kind):
                ctx.results.append(RegionResult(p.kind, r.path, r.cls_name, "skipped",
                                                f"pass '{p.name}' disabled by options", ctx.graph_id))
            counts[p.name] = 0
    return counts


__all__ = ["PIPELINE", "PASS_NAMES", "PassContext", "RegionPass", "RegionResult", "Skip", "run_pipeline"]
