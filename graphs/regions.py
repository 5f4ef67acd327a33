"""Regions of a dynamo graph: the nodes one candidate module produced, their inputs and outputs, and the
surgery that replaces them with one call of a custom op.

A region is anchored on a module id from ``nn_module_stack`` (outermost candidate wins, so an MoE block
that contains a plain MLP is one region). Its *inputs* are the nodes outside it that it reads (parameters
arrive as graph inputs), its *outputs* the nodes inside it that something outside reads, and its
*mutated inputs* the outside tensors it writes in place (cache and state buffers in decode graphs).

:func:`apply_rewrite` keeps the invariants the rest of the stack relies on: the graph stays topologically
ordered, every new node carries ``meta["val"]``/``meta["example_value"]`` (fake tensors computed with the
graph's own fake mode) and the region's ``nn_module_stack``, and no region node is left behind.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx
from torch.fx.node import map_arg

from .modules import ModuleIndex, classify, node_module_keys

# In-place torch functions / methods that show up in HF graphs when caches are written.
_INPLACE_METHODS = {"copy_", "index_copy_", "index_put_", "fill_", "zero_", "add_", "mul_", "scatter_",
                    "masked_fill_", "clamp_", "div_", "sub_"}


def is_inplace(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _INPLACE_METHODS
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if isinstance(node.target, torch._ops.OpOverload):
            return node.target._schema.is_mutable
        return name.endswith("_") and not name.startswith("_") and name in _INPLACE_METHODS
    return False


def node_value(node: Any) -> Any:
    """The fake value dynamo/aot recorded for a node (``example_value`` on dynamo graphs, ``val`` later)."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("val", node.meta.get("example_value"))


@dataclass
class Region:
    kind: str
    key: str
    path: str
    cls_name: str
    module: torch.nn.Module
    nodes: list[fx.Node]
    _node_set: set = field(default_factory=set, repr=False)

    def __post_init__(self):
        self._node_set = set(self.nodes)

    def __contains__(self, node: fx.Node) -> bool:
        return node in self._node_set

    @property
    def inputs(self) -> list[fx.Node]:
        seen: dict[fx.Node, None] = {}
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a not in self._node_set:
                    seen.setdefault(a, None)
        return list(seen)

    @property
    def outputs(self) -> list[fx.Node]:
        return [n for n in self.nodes if any(u not in self._node_set for u in n.users)]

    @property
    def mutated_inputs(self) -> list[fx.Node]:
        """Outside tensors written in place by the region (first argument of an in-place op, through views)."""
        out: dict[fx.Node, None] = {}
        for n in self.nodes:
            if is_inplace(n) and n.args and isinstance(n.args[0], fx.Node):
                base = view_base(n.args[0])
                if base not in self._node_set:
                    out.setdefault(base, None)
        return list(out)



    def without(self, nodes) -> "Region":
        """The same region less ``nodes`` (parts that stay in the graph when the rest is rewritten)."""
        drop = set(nodes)
        return Region(self.kind, self.key, self.path, self.cls_name, self.module,
                      [n for n in self.nodes if n not in drop])

    def counter_writes(self) -> list[fx.Node]:
        """The region's in-place increments of a token counter outside it, with the views they write through:
        an ``add_`` of a number (or an outside size) to a 0-d integer tensor, as HF's linear-attention cache layers
        count tokens (``cumulative_length_linear``). Bookkeeping, not state: a rewrite keeps these nodes in the graph
        (``without``) and replaces the rest."""
        out: dict[fx.Node, None] = {}
        for n in self.nodes:
            if not (is_inplace(n) and n.target in ("add_", torch.Tensor.add_, torch.ops.aten.add_.Tensor)
                    and n.args and isinstance(n.args[0], fx.Node)):
                continue
            chain = view_chain(n.args[0])
            base, inner = chain[-1], [c for c in chain if c in self._node_set]
            value = node_value(base)
            reads = [a for c in [n, *inner] for a in c.all_input_nodes if a not in inner]
            if (base not in self._node_set and isinstance(value, torch.Tensor) and value.dim() == 0
                    and not value.is_floating_point() and all(a is base or a not in self._node_set for a in reads)):
                out.update(dict.fromkeys([*inner, n]))
        return list(out)


_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "select",
                 "narrow", "flatten", "unflatten", "t", "contiguous", "view_as", "float", "to"}


def view_base(node: fx.Node) -> fx.Node:
    """Follow view-like ops (and getitem slicing) back to the tensor whose storage they alias.

    ``.to``/``.float``/``.contiguous`` only alias when they are no-ops; callers use this to find the buffer an
    in-place write lands in, where HF only ever writes through true views.
    """
    return view_chain(node)[-1]


def view_chain(node: fx.Node) -> list[fx.Node]:
    """``node``, the tensor it is a view of, and so on back to ``view_base(node)`` (last)."""
    chain = [node]
    while True:
        node = chain[-1]
        if node.op == "call_method" and node.target in _VIEW_METHODS and isinstance(node.args[0], fx.Node):
            chain.append(node.args[0])
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and isinstance(node_value(node.args[0]), torch.Tensor) and _basic_index(node.args[1]):
            chain.append(node.args[0])
        else:
            return chain


def _basic_index(idx) -> bool:
    """Whether ``x[idx]`` is a view: ints, slices, None and ``...`` only. A tensor or list index (advanced
    indexing, HF's ``hidden_states[token_idx]``) gathers into a new tensor, so writes to it stay local."""
    if isinstance(idx, tuple):
        return all(_basic_index(i) for i in idx)
    if isinstance(idx, fx.Node):
        return not isinstance(node_value(idx), torch.Tensor)
    return idx is None or idx is Ellipsis or isinstance(idx, (int, slice, torch.SymInt))


def find_regions(gm: fx.GraphModule, index: ModuleIndex,
                 classifier: Callable[[torch.nn.Module | None], str | None] = classify) -> list[Region]:
    """Group nodes by the outermost module on their stack that the classifier accepts."""
    kinds: dict[str, str | None] = {}
    members: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue  # placeholders carry a module stack too, but they are inputs, never region members
        for key in node_module_keys(node):
            if key not in kinds:
                kinds[key] = classifier(index.module(key))
            if kinds[key]:
                members.setdefault(key, []).append(node)
                break
    _adopt_orphans(gm, members)
    regions = []
    for key, nodes in members.items():
        rec = index.records[key]
        regions.append(Region(kinds[key], key, rec.path, getattr(rec.cls, "__name__", str(rec.cls)),
                              rec.module, nodes))
    return regions


def _adopt_orphans(gm: fx.GraphModule, members: dict[str, list[fx.Node]]) -> None:
    """Dynamo leaves some bookkeeping calls without a module stack (e.g. ``_vmap_decrement_nesting`` after
    a vmap inside a module). A call with no inputs and no users that sits between two nodes of the same
    region belongs to it: erasing the region must take it along."""
    owner = {n: key for key, nodes in members.items() for n in nodes}
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    for i, n in enumerate(calls):
        if n in owner or node_module_keys(n) or n.all_input_nodes or n.users:
            continue
        before = next((owner[c] for c in reversed(calls[:i]) if c in owner), None)
        after = next((owner.get(c) for c in calls[i + 1:] if c in owner or node_module_keys(c)), None)
        if before is not None and before == after:
            owner[n] = before
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for key in members:
        members[key] = sorted((n for n, k in owner.items() if k == key), key=order.__getitem__)


# --------------------------------------------------------------------------------------------------
# Rewrites
# --------------------------------------------------------------------------------------------------

@dataclass
class Rewrite:
    """What a pass wants a region replaced with: ``op(*args, **kwargs)``.

    ``outputs`` maps each region output node to the index of the op result that replaces it (``None``
    when the op returns a single tensor). ``mutates`` lists outside nodes the op writes in place (it must
    declare them in ``mutates_args``); the region's own in-place writes to them disappear with the region.
    ``nodes`` narrows the rewrite to part of the region (e.g. an MoE block minus its shared expert).
    """
    op: Callable
    args: tuple
    kwargs: dict
    outputs: dict[fx.Node, int | None]
    mutates: list[fx.Node] = field(default_factory=list)
    note: str = ""
    #: the nodes to replace when only part of the region is rewritten (default: the whole region)
    nodes: list[fx.Node] | None = None
    #: nodes outside the region that the op makes unused (e.g. a gather it reads around): erased in this
    #: order once they have no users left
    unused: list[fx.Node] = field(default_factory=list)


class RewriteError(RuntimeError):
    pass


def _fake_mode_of(nodes) -> Any:
    """The fake mode the graph's own values live in (not the ambient tracing context's, which can differ
    when a backend runs)."""
    for n in nodes:
        mode = getattr(node_value(n), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _fake_call(op, args, kwargs):
    fargs = map_arg(args, node_value)
    fkwargs = map_arg(kwargs, node_value)
    all_nodes = [a for a in list(args) + list(kwargs.values()) if isinstance(a, fx.Node)]
    mode = _fake_mode_of(all_nodes)
    if mode is None:
        raise RewriteError("no fake values on the region inputs; cannot infer the output metadata")
    with mode:
        return op(*fargs, **fkwargs)


def apply_rewrite(gm: fx.GraphModule, nodes: list[fx.Node], rw: Rewrite, meta_from: fx.Node | None = None) -> fx.Node:
    """Replace ``nodes`` (a region, in graph order) by ``rw.op``. Returns the call node.

    Size computations (SymInt/SymFloat nodes) that only read the region's inputs stay in the graph: under
    dynamic shapes dynamo shares them with the code after the region."""
    nodes = _without_sizes(nodes)
    node_set = set(nodes)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    arg_nodes = [a for a in _flat_nodes(rw.args) + _flat_nodes(rw.kwargs)]
    for a in arg_nodes:
        if a in node_set:
            raise RewriteError(f"op argument {a.name} is computed inside the region it replaces")
    outside_users = [u for o in rw.outputs for u in o.users if u not in node_set]
    for o in [n for n in nodes if any(u not in node_set for u in n.users)]:
        if o not in rw.outputs:
            raise RewriteError(f"region output {o.name} (used by {[u.name for u in o.users]}) has no replacement")
    # Insert after the last argument, before the first outside user: both must hold.
    last_arg = max((order[a] for a in arg_nodes), default=-1)
    first_user = min((order[u] for u in outside_users), default=len(order))
    if last_arg >= first_user:
        raise RewriteError("region is interleaved with the code that consumes it; cannot place one call")
    anchor = max([n for n in nodes if order[n] < first_user] + [a for a in arg_nodes], key=lambda n: order[n])
    _check_mutation_order(nodes, node_set, rw, order, order[anchor])

    fake = _fake_call(rw.op, rw.args, rw.kwargs)
    meta_src = meta_from or nodes[0]
    with graph.inserting_after(anchor):
        call = graph.call_function(rw.op, tuple(rw.args), dict(rw.kwargs))
    _copy_meta(call, meta_src, fake)
    replacements: dict[fx.Node, fx.Node] = {}
    cursor = call
    for out_node, idx in rw.outputs.items():
        if idx is None:
            replacements[out_node] = call
            continue
        with graph.inserting_after(cursor):
            item = graph.call_function(operator.getitem, (call, idx))
        _copy_meta(item, meta_src, fake[idx])
        replacements[out_node] = item
        cursor = item
    for out_node, new in replacements.items():
        out_node.replace_all_uses_with(new, delete_user_cb=lambda u: u not in node_set)
    for n in reversed(nodes):
        if n.users:
            raise RewriteError(f"region node {n.name} still has users {[u.name for u in n.users]}")
        graph.erase_node(n)
    for n in rw.unused:
        if not n.users:
            graph.erase_node(n)
    graph.lint()
    return call


def _is_size(node: fx.Node) -> bool:
    return isinstance(node_value(node), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _without_sizes(nodes: list[fx.Node]) -> list[fx.Node]:
    member, kept = set(nodes), set()
    for n in nodes:
        if _is_size(n) and all(a not in member or a in kept for a in n.all_input_nodes):
            kept.add(n)
    return [n for n in nodes if n not in kept]


def _check_mutation_order(nodes, node_set, rw: Rewrite, order, anchor_pos: int) -> None:
    """The op writes its mutated inputs at the anchor; outside code that read them before the region's
    own writes must still run before that point."""
    for m in rw.mutates:
        writes = [order[n] for n in nodes if is_inplace(n) and isinstance(n.args[0], fx.Node)
                  and view_base(n.args[0]) is m]
        last_write = max(writes, default=anchor_pos)
        for u in m.users:
            if u not in node_set and anchor_pos < order[u] < last_write:
                raise RewriteError(f"{u.name} reads {m.name} between the new call and the region's write")


def _copy_meta(new: fx.Node, src: fx.Node, fake_value: Any) -> None:
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in src.meta:
            new.meta[key] = src.meta[key]
    new.meta["val"] = fake_value
    new.meta["example_value"] = fake_value


def _flat_nodes(obj) -> list[fx.Node]:
    out: list[fx.Node] = []
    map_arg(obj, lambda n: out.append(n) or n)
    return out


# --------------------------------------------------------------------------------------------------
# Sub-graphs: run part of a graph on its own (probing a candidate rewrite on fresh random inputs)
# --------------------------------------------------------------------------------------------------

def concrete(v: Any) -> Any:
    """A SymInt's hint (the size seen when tracing), other values unchanged."""
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        return v.node.hint
    return v


def extract_subgraph(nodes: list[fx.Node], inputs: list[fx.Node], output: fx.Node) -> fx.GraphModule:
    """A standalone GraphModule computing ``output`` from ``inputs`` with ``nodes`` (graph order).
    Sizes computed outside (SymInt nodes) are frozen to their traced values; any other outside tensor
    raises RewriteError (the sub-graph would not be self-contained)."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {n: graph.placeholder(f"in{i}") for i, n in enumerate(inputs)}

    def lookup(n: fx.Node):
        if n in env:
            return env[n]
        v = node_value(n)
        if isinstance(v, (torch.SymInt, torch.SymFloat, int, float)):
            return concrete(v)
        raise RewriteError(f"sub-graph reads {n.name} from outside")
    member = set(nodes)
    for n in nodes:
        if n in env:
            continue
        env[n] = graph.node_copy(n, lookup)
    assert output in member
    graph.output(env[output])
    return fx.GraphModule(torch.nn.Module(), graph)
