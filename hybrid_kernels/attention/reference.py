"""Plain torch reference of packed variable-length attention over a paged key/value buffer: the CPU path and the
test oracle of ``triton_varlen.py``."""
from __future__ import annotations

import torch


def varlen_attention_ref(q: torch.Tensor, buf: torch.Tensor, block_table: torch.Tensor, cu_q: torch.Tensor,
                         ctx: torch.Tensor, v_dim: int, block_size: int, window: int, scale: float,
                         sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Queries of several sequences packed along one axis, each attending causally to its own keys in the pages.

    q [N, Hq, Dk]: sequence s owns queries ``cu_q[s]:cu_q[s + 1]``, its last ``n_s`` positions: query i of it sits at
    position ``ctx[s] - n_s + i`` and sees keys 0..position (with ``window`` > 0 only those less than ``window``
    positions back, HF's sliding window). buf [rows, Hkv, Dv + Dk] holds rows ``[v | k]``; key j of sequence s is row
    ``block_table[s, j // block_size] * block_size + j % block_size``. GQA: query head h reads kv head
    h // (Hq / Hkv). ``softcap`` > 0: scaled scores become softcap * tanh(score / softcap) (Gemma 2). ``sinks`` [Hq]:
    one more logit per head in the softmax, whose probability is dropped (gpt-oss). Returns [N, Hq, Dv] in q's dtype
    (scores and softmax in fp32, or fp64 for fp64 inputs)."""
    n_tok, hq, dk = q.shape
    hkv = buf.shape[1]
    out = q.new_empty(n_tok, hq, v_dim)
    cu, lens = cu_q.tolist(), ctx.tolist()
    acc = torch.promote_types(q.dtype, torch.float32)
    for s, width in enumerate(lens):
        lo, hi = cu[s], cu[s + 1]
        if hi == lo:
            continue
        j = torch.arange(width, device=buf.device)
        rows = block_table[s, j // block_size].long() * block_size + j % block_size
        kv = buf[rows].to(acc)  # [W, Hkv, Dv + Dk]
        k = kv[..., v_dim:].repeat_interleave(hq // hkv, dim=1)  # [W, Hq, Dk]
        v = kv[..., :v_dim].repeat_interleave(hq // hkv, dim=1)
        pos = torch.arange(width - (hi - lo), width, device=buf.device)[:, None]
        seen = j[None, :] <= pos
        if window > 0:
            seen &= (pos - j[None, :]) < window
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].to(acc), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~seen[None], float("-inf"))
        if sinks is not None:
            sink = sinks.to(acc)[:, None, None].expand(hq, hi - lo, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
