"""What the engine runs exactly, checked when it is built: a model with anything else is refused in one line that
names the feature (``Unsupported``), never run with a silently different result.

Supported: full and sliding-window attention per layer (the window applied to the engine's masks and, on paged
decode steps, to each row's keys: attention.py); learned attention sinks, logit soft-capping and dropout (the exact
path: the model's own attention implementation over the step's keys); query / key norms and partial rotary (HF's
code applies them before the cache); MLA latent caches; SSM / linear-attention state layers holding a conv state, a
recurrent state or both (rows per sequence); layers whose attention and mixer run side by side (full-attention keys
and state rows in one cache layer); layers without a cache (MoE- or MLP-only layers).
Refused: ALiBi position biases, non-causal attention, keys / values shared across layers, chunked attention, models
that cache rows of their own besides the tokens' (a learned prompt), cache layers of other kinds (compressed,
indexed, quantized, recurrent states beside windowed or static keys), and models whose forward fails over the
engine's cache on the construction's probe request (engine.py: ``Engine._probe``).
"""
from __future__ import annotations

from torch import nn


class Unsupported(ValueError):
    """A model feature the engine does not run exactly; the message names it and says what to do instead."""

    def __init__(self, feature: str):
        super().__init__(f"the engine does not support {feature}; run this model with HF generate or "
                         "torch.compile(model, backend='hybrid') instead")


#: child names of attention projections in HF's families: separate query / key projections, or one fused projection
_QK_PAIRS = (("q_proj", "k_proj"), ("query", "key"), ("q_lin", "k_lin"), ("q", "k"))
_FUSED_QKV = ("qkv_proj", "query_key_value", "qkv", "Wqkv", "c_attn")


def _has_attention_projections(m: nn.Module) -> bool:
    children = dict(m.named_children())
    return any(q in children and k in children for q, k in _QK_PAIRS) or any(n in children for n in _FUSED_QKV)


def _updates_a_cache(m: nn.Module) -> bool:
    """Whether the module's own forward stores keys through a cache (``cache.update(...)``)."""
    import inspect
    try:
        src = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return False
    return ".update(" in src and ("past_key_value" in src or "cache" in src)


def own_attention(model: nn.Module) -> list[str]:
    """The classes of attention modules whose code does not call HF's attention functions
    (``ALL_ATTENTION_FUNCTIONS``): they compute attention themselves over the keys the cache returns, so the engine
    gives them gathered, contiguous keys and never its paged buffers."""
    import sys
    return sorted({type(m).__name__ for _, m in model.named_modules()
                   if (_has_attention_projections(m) or _updates_a_cache(m))
                   and not hasattr(sys.modules.get(type(m).__module__), "ALL_ATTENTION_FUNCTIONS")})


def _check_config(cfg) -> None:
    """Refuse the configuration-level features (a multimodal wrapper's and its language model's configs)."""
    alibi = getattr(cfg, "alibi", False) or getattr(getattr(cfg, "attn_config", None), "alibi", False) \
        or (isinstance(getattr(cfg, "attn_config", None), dict) and cfg.attn_config.get("alibi")) \
        or getattr(cfg, "position_embedding_type", None) == "alibi" or getattr(cfg, "model_type", "") == "bloom"
    if alibi:
        raise Unsupported("ALiBi position biases (the engine's masks carry no per-head position bias)")
    if getattr(cfg, "num_kv_shared_layers", 0) or "reuse" in (getattr(cfg, "kv_sharing_modes", None) or ()):
        raise Unsupported("keys and values shared across layers (num_kv_shared_layers / kv_sharing_modes)")
    layer_types = getattr(cfg, "layer_types", None) or ()
    if getattr(cfg, "attention_chunk_size", None) or "chunked_attention" in layer_types:
        raise Unsupported("chunked attention (attention_chunk_size)")


def batch_rope_limit(cfg) -> int | None:
    """The longest sequence for which the model's RoPE does not depend on the other rows of a call, or None when it
    never does. HF's longrope takes its long or short factors for a whole forward call from the call's largest
    position: past ``original_max_position_embeddings`` a batch's longest row would switch every row's rotations
    (and a prompt's chunks would differ from the whole prompt). Up to it every call takes the short factors, as the
    model alone does, so the engine runs such models up to that length."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return None
    groups = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    limits = [g.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
              for g in groups if (g.get("rope_type") or g.get("type")) == "longrope"]
    return min((int(x) for x in limits if x), default=None)


def check_model(model: nn.Module) -> None:
    """Raise ``Unsupported`` for a configuration or module feature the engine cannot run exactly."""
    import inspect

    from runtime.hf import takes_cache
    if not takes_cache(model):
        params = inspect.signature(model.forward).parameters
        extra = [n for n in ("state", "mems", "memory") if n in params]
        raise Unsupported(f"a model whose forward takes no HF cache (no past_key_values / cache argument"
                          f"{'; it keeps its state in ' + repr(extra[0]) if extra else ''})")
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        _check_config(cfg)
    for name, m in model.named_modules():
        if getattr(m, "is_causal", True) is False and _has_attention_projections(m):
            raise Unsupported(f"non-causal attention ({name}: is_causal=False)")


def cache_layer_kind(layer) -> str:
    """The engine's kind for one of HF's DynamicCache layers after a prefill: "attention", "ssm" (one conv and one
    recurrent state), "attention+ssm" (both in one layer: an attention and a mixer side by side) or "none" (a
    layer that caches nothing); ``Unsupported`` for anything else."""
    from transformers import cache_utils as cu
    name = type(layer).__name__
    if isinstance(layer, getattr(cu, "DummyLayer", ())):
        return "none"
    linear = getattr(cu, "LinearAttentionCacheLayerMixin", cu.LinearAttentionLayer)
    if isinstance(layer, linear):
        if getattr(layer, "number_of_states", 1) != 1:
            raise Unsupported(f"linear-attention cache layers with {layer.number_of_states} states per kind ({name})")
        states = layer.conv_states.get(0) is not None or layer.recurrent_states.get(0) is not None
        if isinstance(layer, cu.CacheLayerMixin):
            if type(layer) is not cu.LinearAttentionAndFullAttentionLayer:
                raise Unsupported(f"{name} cache layers (recurrent states beside windowed or static keys)")
            keys = getattr(layer, "keys", None) is not None
            return {(True, True): "attention+ssm", (True, False): "attention", (False, True): "ssm"}.get(
                (keys, states), "none")
        return "ssm" if states else "none"
    if type(layer) in (cu.DynamicLayer, cu.DynamicSlidingWindowLayer):
        return "attention" if getattr(layer, "keys", None) is not None else "none"
    raise Unsupported(f"{name} cache layers")
