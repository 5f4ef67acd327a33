"""MoE pass: finds mixture-of-experts blocks (a router weight [E, H] beside experts with 3-D weights)."""
from __future__ import annotations

from graphs.modules import MOE, experts_weights, moe_parts

from .base import RegionPass


class FuseMoE(RegionPass):
    kind = MOE
    name = "moe"
    todo = "found; the fused MoE rewrite is not implemented yet"

    def required_params(self, module):
        router, experts = moe_parts(module)
        params = [(f"{router}.weight", getattr(module, router).weight)]
        params += [(f"{experts}.{n}", p) for n, p in experts_weights(getattr(module, experts)).items()]
        return params
