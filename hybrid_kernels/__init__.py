"""The ``hybrid::`` op vocabulary and its kernels: the bottom floor of the house (imports nothing of ours).

One folder per op family (``attention``, ``linear``, ``mla``, ``moe``, ``ssm``, ``delta``, ``sampling``), each with
the same files (see library.py); ``numerics.py`` is how the project compares tensors. Importing this package
registers every op."""
from .linear import ops as _linear  # noqa: F401
from .mla import ops as _mla  # noqa: F401
from .attention import ops as _attention  # noqa: F401
from .delta import ops as _delta  # noqa: F401
from .moe import ops as _moe  # noqa: F401
from .ssm import ops as _ssm  # noqa: F401
