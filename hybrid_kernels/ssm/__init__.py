"""Mamba / Mamba2 SSM ops: causal conv1d, selective scan, SSD chunked scan, their decode updates, the gated RMSNorm,
Mamba2's fused decode projections and whole mixers. Importing the package registers the ``hybrid::`` ops
(see README.md)."""
from . import ops  # noqa: F401
