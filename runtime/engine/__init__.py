"""The generation engine: paged caches, SSM state rows, continuous batching over the compiled model."""
from .engine import Engine
from .sequence import RequestOutput, SamplingParams, TokenEvent

__all__ = ["Engine", "RequestOutput", "SamplingParams", "TokenEvent"]
