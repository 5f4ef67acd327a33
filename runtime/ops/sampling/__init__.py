"""Greedy next-token choice on the device: ``argmax_triton`` (reference: ``torch.argmax``, first maximal index)."""
from .kernels import argmax_triton  # noqa: F401
