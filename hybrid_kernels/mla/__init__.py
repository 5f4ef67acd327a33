"""Absorbed multi-head latent attention (DeepSeek MLA): paged latent cache write, split-KV decode, ragged prefill,
a drop-in for HF's dense cache layout and the engine's decode over its paged latent cache. Importing the package
registers the ``hybrid::mla_*`` ops (ops.py; see README.md)."""
from . import ops  # noqa: F401
