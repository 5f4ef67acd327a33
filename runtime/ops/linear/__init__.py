"""Decode-time linear layers: ``skinny_linear_triton`` (M <= 16 rows; reference: ``F.linear``)."""
from .kernels import MAX_ROWS, pick_config, skinny_linear_triton  # noqa: F401
