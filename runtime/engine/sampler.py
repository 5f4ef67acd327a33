"""Next-token choice per sequence: greedy, temperature, top-k, top-p; seeded per request."""
from __future__ import annotations

import torch

from ..ops.library import use_triton
from ..ops.sampling import argmax_triton
from .sequence import SamplingParams


def greedy_ids(logits: torch.Tensor, advance: tuple | None = None) -> torch.Tensor:
    """logits [B, V] -> argmax ids [B] (the first maximal index, as torch.argmax): on the GPU two short Triton
    kernels (runtime/ops/sampling: torch's argmax reduces a row in one thread block, 27 us for DeepSeek's
    102400 logits on the H200), elsewhere torch.argmax. ``advance`` = (ids, positions, pads or None, step):
    also move a recorded decode step's inputs to the next step (ids <- argmax, positions += step,
    pads -= step), inside the argmax's second kernel on the GPU."""
    if use_triton(logits):
        return argmax_triton(logits if logits.stride(-1) == 1 else logits.contiguous(), advance)
    out = logits.argmax(-1)
    if advance is not None:
        ids, positions, pads, step = advance
        ids.copy_(out)
        positions.add_(step)
        if pads is not None:
            pads.sub_(step)
    return out


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
