"""argmax_triton (greedy decoding) vs torch.argmax: first maximal index, ties within and across chunks, strided
rows, vocabularies that are not multiples of the block; CPU: the Triton interpreter."""
from __future__ import annotations

import pytest
import torch

from hybrid_kernels.sampling.triton_argmax import argmax_triton
from hybrid_kernels.sampling import triton_argmax as kernels

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("vocab", [102400, 50280, 8191, 1000, 1])
def test_argmax_equals_torch_first_maximum(vocab, batch):
    g = torch.Generator().manual_seed(vocab + batch)
    logits = torch.randn(batch, vocab, generator=g).to(DEV, torch.bfloat16)  # bf16: many exact ties
    logits[0] = 0.0  # all tied: index 0
    if batch > 1 and vocab > 3:
        logits[1, vocab // 3] = logits[1, vocab - 1] = 99.0  # a tie across chunks: the earlier one
        logits[2, :] = float("-inf")
        logits[2, vocab - 2] = -1e30                        # the max in the last chunk, not at its start
    want = logits.argmax(-1)
    assert torch.equal(argmax_triton(logits), want)
    assert torch.equal(argmax_triton(logits.float()), want)


def test_argmax_strided_rows_and_many_rows(monkeypatch):
    monkeypatch.setattr(kernels, "BLOCK", 64)  # many chunks and blocks per chunk on a small vocabulary
    base = torch.randn(70, 3, 999).to(DEV)
    rows = base[:, 1]                            # row stride 3 * 999
    assert torch.equal(argmax_triton(rows), rows.argmax(-1))
    assert argmax_triton(rows[:0]).shape == (0,)


@pytest.mark.parametrize("pads", [True, False])
def test_argmax_advances_the_next_steps_inputs(pads):
    """advance=(ids, positions, pads, step): ids <- argmax, positions += step, pads -= step (step 0 on padding rows)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 1000, generator=g).to(DEV)
    ids, pos = torch.randint(0, 9, (5,), generator=g).to(DEV), torch.randint(0, 99, (5,), generator=g).to(DEV)
    pad = torch.randint(0, 9, (5,), generator=g).to(DEV) if pads else None
    step = torch.tensor([1, 1, 1, 0, 0], device=DEV)
    want_pos = pos + step
    want_pad = pad - step if pads else None
    got = argmax_triton(logits, (ids, pos, pad, step))
    assert torch.equal(got, logits.argmax(-1)) and torch.equal(ids, got) and torch.equal(pos, want_pos)
    assert not pads or torch.equal(pad, want_pad)
