"""Conventions shared by every ``hybrid::`` op family (``linear/``, ``mla/``, ``moe/``, ``ssm/``, ``sampling/``).

Each family folder has the same files:
  - ``reference.py``: the plain torch implementation: the CPU path and the test oracle;
  - ``triton_*.py``: Triton kernels and their launchers (``*_triton`` functions taking torch tensors);
  - ``gluon_*.py`` (MLA only): Hopper kernels in Gluon;
  - ``ops.py``: the one module that registers the family's ops (``torch.library.triton_op`` / ``custom_op``, their
    fakes and run-time twins) and the family's ``implementation`` function, the one place that chooses between
    the reference, Triton and Gluon for a call. A triton_op body doubles as the fake (meta) implementation, so it
    must not depend on tensor values (no ``.item()``, no ``nonzero``).
Composite ops (a whole mixer, an MoE block) keep their bodies in a module of their own that ``ops.py`` calls.

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
REFERENCE, TRITON, GLUON = "reference", "triton", "gluon"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton path for this tensor? CUDA always; CPU only when the interpreter is forced on for
    op-level tests (``HYBRID_TRITON_ON_CPU=1`` together with ``TRITON_INTERPRET=1``)."""
    if t.device.type == "cuda":
        return True
    return interpreting() and os.environ.get("HYBRID_TRITON_ON_CPU", "0") == "1"


def implementation(t: torch.Tensor) -> str:
    """The default choice for a call on ``t``: TRITON where ``use_triton`` holds, else REFERENCE. Families refine it
    in their own ``ops.implementation`` (shapes the kernels take, Gluon on Hopper)."""
    return TRITON if use_triton(t) else REFERENCE


def op_name(name: str) -> str:
    return f"{NAMESPACE}::{name}"


#: traced op overload -> its run-time twin (``define_twin``)
TWINS: dict = {}
_twin_lib = torch.library.Library(NAMESPACE, "FRAGMENT")


def define_twin(op, fake) -> None:
    """Register ``hybrid::<name>_rt``, the run-time twin of the traced op ``op`` (a triton_op whose launch configs
    depend on sizes: MoE token buckets, MLA split counts, the scan's chunking). torch.compile traces a triton_op's body,
    so each such choice made on a symbolic size becomes a guard and a dynamic batch recompiles whenever it crosses a
    boundary. The twin has the same schema, the shape-only ``fake`` (no branch on sizes, so no guard) and a real
    implementation that calls ``op`` eagerly: configs are picked from each call's concrete shapes. Inductor sees an
    opaque call; CUDA graphs record it like any other launch. The engine asks for twins (backend option
    ``run_time_configs``); the default keeps the traced ops, which AOT packages need."""
    if op in TWINS:
        return
    name = op._schema.name.split("::", 1)[1] + "_rt"
    _twin_lib.define(f"{name}({str(op._schema).split('(', 1)[1]}")

    def impl(*args):
        # contiguous: the fake promises fresh contiguous tensors (SDPA may return a transposed layout)
        out = op(*args)
        return tuple(t.contiguous() for t in out) if isinstance(out, (tuple, list)) else out.contiguous()

    for key in ("CPU", "CUDA"):
        _twin_lib.impl(name, impl, key)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_twin_lib)
    TWINS[op] = getattr(getattr(torch.ops, NAMESPACE), name).default


def twin(op):
    """The run-time twin of ``op`` when it has one, else ``op``."""
    return TWINS.get(op, op)


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


def compiled_kernels() -> dict[str, int]:
    """``{module.kernel: compiled variants}`` of every Triton / Gluon kernel of this package that has compiled (all
    devices). Triton compiles a kernel once per constexpr set and per specialisation of its other arguments
    (an integer equal to 1 or divisible by 16, a pointer aligned to 16 bytes), each time it first meets one in a
    process, for up to a second; a server checks that its warm-up left nothing to compile (tests, bench). Empty
    under the interpreter."""
    import sys
    from triton.runtime.jit import JITFunction
    counts = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(__package__ + ".") or module is None:
            continue
        for attr, fn in vars(module).items():
            if isinstance(fn, JITFunction) and fn.__module__ == name:
                n = sum(len(cache[0]) for cache in getattr(fn, "device_caches", {}).values())
                if n:
                    counts[f"{name.removeprefix(__package__ + '.')}.{attr}"] = n
    return counts
