"""Packed steps on models with Mamba2 state layers.

A packed step lays the tokens of several sequences on one axis (``ModelRunner._launch_packed``). HF's Mamba2 mixers
would run them as one sequence, so ``install`` gives each mixer an engine forward: on a packed step (the engine's
cache layer bound with ``packed``) it runs ``hybrid::mamba2_mixer_packed`` over that layer's state rows, each
sequence from its own row (prefill chunks in the chunked form, single tokens that continue a cached state in HF's
decode form); on every other step it calls HF's forward unchanged. The step's maps (``state_maps``) sit on the cache
layers, which reach the mixer as the call's ``cache`` argument, so under torch.compile they are graph inputs.
"""
from __future__ import annotations

import torch

from graphs.modules import DELTA, SSM, classify, is_mamba1_mixer, mamba2_dims
from hybrid_kernels.ssm.spec import Mamba2Spec, Mamba2Weights

from .cache import PagedCache, SlotStateLayer

#: the keyword under which HF's decoder layers pass the cache to their mixer (older releases: cache_params)
_CACHE_KWARGS = ("cache", "cache_params", "past_key_values")


def mixers(model, cache: PagedCache) -> "tuple[dict[int, torch.nn.Module], str | None]":
    """({layer index: Mamba2 mixer} for every state layer of ``cache``, None), or ({}, why packed steps cannot run
    the state layers)."""
    state_idx = [i for i, layer in enumerate(cache.layers) if isinstance(layer, SlotStateLayer)]
    found: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        kind = classify(m)
        if kind == DELTA:
            return {}, f"delta-rule mixers ({type(m).__name__}) take no packed steps yet"
        if kind == SSM and is_mamba1_mixer(m):
            return {}, f"Mamba1 mixers ({type(m).__name__}) take no packed steps"
        if kind == SSM and isinstance(getattr(m, "layer_idx", None), int):
            found[m.layer_idx] = m
    missing = [i for i in state_idx if i not in found]
    if missing:
        return {}, (f"state layers {missing[:4]} have no Mamba2 mixer hybrid recognises (short convolutions, "
                    "other recurrences): packed steps need one per state layer")
    for i in state_idx:
        layer, m = cache.layers[i], found[i]
        if layer.conv_buf is None or layer.ssm_buf is None or layer.ssm_buf.dtype != torch.float32:
            return {}, f"{type(m).__name__} keeps states other than a conv state and an fp32 ssm state"
        if getattr(m, "activation", "silu") != "silu":
            return {}, f"{type(m).__name__}'s conv activation {m.activation!r} is not silu"
    return {i: found[i] for i in state_idx}, None


def install(model, cache: PagedCache, found: "dict[int, torch.nn.Module]") -> None:
    """Give each mixer of ``found`` (``mixers``) the engine forward; idempotent."""
    from passes.ssm import mixer_spec
    for idx, m in found.items():
        if getattr(m, "_hybrid_packed", False):
            continue
        spec, weights = mixer_spec(m, mamba2_dims(m))
        m.forward = _engine_forward(m, m.forward, idx, cache, spec, weights)
        m._hybrid_packed = True


def _engine_forward(mod, original, idx: int, engine_cache: PagedCache, spec: Mamba2Spec, weights: Mamba2Weights):
    name = type(mod).__name__

    def forward(hidden_states, *args, **kwargs):
        if not engine_cache.layers[idx].packed:
            return original(hidden_states, *args, **kwargs)
        cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
        if cache is not engine_cache:
            raise RuntimeError(f"a packed step reached {name} (layer {idx}) without the engine's cache as its cache "
                               "argument: packed steps cannot run this model's state layers")
        layer = cache.layers[idx]
        return torch.ops.hybrid.mamba2_mixer_packed(*spec.packed_args(
            hidden_states, weights, layer.conv_buf, layer.ssm_buf, *layer.packed_maps))
    return forward


def state_maps(starts: list[int], counts: list[int], rows: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
    """A packed step's state maps from each sequence's cached tokens, tokens this step and state row: (host int64
    [S, 4] of the prefill chunks: first token, count, row, continues 0/1; token indices of the single tokens that
    continue a cached state; their rows). HF's mixer takes one token after a cached state in its decode form and
    anything else (a fresh prompt, even of one token, or a longer chunk) in its chunked form."""
    chunks, dec_tokens, dec_rows = [], [], []
    first = 0
    for start, count, row in zip(starts, counts, rows):
        if start and count == 1:
            dec_tokens.append(first)
            dec_rows.append(row)
        else:
            chunks.append([first, count, row, int(start > 0)])
        first += count
    return torch.tensor(chunks, dtype=torch.long).view(-1, 4), dec_tokens, dec_rows
