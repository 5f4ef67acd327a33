"""Paged decode attention for ordinary (MHA / GQA) attention layers, as an HF attention function.

The engine switches such models to ``config._attn_implementation = "hybrid_paged"``. On a decode step it
passes the step's paged-attention maps as forward kwargs (``hybrid_block_table``, ``hybrid_seq_lens``),
which HF forwards to every attention call; the cache's ``update`` then writes the new token and hands back
its whole paged buffer instead of a gathered copy, and this function reads keys and values in place with
``hybrid::mla_decode``: a buffer row per head is ``[v | k]``, so with a zero latent query the MLA kernel's
score is ``q . k`` and its value is ``v``. Each (sequence, kv head) is one kernel row over a page size of
one token; its block table lists ``slot * kv_heads + head`` for the sequence's positions, valid keys first.
Prefills (no maps in kwargs) take HF's SDPA path over the gathered keys.
"""
from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kernels.mla.ops import mla_decode

NAME = "hybrid_paged"


def paged_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs):
    table = kwargs.pop("hybrid_block_table", None)
    seq_lens = kwargs.pop("hybrid_seq_lens", None)
    if table is None:
        if key.dim() == 3:
            raise RuntimeError("hybrid_paged attention got a paged buffer without block tables: this model does not "
                               "forward its kwargs to attention; build the Engine with paged_decode=False")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, hq, t, dk = query.shape
    rows, hkv, d = key.shape  # the paged buffer [rows, kv heads, Dv + Dk]
    dv = d - dk
    if t != 1:
        raise RuntimeError(f"hybrid_paged decode takes one query token per sequence, got {t}")
    q = query[:, :, 0].reshape(b * hkv, hq // hkv, dk)
    out = mla_decode(q.new_zeros(b * hkv, hq // hkv, dv), q, key.view(rows * hkv, 1, d), table, seq_lens,
                     scale=scaling if scaling is not None else dk ** -0.5)
    return out.view(b, 1, hq, dv), None


def register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, paged_attention_forward)


def decode_maps(slots: torch.Tensor, lengths: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [B, W] cache rows of each sequence's positions 0..W-1 (valid first), lengths [B] ->
    (block table [B * kv_heads, W] int32 of rows of the buffer viewed as [rows * kv_heads, 1, D], seq lens)."""
    heads = torch.arange(kv_heads, device=slots.device)
    table = (slots[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1, slots.shape[1])
    return table.to(torch.int32), lengths.repeat_interleave(kv_heads).to(torch.int32)
