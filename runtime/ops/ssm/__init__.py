"""Mamba / Mamba2 SSM ops: causal conv1d, selective scan, SSD chunked scan, their decode updates and the
gated RMSNorm. Importing the package registers the ``hybrid::`` ops (see README.md)."""
from .ops import (  # noqa: F401
    causal_conv1d,
    causal_conv1d_update,
    gated_rms_norm,
    selective_scan,
    selective_state_update,
    ssd_scan,
    ssd_state_update,
)
