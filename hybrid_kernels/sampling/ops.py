"""Greedy decoding's next-token choice: ``greedy_ids``, which picks the implementation per call (the Triton argmax on
the GPU, the torch reference elsewhere). No ``hybrid::`` op: the engine calls it on real tensors, inside a recorded
CUDA graph or not."""
from __future__ import annotations

import torch

from hybrid_kernels.library import TRITON, implementation

from .reference import argmax_ref
from .triton_argmax import argmax_triton


def greedy_ids(logits: torch.Tensor, advance: tuple | None = None) -> torch.Tensor:
    """logits [B, V] -> argmax ids [B] (the first maximal index, as torch.argmax): on the GPU two short Triton
    kernels (torch's argmax reduces a row in one thread block), elsewhere torch.argmax. ``advance`` = (ids,
    positions, pads or None, step): also move a recorded decode step's inputs to the next step (ids <- argmax,
    positions += step, pads -= step), inside the argmax's second kernel on the GPU."""
    if implementation(logits) == TRITON:
        return argmax_triton(logits if logits.stride(-1) == 1 else logits.contiguous(), advance)
    return argmax_ref(logits, advance)
