"""What every pass shares: the context it runs in, the result it returns, and the bookkeeping around it.

A pass subclasses :class:`Pass` and implements :meth:`Pass.apply`, which edits the graph and returns a
:class:`PassResult` (how many rewrites it made, one :class:`RegionResult` per candidate region, graph-level notes).
:meth:`Pass.run` does the rest for every pass alike: it times and logs the pass, lints the graph after it, and
contains its faults: when ``apply`` raises or leaves a graph that fails lint, the graph is restored to what it was
before the pass, the pass is dropped for this graph (its regions are reported ``skipped`` with the exception) and
one warning is logged.

:class:`RegionPass` is the pass over candidate regions (MLA, SSM, MoE): a subclass names its ``kind`` and implements
:meth:`RegionPass.plan`, which inspects one region and returns a :class:`graphs.regions.Rewrite` or raises
:class:`Skip` with a reason a user can act on. The base class checks the region is complete, runs the optional
verify check, applies the rewrite and records the result. A region the pass cannot prove is left to Inductor.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from graphs.modules import ModuleIndex, param_placeholders
from graphs.regions import Region, Rewrite, RewriteError, apply_rewrite, find_regions

log = logging.getLogger("hybrid")

REWRITTEN, DETECTED, SKIPPED = "rewritten", "detected", "skipped"

#: exceptions torch.compile raises on purpose to steer its own analysis (restart it, skip a frame): never a failure
#: of ours to contain, always passed on
CONTROL_FLOW = (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame, torch._dynamo.exc.ResetRequired)


@contextlib.contextmanager
def eager_probe():
    """Run live modules eagerly from inside the backend (no grad, and not "compiling": HF picks its
    tracing-only code paths, e.g. vmap-based scans, when ``torch.compiler.is_compiling()`` is true)."""
    flag = getattr(torch.compiler, "_is_compiling_flag", None)
    if flag is not None:
        torch.compiler._is_compiling_flag = False
    try:
        with torch.no_grad():
            yield
    finally:
        if flag is not None:
            torch.compiler._is_compiling_flag = flag


class Skip(Exception):
    """Raised by ``plan`` when a region must be left alone; the message is the reason shown to users."""


class Fused(Exception):
    """Raised by ``plan`` when the region already runs hybrid's op (the engine's attention functions call them on
    some steps): nothing to rewrite, and the region counts as rewritten; the message says which op."""


@dataclass
class RegionResult:
    kind: str
    module: str
    cls: str
    status: str
    reason: str
    graph: int
    #: the graph's compiled code is dropped after its first run (a preparation change retraces the model), so this
    #: result describes a graph that runs once
    provisional: bool = False


@dataclass
class PassResult:
    """What one pass did to one graph."""
    #: rewrites made (regions replaced, or whole-graph rewrites counted as the pass counts them)
    matches: int = 0
    #: one entry per candidate region the pass looked at (region passes)
    regions: list[RegionResult] = field(default_factory=list)
    #: what the pass says about the graph as a whole, for the explain report's graph entries
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: the exception that made ``run`` drop the pass for this graph, if any
    error: str | None = None


@dataclass
class PassContext:
    gm: fx.GraphModule
    example_inputs: list
    options: Any
    graph_id: int = 0
    results: list[RegionResult] = field(default_factory=list)
    verifier: Any = None
    #: set by a preparation that changed what dynamo should trace (e.g. the model's experts implementation):
    #: the backend then drops dynamo's compiled code once, when this graph first runs
    retrace: bool = False
    #: what to change before that retrace: run when the graph first runs, never during dynamo's analysis
    #: (dynamo may restart an analysis, and a global changed in between makes it diverge)
    before_retrace: list = field(default_factory=list)
    #: graph-level notes (passes and preparation), for the explain report's graph entries
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.index = ModuleIndex(self.gm)
        self.refresh()

    def refresh(self) -> None:
        """Forget what was derived from the graph's nodes (after the graph object was replaced)."""
        self._params = param_placeholders(self.gm, self.example_inputs)
        self._regions: list[Region] | None = None
        self.__dict__.pop("_weight_nodes", None)

    @property
    def weight_nodes(self) -> set[fx.Node]:
        """Graph inputs that carry a parameter or buffer of a module in this graph (not caches or ids)."""
        if not hasattr(self, "_weight_nodes"):
            ids = set()
            for rec in self.index:
                if rec.module is not None:
                    ids.update(id(t) for t in rec.module.parameters())
                    ids.update(id(t) for t in rec.module.buffers())
            self._weight_nodes = {n for i, n in self._params.items() if i in ids}
        return self._weight_nodes

    def regions(self, kind: str) -> list[Region]:
        if self._regions is None:
            self._regions = find_regions(self.gm, self.index)
        return [r for r in self._regions if r.kind == kind]

    def param_node(self, tensor: torch.Tensor | None) -> fx.Node | None:
        """The graph node that carries a live parameter/buffer, or None if this graph does not read it."""
        return None if tensor is None else self._params.get(id(tensor))


#: attributes dynamo sets on graph nodes outside ``meta`` that Inductor reads (a placeholder's source: AOT autograd
#: asserts every placeholder of a graph with symbolic sizes has one)
NODE_ATTRS = ("_dynamo_source",)


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A node-for-node copy of ``graph`` (metadata and ``NODE_ATTRS`` included): the state a failed pass is rolled
    back to."""
    new = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    new._codegen = graph._codegen
    copies: dict[fx.Node, fx.Node] = {}
    value, output = new.graph_copy(graph, copies, return_output_node=True)
    new.output(value, output.type).meta = dict(output.meta)
    for old, node in copies.items():
        for attr in NODE_ATTRS:
            if hasattr(old, attr):
                setattr(node, attr, getattr(old, attr))
    return new


_warned: set[tuple[str, str]] = set()


class Pass:
    """One graph pass. ``name`` is its option switch (``options={name: False}``); ``kind`` the region kind it reports
    under in the explain report."""
    name: str = ""
    kind: str = ""

    def apply(self, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def regions(self, ctx: PassContext) -> list[Region]:
        """The candidate regions this pass reports on (region passes); whole-graph passes have none."""
        return []

    def run(self, ctx: PassContext) -> PassResult:
        """``apply`` with timing, logging, lint and fault containment (module docstring)."""
        snapshot = copy_graph(ctx.gm.graph)
        start = time.perf_counter()
        try:
            result = self.apply(ctx)
            ctx.gm.graph.lint()
            if result.matches:
                ctx.gm.recompile()
        except CONTROL_FLOW:
            raise
        except Exception as e:  # noqa: BLE001  (a bug of ours must not fail the user's compile)
            result = self._drop(ctx, snapshot, e)
        result.seconds = time.perf_counter() - start
        ctx.results.extend(result.regions)
        ctx.notes.extend(result.notes)
        log.debug("hybrid: graph %d: pass %s: %d rewrites in %.3fs", ctx.graph_id, self.name, result.matches,
                  result.seconds)
        return result

    def _drop(self, ctx: PassContext, snapshot: fx.Graph, error: Exception) -> PassResult:
        ctx.gm.graph = snapshot
        ctx.gm.recompile()
        ctx.refresh()
        what = f"{type(error).__name__}: {error}".strip()
        if len(what) > 300:
            what = what[:297] + "..."
        key = (self.name, what)
        if key not in _warned:
            _warned.add(key)
            log.warning("hybrid: pass %r failed on graph %d and was dropped for it (the graph compiles without it): "
                        "%s", self.name, ctx.graph_id, what)
        reason = f"pass '{self.name}' failed on this graph ({what}); the graph compiles without it"
        regions = [RegionResult(self.kind, r.path, r.cls_name, SKIPPED, reason, ctx.graph_id)
                   for r in self.regions(ctx)]
        return PassResult(0, regions, [] if regions else [reason], error=what)

    def disabled(self, ctx: PassContext) -> PassResult:
        """What the report says when options turn the pass off."""
        regions = [RegionResult(self.kind, r.path, r.cls_name, SKIPPED, f"pass '{self.name}' disabled by options",
                                ctx.graph_id) for r in self.regions(ctx)]
        ctx.results.extend(regions)
        return PassResult(0, regions)


class RegionPass(Pass):
    """A pass over the candidate regions of one kind: find -> completeness check -> ``plan`` -> (verify) -> rewrite."""
    #: issue/feature that will rewrite regions this pass only detects
    todo: str | None = None

    def regions(self, ctx: PassContext) -> list[Region]:
        return ctx.regions(self.kind)

    def required_params(self, module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Parameters a complete region must read; missing ones mean the graph holds only part of the
        module's forward (a graph break inside it)."""
        return []

    def plan(self, ctx: PassContext, region: Region) -> Rewrite:
        raise Skip(self.todo or "no rewrite")

    def apply(self, ctx: PassContext) -> PassResult:
        result = PassResult()
        for region in self.regions(ctx):
            status, reason = self._process(ctx, region)
            result.regions.append(RegionResult(self.kind, region.path, region.cls_name, status, reason, ctx.graph_id))
            log.info("hybrid: %s %s (%s): %s%s", self.kind, region.path, region.cls_name, status,
                     f" - {reason}" if reason else "")
            result.matches += status == REWRITTEN
        return result

    def _process(self, ctx: PassContext, region: Region) -> tuple[str, str]:
        region_inputs = set(region.inputs)
        missing = [n for n, p in self.required_params(region.module)
                   if ctx.param_node(p) is None or ctx.param_node(p) not in region_inputs]
        if missing:
            return SKIPPED, (f"only part of the module's forward is in this graph (it does not read "
                             f"{', '.join(missing)}): a graph break splits it")
        if self.todo is not None:
            return DETECTED, self.todo
        try:
            rw = self.plan(ctx, region)
        except Skip as e:
            return SKIPPED, str(e)
        except Fused as e:
            return REWRITTEN, str(e)
        except Exception as e:  # noqa: BLE001  (a plan reads the graph or undoes its own edits: the region is left)
            log.warning("hybrid: %s pass failed to plan %s: %s: %s", self.name, region.path, type(e).__name__, e)
            return SKIPPED, f"the {self.name} pass failed on this region ({type(e).__name__}: {e}); left to Inductor"
        if ctx.verifier is not None:
            ok, msg = ctx.verifier.check(region, rw)
            if not ok:
                log.warning("hybrid: verify rejected %s %s: %s", self.kind, region.path, msg)
                return SKIPPED, f"verify: rewritten region disagrees with eager ({msg}); left to Inductor"
        if getattr(ctx.options, "run_time_configs", False):
            # the opaque twin before apply_rewrite runs the op on the graph's symbolic shapes: the traced op's
            # body would turn its launch-config choices into guards (hybrid_kernels/library.py: define_twin)
            from hybrid_kernels.library import twin
            rw.op = twin(rw.op)
        try:
            apply_rewrite(ctx.gm, rw.nodes or region.nodes, rw)
        except RewriteError as e:
            return SKIPPED, f"graph surgery failed: {e}"
        return REWRITTEN, rw.note
