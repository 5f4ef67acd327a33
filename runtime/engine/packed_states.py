"""Packed steps on models with state layers (SSM, gated delta rule).

A packed step lays the tokens of several sequences on one axis (``ModelRunner._launch_packed``). HF's mixers would
run them as one sequence, so ``install`` gives each state layer's mixer an engine forward: on a packed step (the
engine's cache layer bound with ``packed``) each sequence runs from its own state row; on every other step HF's
forward runs unchanged. Two forms:
- Mamba2 mixers: ``hybrid::mamba2_mixer_packed``, one op over all the tokens (projections and gated norm once; conv
  and SSD per prefill chunk; single tokens after a cached state in one conv update and one state update);
- every other state layer's mixer (Mamba1, Gated DeltaNet, Kimi Delta Attention, short convolutions, any
  module of the layer whose forward takes the cache by keyword): ``hybrid::engine_mixer_packed``
  calls HF's own forward per prefill chunk and once for all single tokens after a cached state, the layer bound to
  those sequences' rows as a padded step would bind it, so each sequence gets what HF computes for it alone.
The step's maps (``state_maps``) sit on the cache layers, which reach the mixer as the call's cache argument, so
under torch.compile they are graph inputs; both ops are opaque to it (their bodies loop over the host map).
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import weakref
from typing import Optional

import torch
from torch import Tensor

from graphs.modules import DELTA, SSM, classify, mamba2_dims
from hybrid_kernels.library import op_name
from hybrid_kernels.ssm.mixer import chunk_runs

from .cache import PagedCache, SlotStateLayer

#: the keyword under which HF's decoder layers pass the cache to their mixer (older releases: cache_params)
_CACHE_KWARGS = ("cache", "cache_params", "past_key_values")


def mixers(model, cache: PagedCache) -> "tuple[dict[int, torch.nn.Module], str | None]":
    """({layer index: mixer} for every state layer of ``cache``, None), or ({}, why packed steps cannot run the
    state layers)."""
    state_idx = [i for i, layer in enumerate(cache.layers) if isinstance(layer, SlotStateLayer)]
    found = {m.layer_idx: m for m in model.modules()
             if classify(m) in (SSM, DELTA) and isinstance(getattr(m, "layer_idx", None), int)}
    for i in state_idx:
        if i not in found and (m := _state_module(model, i)) is not None:
            found[i] = m
    missing = [i for i in state_idx if i not in found]
    if missing:
        return {}, (f"state layers {missing[:4]} have no mixer module of their own (one with that layer_idx whose "
                    f"forward takes the cache as {' / '.join(_CACHE_KWARGS)}): packed steps need one per state layer")
    proven = set()
    for i in state_idx:
        m = found[i]
        if mamba2_dims(m) is not None:
            layer = cache.layers[i]
            if layer.conv_buf is None or layer.ssm_buf is None or layer.ssm_buf.dtype != torch.float32:
                return {}, f"{type(m).__name__} keeps states other than a conv state and an fp32 ssm state"
            if getattr(m, "activation", "silu") != "silu":
                return {}, f"{type(m).__name__}'s conv activation {m.activation!r} is not silu"
            if type(m) not in proven:  # the op's math against HF's forward, once per mixer class
                why = _math_differs(m)
                if why:
                    return {}, why
                proven.add(type(m))
        elif _cache_keyword(getattr(m, "_hybrid_hf_forward", m.forward)) is None:
            return {}, f"{type(m).__name__}'s forward takes no cache keyword ({', '.join(_CACHE_KWARGS)})"
    return {i: found[i] for i in state_idx}, None


def _state_module(model, idx: int):
    """The innermost module carrying ``layer_idx == idx`` when its forward takes the hidden states and, by keyword,
    the cache and nothing else it requires (a short convolution, another recurrence): HF's own forward runs it on
    packed steps (``hybrid::engine_mixer_packed``), bound to the rows as a padded step binds them. Else None."""
    own = [m for m in model.modules() if getattr(m, "layer_idx", None) == idx]
    inner = [m for m in own if not any(o is not m and o in set(m.modules()) for o in own)]
    if len(inner) != 1 or classify(inner[0]) is not None:
        return None
    forward = getattr(inner[0], "_hybrid_hf_forward", inner[0].forward)
    required = [p for p in list(inspect.signature(forward).parameters.values())[1:]
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return inner[0] if _cache_keyword(forward) is not None and not required else None


def _math_differs(m) -> str | None:
    """Why hybrid's Mamba2 mixer math (shared by ``hybrid::mamba2_mixer`` and the packed op) differs from this
    mixer's HF forward on a probe batch, or None (the SSM pass's probe)."""
    from passes.base import Skip
    from passes.ssm import FuseSSM, mixer_spec
    spec, weights = mixer_spec(m, mamba2_dims(m))
    try:
        FuseSSM._check_probe(m, spec, weights)
    except Skip as e:
        return f"{type(m).__name__}: {e}"
    return None


def _cache_keyword(forward) -> str | None:
    params = inspect.signature(forward).parameters
    return next((k for k in _CACHE_KWARGS if k in params), None)


#: hybrid::engine_mixer_packed's mixers by key: (the module, weakly; its cache keyword; layer index)
_MIXERS: list[tuple] = []
_keys = itertools.count()
#: the engines' caches by key (``PagedCache.packed_key``), so that an op body reaches the cache of its call
_CACHES: "weakref.WeakValueDictionary[int, PagedCache]" = weakref.WeakValueDictionary()


def install(model, cache: PagedCache, found: "dict[int, torch.nn.Module]") -> None:
    """Give each mixer of ``found`` (``mixers``) the engine forward (once per module: it serves every engine built on
    the model, each call taking the cache it is given) and register ``cache`` for the ops' bodies."""
    from passes.ssm import mixer_spec
    if getattr(cache, "packed_key", None) is None:
        cache.packed_key = next(_keys)
        _CACHES[cache.packed_key] = cache
    for idx, m in found.items():
        if getattr(m, "_hybrid_packed", False):
            continue
        original = m._hybrid_hf_forward = m.forward
        dims = mamba2_dims(m)
        if dims is not None:
            spec, weights = mixer_spec(m, dims)
            packed = _mamba2(spec, weights)
        else:
            _MIXERS.append((weakref.ref(m), _cache_keyword(original), idx))
            packed = _generic(len(_MIXERS) - 1)
        m.forward = _engine_forward(type(m).__name__, original, idx, packed)
        m._hybrid_packed = True


def _mamba2(spec, weights):
    def run(hidden, cache, layer):
        return torch.ops.hybrid.mamba2_mixer_packed(*spec.packed_args(hidden, weights, layer.conv_buf, layer.ssm_buf,
                                                                      *layer.packed_maps))
    return run


def _generic(key: int):
    def run(hidden, cache, layer):
        return torch.ops.hybrid.engine_mixer_packed(hidden, key, cache.packed_key, layer.buffers, *layer.packed_maps)
    return run


def _engine_forward(name: str, original, idx: int, packed):
    """The mixer's forward: the packed op when the call's cache is an engine cache bound to a packed step, HF's
    forward otherwise (other caches, other steps). A packed step that reaches the mixer without a cache argument
    (a decoder layer that does not pass it on) raises: HF's forward would run the step as one sequence."""
    def forward(hidden_states, *args, **kwargs):
        cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
        if isinstance(cache, PagedCache) and cache.layers[idx].packed:
            return packed(hidden_states, cache, cache.layers[idx])
        if cache is None and PACKED_STEP[0]:
            raise RuntimeError(f"a packed step reached {name} (layer {idx}) without the engine's cache as its cache "
                               "argument: packed steps cannot run this model's state layers")
        return original(hidden_states, *args, **kwargs)
    return forward


#: set by the runner while a packed step's forward runs (``_engine_forward``'s check)
PACKED_STEP = [False]


@torch.library.custom_op(op_name("engine_mixer_packed"), mutates_args={"states"})
def _engine_mixer_packed(hidden: Tensor, key: int, cache_key: int, states: list[Tensor], chunks: Tensor,
                         dec_tokens: Optional[Tensor], dec_rows: Optional[Tensor]) -> Tensor:
    """HF's mixer ``key`` (``install``) over a packed step's tokens on the cache ``cache_key`` (hidden [1, N, Hd]): once
    per run of prefill chunks of ``chunks`` (host int64 [S, 4]: first token, count, state row, continues 0/1) that
    lie back to back on consecutive rows (``chunk_runs``: a batch of equal rows, as a padded step of prompts of one
    length), the layer bound to those rows (their states, or fresh ones for new prompts) and the rows written back
    after; once for the single tokens after a cached state (``dec_tokens``, rows ``dec_rows``), their rows gathered
    as a batch and written back. ``states``: the layer's state buffers, which those write-backs mutate."""
    module, keyword, idx = _MIXERS[key]
    original, cache = module()._hybrid_hf_forward, _CACHES[cache_key]
    layer = cache.layers[idx]
    with _buffers(layer, states):
        return _run_mixer(hidden, original, keyword, cache, layer, chunks, dec_tokens, dec_rows)


@contextlib.contextmanager
def _buffers(layer: SlotStateLayer, states: list[Tensor]):
    """The layer's binds and stores go to ``states`` (the op's declared mutable arguments: under functionalization
    they may be copies that torch writes back), then the layer's own buffers return."""
    saved = layer.conv_buf, layer.ssm_buf
    given = iter(states)
    layer.conv_buf, layer.ssm_buf = (None if b is None else next(given) for b in saved)
    try:
        yield
    finally:
        layer.conv_buf, layer.ssm_buf = saved


def _run_mixer(hidden, original, keyword, cache, layer, chunks, dec_tokens, dec_rows) -> Tensor:
    out = torch.empty_like(hidden)
    for first, count, row, continues, n in chunk_runs(chunks):  # n sequences of `count` tokens, rows row..row+n-1
        toks, rows = slice(first, first + n * count), slice(row, row + n)
        layer.bind_continue(rows) if continues else layer.bind_prefill()
        y = _first(original(hidden[0, toks].view(n, count, -1), **{keyword: cache}))
        out[0, toks] = y.reshape(n * count, -1)
        layer.store_prefill(rows)
    if dec_tokens is not None:
        rows = dec_rows.long()
        layer.bind_continue(rows)
        y = _first(original(hidden[0].index_select(0, dec_tokens)[:, None], **{keyword: cache}))
        layer.store_prefill(rows)
        out[0].index_copy_(0, dec_tokens, y[:, 0])
    return out


@_engine_mixer_packed.register_fake
def _(hidden, key, cache_key, states, chunks, dec_tokens, dec_rows):
    return torch.empty_like(hidden)


def _first(y):
    """A mixer's output (some return (output, ...))."""
    return y[0] if isinstance(y, tuple) else y


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
