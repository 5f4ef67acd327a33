"""Verify mode: run the original graph once on the example inputs, remember what every candidate region
read and produced, and check each planned rewrite against that before it is applied."""
from __future__ import annotations

import torch
from torch import fx
from torch.fx.node import map_arg

from graphs.regions import Region, Rewrite

from hybrid_kernels.numerics import close


_GONE = object()


def _clone(v):
    """A copy of a value for later comparison; ``_GONE`` for a tensor of a vmap level that has ended (HF's Mamba1
    scan runs under torch.vmap: its batched intermediates cannot be read outside it, and no op argument is one)."""
    if not isinstance(v, torch.Tensor):
        return v
    try:
        return v.clone()
    except RuntimeError:
        if torch._C._functorch.is_batchedtensor(v):
            return _GONE
        raise


def _concrete(v):
    """An example input as the run takes it: a symbolic size (a graph compiled for dynamic shapes) as the value it
    has in this call (its hint), which is the size the example tensors have."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = v.node.hint
        if hint is None:
            raise ValueError(f"symbolic input {v} has no example value to verify with")
        return type(hint)(hint)
    return v


class RegionRecorder(fx.Interpreter):
    """Interprets the graph; snapshots inputs at a region's first node and outputs after its last."""

    def __init__(self, gm: fx.GraphModule, regions: list[Region]):
        super().__init__(gm, garbage_collect_values=False)
        self.first = {r.nodes[0]: r for r in regions}
        self.last = {r.nodes[-1]: r for r in regions}
        self.before: dict[str, dict[fx.Node, object]] = {}
        self.after: dict[str, dict[fx.Node, object]] = {}

    def run_node(self, n: fx.Node):
        region = self.first.get(n)
        if region is not None:  # buffers the region writes: their values before it runs
            self.before[region.key] = {m: _clone(self.env[m]) for m in region.mutated_inputs}
        result = super().run_node(n)
        region = self.last.get(n)
        if region is not None:  # everything the region read or computed, as it stands at its end
            self.env[n] = result
            after = {x: _clone(self.env[x]) for x in region.inputs + region.nodes if x in self.env}
            self.after[region.key] = {x: v for x, v in after.items() if v is not _GONE}
        return result


class Verifier:
    def __init__(self, gm: fx.GraphModule, example_inputs: list, regions: list[Region]):
        self.regions = {r.key: r for r in regions}
        # Parameters are never written; everything else (caches, ids) is cloned so the run has no effect.
        args = [x if isinstance(x, torch.nn.Parameter) else _clone(_concrete(x)) for x in example_inputs]
        self.recorder = RegionRecorder(gm, regions)
        with torch.no_grad():
            self.recorder.run(*args)

    def check(self, region: Region, rw: Rewrite) -> tuple[bool, str]:
        before = self.recorder.before.get(region.key)
        after = self.recorder.after.get(region.key)
        if before is None or after is None:
            return False, "region was not reached when running the graph"
        def value(n):  # an input the op writes starts from its value before the region; others as they end
            return _clone(before[n] if n in before and n in rw.mutates else after[n])
        try:
            args = map_arg(rw.args, value)
            kwargs = map_arg(rw.kwargs, value)
        except KeyError as e:
            return False, f"op argument {e} was not computed by the time the region ended"
        with torch.no_grad():
            result = rw.op(*args, **kwargs)
        for node, idx in rw.outputs.items():
            got = result if idx is None else result[idx]
            ok, msg = close(got, after[node])
            if not ok:
                return False, f"output {node.name}: {msg}"
        flat_args = list(rw.args) + list(rw.kwargs.values())
        for m in rw.mutates:
            pos = flat_args.index(m)
            got = (list(args) + list(kwargs.values()))[pos]
            ok, msg = close(got, after[m])
            if not ok:
                return False, f"written input {m.name}: {msg}"
        return True, ""
