"""What every region pass shares: the context it runs in, the result it reports, and the find -> check ->
plan -> (verify) -> rewrite loop.

A subclass names its ``kind`` and implements :meth:`RegionPass.plan`, which inspects one region and
returns a :class:`graphs.regions.Rewrite` or raises :class:`Skip` with a reason a user can act on. The base
class applies the rewrite, runs the optional verify check first, and records one :class:`RegionResult`
per region for the explain report. A region the pass cannot prove is left to Inductor untouched.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from graphs.modules import ModuleIndex, param_placeholders
from graphs.regions import Region, Rewrite, RewriteError, apply_rewrite, find_regions

log = logging.getLogger("hybrid")

REWRITTEN, DETECTED, SKIPPED = "rewritten", "detected", "skipped"


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


@dataclass
class RegionResult:
    kind: str
    module: str
    cls: str
    status: str
    reason: str
    graph: int
    detail: dict = field(default_factory=dict)


@dataclass
class PassContext:
    gm: fx.GraphModule
    example_inputs: list
    options: Any
    graph_id: int = 0
    results: list[RegionResult] = field(default_factory=list)
    verifier: Any = None
    #: set by a pass that changed what dynamo should trace (e.g. the model's experts implementation):
    #: the backend then drops dynamo's compiled code once, when this graph first runs
    retrace: bool = False
    #: what to change before that retrace: run when the graph first runs, never during dynamo's analysis
    #: (dynamo may restart an analysis, and a global changed in between makes it diverge)
    before_retrace: list = field(default_factory=list)
    #: what whole-graph passes did (not per region), for the explain report's graph entries
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.index = ModuleIndex(self.gm)
        self._params = param_placeholders(self.gm, self.example_inputs)
        self._regions: list[Region] | None = None

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


class RegionPass:
    kind: str = ""
    name: str = ""
    #: issue/feature that will rewrite regions this pass only detects
    todo: str | None = None

    def required_params(self, module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Parameters a complete region must read; missing ones mean the graph holds only part of the
        module's forward (a graph break inside it)."""
        return []

    def on_incomplete(self, region: Region) -> str:
        """Called when a graph break splits the region; may act and returns extra text for the reason."""
        return ""

    def plan(self, ctx: PassContext, region: Region) -> Rewrite:
        raise Skip(self.todo or "no rewrite")

    def run(self, ctx: PassContext) -> int:
        rewritten = 0
        for region in ctx.regions(self.kind):
            status, reason, detail = self._process(ctx, region)
            ctx.results.append(RegionResult(self.kind, region.path, region.cls_name, status, reason,
                                            ctx.graph_id, detail))
            log.info("hybrid: %s %s (%s): %s%s", self.kind, region.path, region.cls_name, status,
                     f" - {reason}" if reason else "")
            rewritten += status == REWRITTEN
        return rewritten

    def _process(self, ctx: PassContext, region: Region) -> tuple[str, str, dict]:
        region_inputs = set(region.inputs)
        missing = [n for n, p in self.required_params(region.module)
                   if ctx.param_node(p) is None or ctx.param_node(p) not in region_inputs]
        if missing:
            return SKIPPED, (f"only part of the module's forward is in this graph (it does not read "
                             f"{', '.join(missing)}): a graph break splits it" + self.on_incomplete(region)), {}
        if self.todo is not None:
            return DETECTED, self.todo, {}
        try:
            rw = self.plan(ctx, region)
        except Skip as e:
            return SKIPPED, str(e), {}
        if ctx.verifier is not None:
            ok, msg = ctx.verifier.check(region, rw)
            if not ok:
                log.warning("hybrid: verify rejected %s %s: %s", self.kind, region.path, msg)
                return SKIPPED, f"verify: rewritten region disagrees with eager ({msg}); left to Inductor", {}
        if getattr(ctx.options, "run_time_configs", False):
            # the opaque twin before apply_rewrite runs the op on the graph's symbolic shapes: the traced op's
            # body would turn its launch-config choices into guards (runtime/ops/run_time.py)
            from runtime.ops.run_time import TWINS, register
            register()
            rw.op = TWINS.get(rw.op, rw.op)
        try:
            apply_rewrite(ctx.gm, rw.nodes or region.nodes, rw)
        except RewriteError as e:
            return SKIPPED, f"graph surgery failed: {e}", {}
        return REWRITTEN, rw.note, {}
