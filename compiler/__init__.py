"""hybrid's compiler: the ``hybrid`` torch.compile backend, its options and the explain report.

    import torch
    model = torch.compile(model, backend="hybrid")            # no import of ours needed
    model = torch.compile(model, backend="hybrid", options={"verify": True, "moe": False})

    import compiler
    print(compiler.explain(model, input_ids).table())
"""
from .backend import hybrid_backend
from .explain import explain
from .options import Options
from .report import Report, collect


def _register() -> None:
    """Installed packages find the backend through the entry point; a source checkout on the path
    (no ``pip install``) registers it when ``compiler`` is imported."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend
    if "hybrid" not in _BACKENDS:
        register_backend(compiler_fn=hybrid_backend, name="hybrid")


_register()

__all__ = ["hybrid_backend", "explain", "Options", "Report", "collect"]
