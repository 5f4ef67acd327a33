"""Exported programs of the engine's model calls: dynamo's graph after hybrid's passes, as ``torch.export`` programs.

The engine calls the model with a few step tensors (ids, positions, masks, the step's cache maps) and the cache's
buffers. ``step_tensors`` names them, the same way at export and at load. ``Capture`` runs each distinct call (a
``variant_key``: which tensors, a batch or query length of one) once through ``torch.compile`` with hybrid's backend
(our passes, no Inductor), keeps the rewritten graph and exports it with every per-step size dynamic. A graph input
is then bound to a step tensor, a weight of the model (by name) or a constant value; its outputs to the logits and the
new SSM states (``ProgramSpec``). The exported graph is checked against the captured call on the same inputs.
"""
from __future__ import annotations

import torch
from torch import fx

from runtime.engine.exported import (ProgramSpec, StepOutput, _is_guard_failure, describe_call, find_programs,
                                     step_tensors,
                                     variant_key)

class ExportError(RuntimeError):
    """A model or call that cannot be exported as it is; the message says why and what runs instead."""


def bind_step_tensors(named: dict[str, torch.Tensor], cache) -> None:
    """Put ``named`` back on ``cache`` (the inverse of ``step_tensors`` for the cache's part): what the traced call
    reads, so every one of them is a graph input."""
    for i, layer in enumerate(cache.attention):
        layer.buf = named[f"buf.{i}"]
        for name in ("write_slots", "gather_idx", "block_table", "seq_lens"):
            if name in named:
                setattr(layer, name, named[name])
    for j, layer in enumerate(cache.states):
        for kind, states in (("conv", layer.conv_states), ("ssm", layer.recurrent_states)):
            if f"{kind}.{j}" in named:
                states[0] = named[f"{kind}.{j}"]


class Capture:
    """Exports the model calls of an engine built over ``model`` with ``compile=None``: install with
    ``Capture(engine, ...).install()``, run requests that reach every call variant, read ``programs``."""

    def __init__(self, engine, compile_options: dict | None = None, progress=print):
        self.engine, self.model = engine, engine.model
        self.cache = engine.cache
        self.options = {**(compile_options or {}), "inductor": False, "run_time_configs": True}
        self.progress = progress
        self.programs: dict[str, list[tuple[ProgramSpec, torch.export.ExportedProgram]]] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.consts: dict[str, torch.Tensor] = {}
        #: id(program) -> its inputs as the captured call had them (the check of a compiled package runs on them)
        self.examples: dict[int, list] = {}
        self._modules: dict[int, torch.nn.Module] = {}  # id(program) -> its module (_taken runs it)
        names = {}
        for n, t in [*self.model.named_parameters(remove_duplicate=False),
                     *self.model.named_buffers(remove_duplicate=False)]:
            names.setdefault(id(t), n)
        self._weight_names = names
        self._forward = engine.runner.forward
        self.error: Exception | None = None

    @property
    def count(self) -> int:
        return sum(map(len, self.programs.values()))

    def install(self) -> "Capture":
        from passes.prepare import prepare_model
        prepare_model(self.model)
        self.engine.runner.forward = self.forward
        return self

    def forward(self, input_ids, **kwargs):
        cache = kwargs[self.engine.runner.kwarg]
        named = step_tensors(input_ids, cache, kwargs)
        paged = bool(cache.attention and cache.attention[0].paged)
        if self._taken(named, paged):
            return self._forward(input_ids, **kwargs)
        key = variant_key(named, paged)
        self.progress(f"exporting graph {self.count + 1} ({key}: {describe_call(named)})")
        try:
            return self._capture(key, named, kwargs)
        except Exception as e:
            self.error = self.error or e  # the engine fails the request; export_engine raises it
            raise

    def _taken(self, named: dict, paged: bool) -> bool:
        """Whether a program already exported takes this call: its sizes fit and its own guards pass (a model that
        branches on sizes no range states, e.g. whole SSD chunks or not, needs a program per branch). The program runs
        on copies of the step tensors but the cache buffers, whose rows it writes as the live model then does."""
        for spec, ep in find_programs(self.programs, named, paged):
            args = [(named[n] if n.startswith("buf.") else named[n].clone()) if kind == "step"
                    else (self.weights[n] if kind == "weight" else self.consts[n]) for kind, n in spec.inputs]
            if id(ep) not in self._modules:
                self._modules[id(ep)] = ep.module()
            try:
                with torch.no_grad():
                    self._modules[id(ep)](*args)
                return True
            except (AssertionError, RuntimeError) as e:
                if not _is_guard_failure(e):
                    raise
        return False

    # ------------------------------------------------------------------------------------------------
    def _capture(self, key: str, named: dict, kwargs: dict):
        from compiler.backend import hybrid_backend
        model, cache, kwarg = self.model, self.cache, self.engine.runner.kwarg
        static = {k: v for k, v in kwargs.items() if not isinstance(v, (torch.Tensor, dict)) and k != kwarg}
        mask_keys = sorted(kwargs["attention_mask"]) if isinstance(kwargs.get("attention_mask"), dict) else None
        before = {k: v.clone() for k, v in named.items()}
        seen: list = []

        def step(t: dict):
            bind_step_tensors(t, cache)
            kw = dict(static, position_ids=t["positions"])
            kw[kwarg] = cache
            if mask_keys is not None:
                kw["attention_mask"] = {k: t.get(f"mask.{k}") for k in mask_keys}
            elif "mask" in t:
                kw["attention_mask"] = t["mask"]
            for name in ("hybrid_block_table", "hybrid_seq_lens"):
                if name in t:
                    kw[name] = t[name]
            return model.forward(t["ids"], **kw).logits

        def backend(gm, example_inputs):
            hybrid_backend(gm, example_inputs, options=self.options)
            seen.append((gm, list(example_inputs)))

            def run(*args):
                out = gm(*args)
                seen.append(out)
                return out
            return run

        # rows of the cache buffers and states are sizes of the programs, not constants: the engine sizes its cache
        # to the memory it finds at load
        marks = {}
        for k, v in named.items():
            if k.startswith(("buf.", "conv.", "ssm.")) and v.shape[0] > 1:
                marks[k] = v.__dict__.pop("_dynamo_static_indices", None)
                torch._dynamo.maybe_mark_dynamic(v, 0)
        torch._dynamo.reset()
        try:
            with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True, specialize_int=True), \
                    torch.fx.experimental._config.patch(use_duck_shape=False):
                logits = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)(dict(named))
        except torch._dynamo.exc.Unsupported as e:
            msg = " ".join(str(e).split())[:300]
            raise ExportError(f"{type(model).__name__} does not trace as one graph ({msg}): the engine runs it "
                              "compiled in-process, but it cannot be saved as engine files") from None
        finally:
            torch._dynamo.reset()
            for k, static in marks.items():
                named[k].__dict__.pop("_dynamo_weak_dynamic_indices", None)
                if static is not None:
                    named[k]._dynamo_static_indices = static
        if len(seen) != 2:
            raise ExportError(f"{type(model).__name__}: a model call traced as {len(seen) - 1} graphs (one needed)")
        (gm, example_inputs), outputs = seen
        spec, ep = self._export(key, gm, example_inputs, named, outputs, logits)
        self._check(spec, ep, before, logits, outputs)
        self.programs.setdefault(key, []).append((spec, ep))
        return StepOutput(logits)

    def _export(self, key, gm: fx.GraphModule, example_inputs, named, outputs, logits):
        by_id = {id(v): k for k, v in named.items()}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        _lift_sizes(gm, placeholders, example_inputs)
        inputs, args, dyn = [], [], []
        for node, x in zip(placeholders, example_inputs):
            if not isinstance(x, torch.Tensor):
                continue
            if id(x) in by_id:
                binding = ("step", by_id[id(x)])
            elif id(x) in self._weight_names:
                binding = ("weight", self._weight_names[id(x)])
                self.weights[binding[1]] = x
            else:  # a tensor the model holds outside its parameters (a float made a tensor, a mask constant)
                binding = ("const", f"{key}:{node.name}")
                if x.numel() > 1 << 20:
                    raise ExportError(f"a graph input of {tuple(x.shape)} that is neither a weight nor a step tensor "
                                      f"({node.name}): the model keeps state the engine does not know")
                self.consts[binding[1]] = x.detach().clone()
            inputs.append(binding)
            args.append(x)
            # every size of a step tensor but the ones of one (the variant keys those) may vary; export keeps fixed
            # what the graph fixes (heads, widths)
            dims = {i: torch.export.Dim.AUTO for i, n in enumerate(x.shape) if n > 1} if binding[0] == "step" else {}
            dyn.append(dims or None)
        gm.recompile()
        try:
            with torch.no_grad(), torch.fx.experimental._config.patch(use_duck_shape=False):
                ep = torch.export.export(gm, tuple(args), dynamic_shapes={"args": tuple(dyn)}, strict=False)
        except Exception as e:  # noqa: BLE001
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            raise ExportError(f"torch.export failed on the graph of {key} ({msg})") from None
        _split_sym_sums(ep.graph)
        out_ids = {id(t): i for i, t in reversed(list(enumerate(outputs)))}
        if id(logits) not in out_ids:
            raise ExportError("the logits are not an output of the traced graph")
        states = {}
        for j, layer in enumerate(self.cache.states):
            for kind, state in (("conv", layer.conv_states[0]), ("ssm", layer.recurrent_states[0])):
                name = f"{kind}.{j}"
                if state is None or (name in named and state is named[name]):
                    continue
                if id(state) not in out_ids:
                    raise ExportError(f"state {name} left on the cache is neither an input nor an output of the graph")
                states[name] = out_ids[id(state)]
        return ProgramSpec(key, "", inputs, out_ids[id(logits)], states, _dims(ep, inputs)), ep

    def _check(self, spec: ProgramSpec, ep, before: dict, logits, outputs) -> None:
        """The exported program on the call's inputs as they were before it must give the captured call's logits
        and states (the same ops in the same order: equal up to rounding)."""
        args = [before[name] if kind == "step" else (self.weights[name] if kind == "weight" else self.consts[name])
                for kind, name in spec.inputs]
        self.examples[id(ep)] = [a.clone() if kind == "step" else a for a, (kind, _) in zip(args, spec.inputs)]
        with torch.no_grad():
            out = ep.module()(*args)
        pairs = [(out[spec.logits], logits)] + [(out[i], outputs[i]) for i in spec.states.values()]
        for got, want in pairs:
            if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-4):
                err = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "shape"
                raise ExportError(f"the exported graph of {spec.key} differs from the traced call (max error {err})")


def _lift_sizes(gm: fx.GraphModule, placeholders: list, example_inputs: list) -> None:
    """Replace dynamo's SymInt inputs by the tensor sizes they stand for (an exported program takes tensors only)."""
    graph = gm.graph
    tensors = [n for n, x in zip(placeholders, example_inputs) if isinstance(x, torch.Tensor)]
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for node, x in zip(placeholders, example_inputs):
        if isinstance(x, torch.Tensor):
            continue
        if not node.users:
            graph.erase_node(node)
            continue
        sym = str(node.meta.get("example_value"))
        where = next(((t, d) for t in tensors for d, s in enumerate(t.meta["example_value"].shape)
                      if isinstance(s, torch.SymInt) and str(s) == sym), None)
        if where is None:
            raise ExportError(f"a graph input {node.name} = {x!r} that is no tensor's size ")
        with graph.inserting_before(first):
            size = graph.call_function(torch.ops.aten.sym_size.int, where)
        size.meta = dict(node.meta)
        node.replace_all_uses_with(size)
        graph.erase_node(node)
    gm.graph._codegen = fx.graph.CodeGen()  # plain positional inputs


def _split_sym_sums(graph: fx.Graph) -> None:
    """``torch.sym_sum`` (a size sum, e.g. of a conv state concatenated before a chunk's inputs) as a chain of
    ``operator.add``: torch.export's serialiser knows the second, not the first."""
    import operator
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is torch.sym_sum]:
        terms = list(node.args[0])
        value = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
        acc = terms[0]
        with graph.inserting_before(node):
            for term in terms[1:]:
                total = value(acc) + value(term)
                acc = graph.call_function(operator.add, (acc, term))
                acc.meta["val"] = total
        node.replace_all_uses_with(acc)
        graph.erase_node(node)


def _dims(ep, inputs: list[tuple[str, str]]) -> dict[str, list[list[int | None]]]:
    """[lo, hi] of every size of every step input of ``ep`` (its range constraints; hi None: unbounded)."""
    import sympy
    from torch.utils._sympy.numbers import IntInfinity
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user = placeholders[len(placeholders) - len(inputs):]
    out = {}
    for (kind, name), node in zip(inputs, user):
        if kind != "step":
            continue
        dims = []
        for n in node.meta["val"].shape:
            if not isinstance(n, torch.SymInt):
                dims.append([int(n), int(n)])
                continue
            expr = n.node.expr
            vr = ep.range_constraints.get(expr) if isinstance(expr, sympy.Symbol) else None
            if vr is None:
                dims.append([None, None])
                continue
            hi = vr.upper
            dims.append([int(vr.lower), None if isinstance(hi, IntInfinity) or hi == sympy.oo else int(hi)])
        out[name] = dims
    return out
