"""The engine's HF attention function for ordinary (MHA / GQA) attention layers, ``hybrid_paged``.

The engine switches such models to ``config._attn_implementation = "hybrid_paged"`` and remembers the
implementation the model had (``register``). Every attention call then comes here with what HF's own code passes
along: the engine's attention mask, the layer's ``sliding_window``, and extras such as learned sinks (``s_aux``) or
logit soft-capping (``softcap``).

- Steps over gathered keys (prefills; decode steps without paged maps): the layer's window is applied to the
  engine's mask (HF builds sliding masks itself, but the engine hands the model its own full-causal mask), then the
  model's own implementation runs, sinks and soft-capping included.
- Paged decode steps (the step's maps arrive as forward kwargs ``hybrid_block_table`` / ``hybrid_seq_lens``, which
  HF forwards to every attention call; the cache's ``update`` then returns its whole paged buffer): attention reads
  keys and values in place with ``hybrid::mla_decode``: a buffer row per head is ``[v | k]``, so with a zero latent
  query the MLA kernel's score is ``q . k`` and its value is ``v``. Each (sequence, kv head) is one kernel row over a
  page of one token; its block table lists ``slot * kv_heads + head`` for the sequence's positions, valid keys first,
  and a sliding window starts the row later. What the kernel does not compute (sinks, soft-capping, dropout) takes
  the exact path: the step's keys gathered from the pages, then the model's own implementation.
- Packed steps (the maps arrive as ``hybrid_cu_q`` / ``hybrid_ctx`` / ``hybrid_packed_table``): the query axis holds
  several sequences' tokens, decodes and prefill chunks alike; each attends causally (in its layer's window) to its
  own keys in the pages through ``hybrid::varlen_attention`` (learned sinks and soft-capping included). MLA layers
  attend in the absorbed form over their
  latent pages (``hybrid::mla_prefill``, ragged and causal): the query's nope part times W_UK (from the module's
  ``kv_b_proj``) scores against the cached latents, the output latents times W_UV are the values; the keys and values
  HF expanded for the step are not read. Sinks and soft-capping raise there (and dropout anywhere on a packed
  step), and the engine then runs the model without packed steps.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hybrid_kernels.attention.ops import varlen_attention
from hybrid_kernels.mla.ops import mla_decode, mla_prefill
from hybrid_kernels.mla.reference import per_head_matmul, split_kv_b

NAME = "hybrid_paged"
#: id(config) -> the attention implementation the model had before the engine switched it
_ORIGINAL: dict[int, str] = {}


def register(config) -> None:
    """Route ``config``'s attention calls here, keeping its implementation for the calls that need it."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention_forward)
    current = getattr(config, "_attn_implementation", None) or "sdpa"
    if current != NAME:
        _ORIGINAL[id(config)] = current
    config._attn_implementation = NAME


def _model_implementation(module):
    """(the model's own attention function, whether it takes a boolean mask)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    name = _ORIGINAL.get(id(getattr(module, "config", None)), "sdpa")
    if name == "sdpa" or module is None:
        return sdpa_attention_forward, True
    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name], False
    # "eager": the function in the model's own modeling file (it may add sinks or soft-capping)
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward"), False


def _as_additive(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _windowed(mask: torch.Tensor | None, window: int | None) -> torch.Tensor | None:
    """The engine's mask [B, 1, T, S] (queries are its last T key positions) restricted to keys within ``window``
    positions of each query (HF's sliding window: key k with q - k < window)."""
    if mask is None or not window:
        return mask
    t, s = mask.shape[-2], mask.shape[-1]
    q = torch.arange(s - t, s, device=mask.device)[:, None]
    near = (q - torch.arange(s, device=mask.device)[None, :]) < window
    if mask.dtype == torch.bool:
        return mask & near
    return mask.masked_fill(~near, torch.finfo(mask.dtype).min)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, **kwargs):
    if kwargs.get("hybrid_cu_q") is not None:
        if kwargs.get("hybrid_latent_pages") is not None:
            return _packed_mla(module, query, scaling, dropout, kwargs)
        return _packed(query, key, scaling, sliding_window, dropout, kwargs)
    table = kwargs.pop("hybrid_block_table", None)
    seq_lens = kwargs.pop("hybrid_seq_lens", None)
    if table is None:
        if key.dim() == 3:
            raise RuntimeError("hybrid_paged attention got a paged buffer without block tables: this model does not "
                               "forward its kwargs to attention; build the Engine with paged_decode=False")
        return _model_attention(module, query, key, value, _windowed(attention_mask, sliding_window), dropout,
                                scaling, sliding_window, kwargs)
    b, hq, t, dk = query.shape
    rows, hkv, d = key.shape  # the paged buffer [rows, kv heads, Dv + Dk]
    dv = d - dk
    if t != 1:
        raise RuntimeError(f"hybrid_paged decode takes one query token per sequence, got {t}")
    if sliding_window:  # each row's keys start at its window: shift the table, shorten the row
        start = (seq_lens - sliding_window).clamp(min=0)
        idx = (start[:, None] + torch.arange(table.shape[1], device=table.device)[None, :]).clamp(
            max=table.shape[1] - 1)
        table, seq_lens = table.gather(1, idx.long()), seq_lens - start
    if kwargs.get("s_aux") is not None or kwargs.get("softcap") or dropout:  # the exact path
        flat = key.view(rows * hkv, d)[table.long()].view(b, hkv, -1, d)  # [B, kv heads, W, Dv + Dk]
        valid = torch.arange(flat.shape[2], device=flat.device)[None, :] < seq_lens.view(b, hkv)[:, :1]
        return _model_attention(module, query, flat[..., dv:], flat[..., :dv], valid[:, None, None, :], dropout,
                                scaling, None, kwargs)
    q = query[:, :, 0].reshape(b * hkv, hq // hkv, dk)
    out = mla_decode(q.new_zeros(b * hkv, hq // hkv, dv), q, key.view(rows * hkv, 1, d), table, seq_lens,
                     scale=scaling if scaling is not None else dk ** -0.5)
    return out.view(b, 1, hq, dv), None


def _unsupported_on_packed(dropout, kwargs, sinks_and_caps: bool = False) -> None:
    unsupported = [name for name, on in (("attention sinks", not sinks_and_caps and kwargs.get("s_aux") is not None),
                                         ("logit soft-capping", not sinks_and_caps and bool(kwargs.get("softcap"))),
                                         ("attention dropout", bool(dropout))) if on]
    if unsupported:
        raise RuntimeError(f"packed steps do not run {unsupported[0]}")


def _packed(query, buf, scaling, sliding_window, dropout, kwargs):
    """A packed step (``ModelRunner._launch_packed``): query [1, Hq, N, Dk] holds several sequences' tokens, each
    attending to its own keys in the paged buffer (already holding the step's keys) through
    ``hybrid::varlen_attention``, learned sinks (``s_aux``) and soft-capping included. Dropout raises: the engine's
    construction probe then leaves packed steps off for the model."""
    _unsupported_on_packed(dropout, kwargs, sinks_and_caps=True)
    if buf.dim() != 3:
        raise RuntimeError("hybrid_paged attention got gathered keys on a packed step: this model's cache layers are "
                           "not the engine's paged ones")
    dk = query.shape[-1]
    out = varlen_attention(query[0].transpose(0, 1), buf, kwargs["hybrid_packed_table"], kwargs["hybrid_cu_q"],
                           kwargs["hybrid_ctx"], buf.shape[-1] - dk, kwargs["hybrid_block_size"], sliding_window or 0,
                           scaling if scaling is not None else dk ** -0.5, kwargs.get("s_aux"),
                           float(kwargs.get("softcap") or 0.0))
    return out.unsqueeze(0), None


def _packed_mla(module, query, scaling, dropout, kwargs):
    """A packed step of an MLA layer: query [1, H, N, P + R] (HF's nope | rope parts) against the layer's latent
    pages ``hybrid_latent_pages[module.layer_idx]`` ([rows, 1, L + R], rows ``[latent | rope key]``, the step's rows
    written) -> [1, N, H, V]. Each token attends causally to its own sequence's positions, in one of two forms (the
    runner checked that the module's ``expand_kv`` is the per-head split of ``kv_b_proj``: ``_expand_kv_mismatch``):
    - absorbed (decodes, short chunks): q_nope @ W_UK scores against the cached latents through
      ``hybrid::mla_prefill``, the output latents @ W_UV^T are the heads' values;
    - expanded (sequences with at least ``EXPANDED_MIN_QUERIES`` tokens in the step, ``hybrid_mla_split``, as
      ``hybrid::mla_attention`` chooses for prompts): their contexts' latents gathered page by page, expanded
      through kv_b_proj into per-head keys and values, ``hybrid::varlen_attention`` over them (fewer FLOPs per
      query-key pair: P + R + V against 2L + R)."""
    _unsupported_on_packed(dropout, kwargs)
    pages = kwargs["hybrid_latent_pages"][module.layer_idx]
    bs, w = kwargs["hybrid_block_size"], module.kv_b_proj.weight
    h, p = query.shape[1], module.qk_nope_head_dim
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [N, H, P + R]
    split = kwargs.get("hybrid_mla_split")
    if split is None:
        return _absorbed(q, pages, w, p, bs, scale, kwargs["hybrid_packed_table"], kwargs["hybrid_cu_q"],
                         kwargs["hybrid_ctx"])[None], None
    short, long, gather = split
    lat = pages.view(-1, pages.shape[-1])[gather]  # [rows, L + R]: the long sequences' pages, in order
    kv = F.linear(lat[:, :w.shape[1]], w).view(lat.shape[0], h, -1)  # [rows, H, P + V]
    k_rope = lat[:, None, w.shape[1]:].expand(-1, h, -1)
    buf = torch.cat([kv[..., p:], kv[..., :p], k_rope], dim=-1)  # rows [v | k_nope | k_rope]
    rows, cu, ctx, table = long
    out = q.new_empty(q.shape[0], h, kv.shape[-1] - p)
    out[rows] = varlen_attention(q[rows], buf, table, cu, ctx, kv.shape[-1] - p, bs, 0, scale).to(out.dtype)
    if short is not None:
        rows, cu, ctx, table = short
        out[rows] = _absorbed(q[rows], pages, w, p, bs, scale, table, cu, ctx)
    return out[None], None


def _absorbed(q, pages, w, p, bs, scale, table, cu, ctx):
    """q [N, H, P + R] -> [N, H, V] through the latent pages (``_packed_mla``'s absorbed form)."""
    w_uk, w_uv = split_kv_b(w, q.shape[1], p)
    q_lat = per_head_matmul(q[None, :, :, :p].transpose(1, 2), w_uk)[0].transpose(0, 1)  # [N, H, L]
    o_lat = mla_prefill(q_lat, q[:, :, p:], pages.view(-1, bs, pages.shape[-1]), table, ctx, cu, scale=scale)
    return per_head_matmul(o_lat.transpose(0, 1)[None].to(q.dtype), w_uv.transpose(-1, -2))[0].transpose(0, 1)


def _model_attention(module, query, key, value, mask, dropout, scaling, sliding_window, kwargs):
    fn, takes_bool = _model_implementation(module)
    if not takes_bool:
        mask = _as_additive(mask, query.dtype)
    return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
              **kwargs)


def decode_maps(slots: torch.Tensor, lengths: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [B, W] cache rows of each sequence's positions 0..W-1 (valid first), lengths [B] ->
    (block table [B * kv_heads, W] int32 of rows of the buffer viewed as [rows * kv_heads, 1, D], seq lens)."""
    heads = torch.arange(kv_heads, device=slots.device)
    table = (slots[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1, slots.shape[1])
    return table.to(torch.int32), lengths.repeat_interleave(kv_heads).to(torch.int32)
