"""Greedy next-token choice on the device (ops.py: ``greedy_ids``): a two-kernel Triton argmax (triton_argmax.py;
reference: ``torch.argmax``, first maximal index, reference.py)."""
