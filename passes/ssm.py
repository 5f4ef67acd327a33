"""SSM pass: finds Mamba1 mixers (A_log [D, N]) and Mamba2/SSD mixers (A_log [H], dt_bias, gated norm)."""
from __future__ import annotations

from graphs.modules import SSM

from .base import RegionPass


class FuseSSM(RegionPass):
    kind = SSM
    name = "ssm"
    todo = "found; the fused SSM rewrite is not implemented yet"

    def required_params(self, module):
        return [("in_proj.weight", module.in_proj.weight), ("out_proj.weight", module.out_proj.weight)]
