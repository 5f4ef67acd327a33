"""Plain torch reference of greedy decoding's argmax (and the decode-step advance the Triton kernel fuses)."""
from __future__ import annotations

import torch


def argmax_ref(logits: torch.Tensor, advance: tuple | None = None) -> torch.Tensor:
    """logits [B, V] -> torch.argmax(logits, -1) (the first maximal index); ``advance`` as in
    ``triton_argmax.argmax_triton``: ids <- the argmax, positions += step, pads -= step."""
    out = logits.argmax(-1)
    if advance is not None:
        ids, positions, pads, step = advance
        ids.copy_(out)
        positions.add_(step)
        if pads is not None:
            pads.sub_(step)
    return out
