"""The ``hybrid`` dynamo backend: dynamo's graph -> our passes (fixed order) -> Inductor.

``torch.compile(model, backend="hybrid")`` finds this function through the ``torch_dynamo_backends``
entry point, so users import nothing of ours.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch
from torch import fx

import hybrid_kernels  # noqa: F401  (registers the hybrid:: ops the passes emit)
from hybrid_kernels.library import pdl
from passes import PassContext, prepare_graph, run_pipeline
from passes.base import CONTROL_FLOW, copy_graph

from .options import Options
from .report import GraphInfo, next_graph_id, publish

log = logging.getLogger("hybrid")


def hybrid_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None,
                   mode: str | None = None, **unused):
    """Rewrite MLA / SSM / MoE regions into hybrid ops, then compile the graph with Inductor.

    Nothing of ours fails the user's compile: a pass that fails is dropped for the graph (passes/base.py); should
    anything else of ours fail (the preparation, the report), the graph compiles as dynamo traced it; should Inductor
    fail on the rewritten graph, on the graph as traced; and should it fail on that too, the graph runs eagerly. Each
    fallback is logged once and written in the explain report's notes for the graph."""
    opts = Options.parse(options)
    graph_id = next_graph_id()
    nodes_before = len(gm.graph.nodes)
    original = copy_graph(gm.graph)
    try:
        ctx = PassContext(gm, example_inputs, opts, graph_id=graph_id)
        if opts.verify:
            from .verify import Verifier
            all_regions = [r for kind in ("mla", "ssm", "moe") for r in ctx.regions(kind)]
            ctx.verifier = Verifier(gm, example_inputs, all_regions)
        ctx.notes.extend(prepare_graph(ctx))
        counts = run_pipeline(ctx, opts.passes)
        gm.recompile()
        results, notes, retrace = ctx.results, list(ctx.notes), (ctx.retrace, ctx.before_retrace)
        if ctx.retrace:  # this graph runs once, then the model retraces
            results = [dataclasses.replace(r, provisional=True) for r in results]
    except CONTROL_FLOW:
        raise
    except Exception as e:  # noqa: BLE001  (a bug of ours: the graph as dynamo traced it)
        _restore(gm, original)
        counts, results, retrace = {}, [], (False, [])
        notes = [_fallback(graph_id, "hybrid's passes failed on this graph", e, "it compiles as traced")]
    info = GraphInfo(graph_id, nodes_before, len(gm.graph.nodes), _describe_inputs(example_inputs), counts,
                     "inductor" if opts.inductor else "eager", notes)
    log.info("hybrid: graph %d: %d -> %d nodes, rewritten %s", graph_id, nodes_before, len(gm.graph.nodes), counts)
    if not opts.inductor:
        publish(results, info)
        return _inference(gm.forward, *retrace)
    from torch._inductor.compile_fx import compile_fx
    patches = {**_gpu_defaults(example_inputs), **opts.inductor_config}
    if mode is not None:
        patches = {**torch._inductor.list_mode_options(mode), **patches}
    try:
        with torch.no_grad():
            compiled = compile_fx(gm, example_inputs, config_patches=patches or None)
    except CONTROL_FLOW:
        raise
    except Exception as e:  # noqa: BLE001  (Inductor on our rewrite: the graph as traced, or eager)
        rewritten = any(counts.values())
        compiled = _compile_traced(gm, original, example_inputs, patches, graph_id, e, info, rewritten)
        if rewritten:
            why = "Inductor failed on the rewritten graph; the graph compiles as traced"
            results = [dataclasses.replace(r, status="skipped", reason=why) if r.status == "rewritten" else r
                       for r in results]
    publish(results, info)
    return _inference(compiled, *retrace)


def _compile_traced(gm, original, example_inputs, patches, graph_id, error, info, rewritten: bool):
    """Inductor failed on ``gm``: Inductor on the graph as traced (when our rewrite changed it), else eager."""
    from torch._inductor.compile_fx import compile_fx
    if rewritten:
        info.notes.append(_fallback(graph_id, "Inductor failed on the rewritten graph", error,
                                    "it compiles as traced, without hybrid's rewrites"))
        _restore(gm, original)
        try:
            with torch.no_grad():
                return compile_fx(gm, example_inputs, config_patches=patches or None)
        except CONTROL_FLOW:
            raise
        except Exception as e:  # noqa: BLE001
            error = e
    info.notes.append(_fallback(graph_id, "Inductor failed on this graph", error, "it runs eagerly"))
    info.compiler = "eager"
    return gm.forward


def _restore(gm: fx.GraphModule, graph: fx.Graph) -> None:
    gm.graph = copy_graph(graph)
    gm.recompile()


_said: set[str] = set()


def _fallback(graph_id: int, what: str, error: Exception, then: str) -> str:
    """The explain note for a fallback, logged once per distinct error."""
    msg = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
    note = f"{what} ({msg}); {then}"
    if note not in _said:
        _said.add(note)
        log.warning("hybrid: graph %d: %s", graph_id, note)
    return note


def _gpu_defaults(example_inputs: list) -> dict:
    """Inductor settings for a graph on CUDA tensors, each overridable through ``inductor_config``. A decode step at batch 1 is
    dozens of short kernels, so launches and the gaps between them count:
    - ``triton.enable_pdl``: Inductor's kernels launch with programmatic dependent launch like ours
      (``hybrid_kernels.library.pdl``), unless TORCHINDUCTOR_ENABLE_PDL says otherwise;
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
