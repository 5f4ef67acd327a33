"""``compiler.explain``: what the passes find and do in a model's graphs, without running Inductor."""
from __future__ import annotations

import torch

from .report import Report, collect


def explain(model: torch.nn.Module, *args, options: dict | None = None, generate_tokens: int = 0,
            reset: bool = True, **kwargs) -> Report:
    """Trace ``model(*args, **kwargs)`` with the hybrid backend and report every candidate region.

    With ``generate_tokens > 0``, runs ``model.generate(*args, max_new_tokens=generate_tokens)`` instead,
    so the decode graphs (T=1, cache reads and writes) are reported too. The rewritten graphs run eagerly
    (no Inductor) so this is quick. ``reset`` clears dynamo's caches before and after (dynamo keeps one
    cache per code object; without a reset an earlier compile of the same model would be reused).
    """
    opts = {**(options or {}), "inductor": False}
    if reset:
        torch._dynamo.reset()
    try:
        with collect() as report, torch.no_grad():
            compiled = torch.compile(model.forward, backend="hybrid", options=opts)
            if generate_tokens:
                model.forward = compiled
                try:
                    model.generate(*args, max_new_tokens=generate_tokens, min_new_tokens=generate_tokens,
                                   do_sample=False, **kwargs)
                finally:
                    del model.forward
            else:
                compiled(*args, **kwargs)
    finally:
        if reset:
            torch._dynamo.reset()
    return report
