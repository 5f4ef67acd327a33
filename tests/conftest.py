"""Test-session setup. Kernel tests run Triton kernels on CPU tensors through the interpreter, which must
be switched on before any kernel module is imported."""
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
