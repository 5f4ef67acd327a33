"""The ``hybrid`` dynamo backend: dynamo's graph -> our passes (fixed order) -> Inductor.

``torch.compile(model, backend="hybrid")`` finds this function through the ``torch_dynamo_backends``
entry point, so users import nothing of ours.
"""
from __future__ import annotations

import itertools
import logging
import os

import torch
from torch import fx

import kernels  # noqa: F401  (registers the hybrid:: ops the passes emit)
from kernels.library import pdl
from passes import PassContext, prepare_graph, run_pipeline

from .options import Options
from .report import GraphInfo, publish

log = logging.getLogger("hybrid")
_graph_ids = itertools.count()


def hybrid_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None,
                   mode: str | None = None, **unused):
    """Rewrite MLA / SSM / MoE regions into hybrid ops, then compile the graph with Inductor."""
    opts = Options.parse(options)
    graph_id = next(_graph_ids)
    nodes_before = len(gm.graph.nodes)
    ctx = PassContext(gm, example_inputs, opts, graph_id=graph_id)
    if opts.verify:
        from .verify import Verifier
        all_regions = [r for kind in ("mla", "ssm", "moe") for r in ctx.regions(kind)]
        ctx.verifier = Verifier(gm, example_inputs, all_regions)
    ctx.notes.extend(prepare_graph(ctx))
    counts = run_pipeline(ctx, opts.passes)
    gm.recompile()
    info = GraphInfo(graph_id, nodes_before, len(gm.graph.nodes), _describe_inputs(example_inputs), counts,
                     "inductor" if opts.inductor else "eager", list(ctx.notes))
    publish(ctx.results, info)
    log.info("hybrid: graph %d: %d -> %d nodes, rewritten %s", graph_id, nodes_before, len(gm.graph.nodes), counts)
    if not opts.inductor:
        return _inference(gm.forward, ctx.retrace, ctx.before_retrace)
    from torch._inductor.compile_fx import compile_fx
    patches = {**_gpu_defaults(example_inputs), **opts.inductor_config}
    if mode is not None:
        patches = {**torch._inductor.list_mode_options(mode), **patches}
    with torch.no_grad():
        compiled = compile_fx(gm, example_inputs, config_patches=patches or None)
    return _inference(compiled, ctx.retrace, ctx.before_retrace)


def _gpu_defaults(example_inputs: list) -> dict:
    """Inductor settings for a graph on CUDA tensors, each overridable through ``inductor_config``. A decode step at batch 1 is
    dozens of short kernels, so launches and the gaps between them count:
    - ``triton.enable_pdl``: Inductor's kernels launch with programmatic dependent launch like ours
      (``kernels.library.pdl``), unless TORCHINDUCTOR_ENABLE_PDL says otherwise;
    - ``combo_kernels``: independent small kernels (MLA's RoPE and norm glue: four kernels per layer -> three) share
      a launch."""
    if not any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        return {}
    out = {"combo_kernels": True}
    if pdl() and hasattr(torch._inductor.config.triton, "enable_pdl") and "TORCHINDUCTOR_ENABLE_PDL" not in os.environ:
        out["triton.enable_pdl"] = True
    return out


def _inference(fn, retrace: bool = False, before_retrace=()):
    """hybrid compiles for inference: graphs are built and run without autograd (the fused ops have no
    backward), also when the caller forgot ``torch.no_grad()``. With ``retrace``, the first run calls
    ``before_retrace`` (changes to what dynamo traces, made outside its analysis) and drops dynamo's compiled
    code so the next call traces the model again (see passes/prepare.py)."""
    pending = [retrace]

    def run(*args):
        if pending[0]:
            pending[0] = False
            for action in before_retrace:
                action()
            torch._dynamo.reset_code_caches()
        with torch.no_grad():
            return fn(*args)
    if getattr(fn, "_boxed_call", False):
        run._boxed_call = True  # dynamo then passes one list of inputs; keep the convention
    return run


def _describe_inputs(example_inputs) -> str:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter):
            return f"{x.dtype}".replace("torch.", "") + str(list(x.shape))
    return ""
