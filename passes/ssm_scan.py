"""What the SSM pass does about HF's Mamba1 scan specialising graphs on the sequence length.

HF's Mamba1 and Jamba mixers call a module-level ``mamba_selective_scan`` (mamba_ssm's ``selective_scan_fn``
when installed, else a torch path: an associative scan or a Python loop over the tokens). Dynamo traces the
torch path with the length as a constant, so stock ``torch.compile`` recompiles for every new prompt length,
before any backend sees a graph. Choice made here, as for HF's eager experts (passes/moe_eager.py): when the
SSM pass first meets a Mamba1 mixer, hybrid replaces that module's ``mamba_selective_scan`` by a wrapper that
calls HF's own function when running eagerly and, while dynamo traces, the opaque ``hybrid::selective_scan_rt``
(same math, a shape-only fake: the length stays symbolic). Dynamo's compiled code is dropped once and the next
call retraces; from then on one graph serves every length, and the SSM pass rewrites the mixer around the op
as before. The engine installs the wrapper before it compiles (no retrace). The wrapper stays installed for the
process: any later trace of that HF module (other backends, torch.export) sees the opaque op too, whose
implementation is hybrid's scan (Triton on the GPU); an exported program then needs hybrid's ops registered.
"""
from __future__ import annotations

import functools
import sys

import torch

from graphs.modules import is_mamba1_mixer

NAME = "mamba_selective_scan"


def _wrap(original):
    @functools.wraps(original)
    def hybrid_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              return_last_state=False, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return original(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
                            *args, **kwargs)
        y, last = torch.ops.hybrid.selective_scan_rt(hidden_states, dt, A, B, C, D, z, delta_bias,
                                                     bool(delta_softplus), None)
        return (y, last) if return_last_state else y
    hybrid_selective_scan._hybrid_original = original
    return hybrid_selective_scan


def _hf_scan(mixer_cls: type):
    """HF's scan function of ``mixer_cls``'s module, if it has one and it is not wrapped yet."""
    fn = getattr(sys.modules.get(mixer_cls.__module__), NAME, None)
    return None if fn is None or hasattr(fn, "_hybrid_original") else fn


def install(mixer_cls: type) -> bool:
    """Wrap the scan of ``mixer_cls``'s HF module; True when newly installed."""
    fn = _hf_scan(mixer_cls)
    if fn is None:
        return False
    from runtime.ops.run_time import register
    register()
    setattr(sys.modules[mixer_cls.__module__], NAME, _wrap(fn))
    return True


def install_for_model(model: torch.nn.Module) -> int:
    """Install for every Mamba1 mixer class in ``model`` (before compiling it); returns how many."""
    classes = {type(m) for m in model.modules() if is_mamba1_mixer(m)}
    return sum(install(c) for c in classes)


def adopt_mamba1_scans(ctx) -> str:
    """Install for the Mamba1 mixers of this graph when it first runs, then retrace. Returns a note for the
    explain report of those mixers ('' when nothing changes)."""
    classes = {type(rec.module) for rec in ctx.index if rec.module is not None and is_mamba1_mixer(rec.module)}
    pending = [c for c in classes if _hf_scan(c) is not None]
    for cls in pending:
        ctx.before_retrace.append(functools.partial(install, cls))
    if not pending:
        return ""
    ctx.retrace = True
    return ("; HF's scan specialised this graph on the length: from the next call it runs as "
            "hybrid::selective_scan_rt (one recompile, then one graph for every length)")
