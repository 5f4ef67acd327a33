"""Routed mixture-of-experts ops (hybrid::moe_route, hybrid::moe_experts, hybrid::moe); importing registers them."""
from . import ops  # noqa: F401
from .ops import moe, moe_experts, moe_route  # noqa: F401
