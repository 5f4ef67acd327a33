"""Absorbed multi-head latent attention (DeepSeek MLA): paged latent cache write, split-KV decode,
ragged prefill, a dense drop-in for HF's cache layout (``dropin.py``) and the engine's decode over its paged
latent cache (``paged.py``). Importing registers the ``hybrid::mla_*`` ops."""
from . import ops  # noqa: F401
from .ops import mla_attention_dense, mla_cache_write, mla_decode, mla_prefill  # noqa: F401
