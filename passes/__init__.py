"""Graph passes, one per file, run in the fixed order of :data:`PIPELINE` after the HF preparation stage
(prepare.py)."""
from .base import Pass, PassContext, PassResult, RegionPass, RegionResult, Skip
from .complex import LowerComplex
from .delta import FuseDelta
from .glu import FuseGLU
from .linear import DecodeLinear
from .mla import FuseMLA
from .mla_step import FuseMLADecodeStep
from .moe import FuseMoE
from .norm import FuseNorm
from .prepare import prepare_graph
from .ssm import FuseSSM

#: The one ordered list of passes. Regions of different kinds never overlap, so the order among the region passes
#: only fixes the order of the explain report and of graph edits; the MLA decode step's fusion follows the MLA pass
#: (it takes over the paged attention that pass emits); the whole-graph passes (complex arithmetic lowered to real,
#: the linears left over routed through hybrid::linear, then the RMSNorms before them fused into those linears,
#: then gated MLPs' activations into their gate + up launch) come last, so the region passes see the graph as HF's
#: code traced it.
PIPELINE: list[Pass] = [FuseMLA(), FuseMLADecodeStep(), FuseSSM(), FuseDelta(), FuseMoE(), LowerComplex(), DecodeLinear(),
                        FuseNorm(), FuseGLU()]
PASS_NAMES = [p.name for p in PIPELINE]


def run_pipeline(ctx: PassContext, enabled: dict[str, bool]) -> dict[str, int]:
    """Every pass ``enabled`` does not turn off, in order; returns rewrites per pass. (The HF preparation,
    ``prepare_graph``, runs before it.)"""
    counts = {}
    for p in PIPELINE:
        result = p.run(ctx) if enabled.get(p.name, True) else p.disabled(ctx)
        counts[p.name] = result.matches
    return counts


__all__ = ["PIPELINE", "PASS_NAMES", "Pass", "PassContext", "PassResult", "RegionPass", "RegionResult", "Skip",
           "prepare_graph", "run_pipeline"]
