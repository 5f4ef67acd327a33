"""Linear layers at one row (decode at batch 1): ``hybrid::linear``, ``hybrid::linear_group`` and
``hybrid::norm_linear`` (ops.py), Triton kernels in triton_gemv.py / triton_norm.py; references in reference.py
(``torch.nn.functional.linear`` and HF's RMSNorm). Importing the package registers the ops."""
from . import ops  # noqa: F401
