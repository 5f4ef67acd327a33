"""Linear layers at one row (decode at batch 1): ``hybrid::linear`` and ``hybrid::linear_group`` (ops.py), Triton
kernels in kernels.py; reference: ``torch.nn.functional.linear``."""
from . import ops  # noqa: F401
from .kernels import linear_triton, pick_config  # noqa: F401
