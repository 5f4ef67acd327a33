"""Small helpers that hide differences between the transformers versions hybrid supports (5.24 and later: the
forward kwarg that takes the cache and the output field that returns it moved between releases)."""
from __future__ import annotations

import inspect

import torch


#: names of the forward kwarg that takes HF's cache: ``cache`` (5.2x), ``past_key_values`` (older), ``cache_params``
#: (Mamba models before 5.2x)
CACHE_KWARGS = ("cache", "past_key_values", "cache_params")


def takes_cache(model: torch.nn.Module) -> bool:
    """Whether the model's forward has a cache argument of one of the ``CACHE_KWARGS`` names."""
    params = inspect.signature(model.forward).parameters
    return any(name in params for name in CACHE_KWARGS)


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the forward kwarg that takes the cache (one of ``CACHE_KWARGS``; ``past_key_values`` when none)."""
    params = inspect.signature(model.forward).parameters
    for name in CACHE_KWARGS:
        if name in params:
            return name
    return "past_key_values"


def output_cache(output):
    """The cache a forward returned (``.cache`` in 5.2x; ``.past_key_values`` / ``.cache_params`` before)."""
    for name in CACHE_KWARGS:
        value = getattr(output, name, None)
        if value is not None:
            return value
    return None


def quiet_transformers() -> None:
    """Silence per-call warnings (missing mamba kernels, attention-mask notices) and progress bars (loading, saving
    weights) in CLI output; the CLI reports loading problems itself (runtime.zoo.load)."""
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
