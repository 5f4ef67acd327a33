"""Routed mixture-of-experts ops (``hybrid::moe_route``, ``hybrid::moe_experts``, ``hybrid::moe``,
``hybrid::moe_block``); importing the package registers them (see README.md)."""
from . import ops  # noqa: F401
