"""Conventions shared by every ``hybrid::`` op.

Each op lives in its own folder (``moe/``, ``ssm/``, ``mla/``) with:
  - ``reference.py``: the plain torch implementation: the CPU path and the test oracle;
  - ``kernels.py``: Triton kernels and their launchers (``*_triton`` functions taking torch tensors);
  - ``ops.py``: the ``torch.library.triton_op`` definitions. An op body branches on the device: Triton
    launchers (through ``wrap_triton``) on CUDA, the reference elsewhere. The body doubles as the fake
    (meta) implementation, so it must not depend on tensor values (no ``.item()``, no ``nonzero``).

Triton on the CPU: tests set ``TRITON_INTERPRET=1`` before importing kernels and call the launchers on
CPU tensors (bf16 is unreliable in the interpreter: kernels load bf16 and compute in fp32).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

NAMESPACE = "hybrid"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton path for this tensor? CUDA always; CPU only when the interpreter is forced on for
    op-level tests (``HYBRID_TRITON_ON_CPU=1`` together with ``TRITON_INTERPRET=1``)."""
    if t.device.type == "cuda":
        return True
    return interpreting() and os.environ.get("HYBRID_TRITON_ON_CPU", "0") == "1"


def op_name(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def size_hint(n) -> int:
    """A size as a plain int for a launch-config choice, without adding a guard: a symbolic size (under
    torch.compile) gives the value it was traced with, and the choice is then fixed in the graph. Use it only
    where every choice is correct for every size (split counts, tile sizes), never for bounds."""
    if isinstance(n, torch.SymInt):
        hint = n.node.hint
        return int(hint) if hint is not None else 1
    return int(n)


def pdl() -> bool:
    """Launch kernels that support it with programmatic dependent launch (Hopper and newer): the kernel may start
    while the one before it drains and waits (``gdc_wait``) before reading anything. ``HYBRID_PDL=0`` turns it off."""
    if interpreting() or os.environ.get("HYBRID_PDL", "1") == "0":
        return False
    return _hopper_or_newer()


def pdl_opts(t: torch.Tensor) -> dict:
    """Launch options of a kernel that starts with ``pdl_start(PDL)``: programmatic dependent launch on Hopper,
    for launches on real tensors. Under tracing (a triton_op body that torch.compile or opcheck traces) the
    kernel is left without it: torch's analysis of which arguments a traced kernel writes cannot read the wait
    instruction and then takes every tensor argument as written, cloning each; where one tensor fills two
    pointer slots (a placeholder for an absent input) the clones part and the output is lost."""
    on = pdl() and t.is_cuda and not traced(t)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def traced(t: torch.Tensor) -> bool:
    """Is ``t`` seen while tracing (fake or functional tensors, a proxy mode, dynamo) rather than run on?"""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    return (type(t) not in (torch.Tensor, torch.nn.Parameter) or get_proxy_mode() is not None
            or torch.compiler.is_compiling())


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Start of a kernel launched with ``pdl_opts``: wait until the kernel before it has finished and its writes are
    visible (nothing an earlier kernel may write is read before this; a weight may be), then let the next kernel
    launch: its programs get scheduled while this one runs and wait in their own ``pdl_start``. The launch latency
    hides behind this kernel's work."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _hopper_or_newer() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
