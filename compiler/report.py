"""The explain report: every candidate region the passes saw, in every graph, and what became of it."""
from __future__ import annotations

import contextlib
import itertools
import json
import threading
from dataclasses import asdict, dataclass, field

from passes.base import DETECTED, REWRITTEN, SKIPPED, RegionResult

_RANK = {SKIPPED: 0, DETECTED: 1, REWRITTEN: 2}


@dataclass
class GraphInfo:
    graph: int
    nodes_before: int
    nodes_after: int
    inputs: str
    rewritten: dict[str, int]
    compiler: str
    #: whole-graph rewrites (not regions), e.g. complex arithmetic lowered to real (passes/complex.py)
    notes: list[str] = field(default_factory=list)


@dataclass
class Report:
    results: list[RegionResult] = field(default_factory=list)
    graphs: list[GraphInfo] = field(default_factory=list)
    ids: itertools.count = field(default_factory=itertools.count, repr=False, compare=False)

    def regions(self) -> list[dict]:
        """One entry per module: the worst status over the graphs it appeared in, with that graph's reason. Graphs that
        ran once before a retrace (``provisional``) count only where the module appears in no other graph."""
        by_module: dict[str, list[RegionResult]] = {}
        for r in self.results:
            by_module.setdefault(r.module, []).append(r)
        out = []
        for module, rs in by_module.items():
            lasting = [r for r in rs if not r.provisional] or rs
            worst = min(lasting, key=lambda r: _RANK[r.status])
            out.append(dict(kind=worst.kind, module=module, cls=worst.cls, status=worst.status,
                            reason=worst.reason, graphs={str(r.graph): r.status for r in rs}))
        return out

    def counts(self) -> dict[str, int]:
        c = {REWRITTEN: 0, DETECTED: 0, SKIPPED: 0}
        for r in self.regions():
            c[r["status"]] += 1
        return c

    def to_dict(self) -> dict:
        regions = [dict(r, **{"class": r.pop("cls")}) for r in self.regions()]
        return {"regions": regions, "counts": self.counts(), "graphs": [asdict(g) for g in self.graphs]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        rows = [("kind", "module", "class", "status", "reason")]
        for r in self.regions():
            rows.append((r["kind"], r["module"], r["cls"], r["status"], r["reason"]))
        notes = [f"graph {g.graph}: {note}" for g in self.graphs for note in g.notes]
        if len(rows) == 1:
            return "\n".join(["no MLA, SSM or MoE region found: the whole graph goes to Inductor unchanged", *notes])
        widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
        lines = []
        for i, row in enumerate(rows):
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
        c = self.counts()
        lines.append(f"{len(rows) - 1} regions in {len(self.graphs)} graph(s): {c[REWRITTEN]} rewritten, "
                     f"{c[DETECTED]} detected, {c[SKIPPED]} skipped")
        return "\n".join(lines + notes)


_local = threading.local()


def _sinks() -> list[Report]:
    if not hasattr(_local, "sinks"):
        _local.sinks = []
    return _local.sinks


_process_ids = itertools.count()


def next_graph_id() -> int:
    """The number of the graph the backend compiles now: counted from 0 inside the outermost ``collect`` block (an
    explain report numbers its own graphs), else across the process (log lines stay unique)."""
    sinks = _sinks()
    return next(sinks[0].ids) if sinks else next(_process_ids)


@contextlib.contextmanager
def collect():
    """Collect the reports of every graph the hybrid backend compiles inside the block."""
    report = Report()
    _sinks().append(report)
    try:
        yield report
    finally:
        _sinks().remove(report)


def publish(results: list[RegionResult], info: GraphInfo) -> None:
    for sink in _sinks():
        sink.results.extend(results)
        sink.graphs.append(info)
