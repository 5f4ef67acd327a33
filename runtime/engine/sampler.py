"""Next-token choice per sequence: greedy, temperature, top-k, top-p; seeded per request."""
from __future__ import annotations

import torch

from .sequence import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] (any dtype) -> one token id per row."""
    logits = logits.float()
    greedy = logits.argmax(-1).tolist() if any(p.temperature == 0.0 for p in params) else None  # one sync
    out = []
    for i, (row, p, g) in enumerate(zip(logits, params, generators)):
        if p.temperature == 0.0:
            out.append(greedy[i])
            continue
        row = row / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # smallest prefix whose mass reaches top_p
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
            probs = probs / probs.sum()
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=g).item()))
    return out
