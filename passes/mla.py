"""MLA pass: finds DeepSeek-style latent attention (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj)."""
from __future__ import annotations

from graphs.modules import MLA

from .base import RegionPass


class FuseMLA(RegionPass):
    kind = MLA
    name = "mla"
    todo = "found; the absorbed MLA rewrite is not implemented yet"

    def required_params(self, module):
        return [("kv_b_proj.weight", module.kv_b_proj.weight), ("o_proj.weight", module.o_proj.weight)]
