"""The engine's MLA decode step as one op: the MLA pass's paged attention plus the step's own cache write and RoPE.

In the engine's decode graphs (runtime/engine/cache.py), a DeepSeek attention layer computes, before the attention
the MLA pass rewrites: ``kv_a_layernorm`` of the new token's latent, RoPE of the query's and the key's rope parts,
and the cache layer's ``buf.index_copy_(0, slots, rows)`` of ``[latent | rope key]``. Inductor runs these as three
kernels per layer. ``hybrid::mla_decode_step`` (runtime/ops/mla/paged.py) does them in the launch that absorbs the
query, so :func:`step_rewrite` replaces them along with the attention:

- the write: one ``index_copy_`` into the cache buffer, nothing else reading the buffer but the gather the attention
  replaces, its rows ``cat([kv_a_layernorm(kv), k_rope])`` through views and casts (a probe runs the row assembly on
  random inputs), kv_a_layernorm an RMSNorm (the norm pass's probe of the live module);
- RoPE (optional: when it cannot be proven the op takes the rotated parts, and Inductor keeps RoPE): every node from
  the query's and the key's rope parts (the second halves of their splits) to the rotated ones, reading only tables
  from outside the layer (DeepSeek-V2's complex ``freqs_cis``, or DeepSeek-V3's cos and sin) and read by nothing
  else; a probe runs both sub-graphs on random inputs against ``step.rope_ref`` for each layout the kernel knows
  (interleaved pairs; halves with whole or half tables) and takes the one that matches.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from compiler.numerics import close
from graphs.modules import node_module_keys
from graphs.regions import Region, Rewrite, RewriteError, _fake_call, concrete, extract_subgraph, node_value

from .base import PassContext, Skip, eager_probe
from .norm import rmsnorm_eps, rmsnorm_problem

#: views and casts between the rows the cache layer assembles and what it writes
_ROW_VIEWS = {"view", "reshape", "transpose", "contiguous", "to", "float"}


@dataclass
class _StepWrite:
    """The engine's cache write of a decode step, as ``hybrid::mla_decode_step`` takes it over."""
    kv: fx.Node           # the new token's latent before kv_a_layernorm [B, 1, L]
    norm_weight: fx.Node
    eps: float
    k_rope: fx.Node       # the new token's rope key after RoPE
    slots: fx.Node        # the index_copy_'s rows
    nodes: list[fx.Node]  # replaced: the norm, the row's assembly, the write
    sizes: list[fx.Node]  # scalar nodes only the norm read (its eps, lifted by dynamo)


def step_rewrite(ctx: PassContext, region: Region, m, nodes: list[fx.Node], sdpa: fx.Node, q_nope: fx.Node,
                 q_rope: fx.Node, gather: fx.Node, weight: fx.Node, scale: float, note: str) -> Rewrite:
    """``hybrid::mla_decode_step`` in place of the paged attention ``nodes`` and the step's write (and RoPE), or Skip."""
    buf, _, table, lens, _, block_size = gather.args
    latent, k_cached = list(gather.users)
    write = _step_write(ctx, region, m, buf, gather)
    replaced = set(nodes) | set(write.nodes)
    try:
        q_pe, k_pe, cos, sin, layout, rope_nodes = _step_rope(ctx, region, q_nope, q_rope, write, replaced)
        replaced |= set(rope_nodes)
        args = (q_nope, q_pe, write.kv, write.norm_weight, k_pe, buf, write.slots, table, lens, weight, cos, sin, layout)
        note += "; the step's kv_a_layernorm, RoPE, cache write and query absorption are one launch"
    except Skip as e:
        args = (q_nope, q_rope, write.kv, write.norm_weight, write.k_rope, buf, write.slots, table, lens, weight, None,
                None, 0)
        note += f"; the step's kv_a_layernorm, cache write and query absorption are one launch (RoPE left: {e})"
    order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
    return Rewrite(torch.ops.hybrid.mla_decode_step.default, (*args, write.eps, block_size, scale), {}, {sdpa: None},
                   mutates=[buf], note=note, nodes=sorted(replaced, key=order.__getitem__),
                   unused=[latent, k_cached, gather, *write.sizes])


def _step_write(ctx: PassContext, region: Region, m, buf: fx.Node, gather: fx.Node) -> _StepWrite:
    """The write of the step's row into ``buf`` when it is what the engine's cache layer does
    (runtime/engine/cache.py: ``buf.index_copy_(0, slots, cat([kv_a_layernorm(kv), k_rope], -1)`` reshaped to rows,
    nothing else reading ``buf``) and kv_a_layernorm is an RMSNorm (norm pass's probe); else Skip with why."""
    writes = [u for u in buf.users if u is not gather]
    if len(writes) != 1 or writes[0] not in region or not (
            writes[0].op == "call_method" and writes[0].target == "index_copy_" and len(writes[0].args) == 4
            and writes[0].args[0] is buf and writes[0].args[1] == 0 and not writes[0].kwargs and not writes[0].users):
        raise Skip("the cache is not written by one index_copy_ of rows in this attention")
    write = writes[0]
    slots, src = write.args[2], write.args[3]
    chain = [src]  # the written rows back to the concatenation: views and casts, each read once
    while chain[-1].op == "call_method" and chain[-1].target in _ROW_VIEWS and len(chain[-1].users) == 1:
        chain.append(chain[-1].args[0])
    cat = chain[-1]
    if not (cat.op == "call_function" and cat.target is torch.cat and len(cat.args[0]) == 2 and len(cat.users) == 1):
        raise Skip("the cached row is not one concatenation of the latent and the rope key")
    lat, k_rope = cat.args[0]
    norm = m.kv_a_layernorm
    key = str(id(norm))
    norm_nodes = [n for n in region.nodes if key in node_module_keys(n)]
    norm_set = set(norm_nodes)
    outs = [n for n in norm_nodes if any(u not in norm_set for u in n.users)]
    path = [lat]
    while path[-1] not in norm_set and path[-1].op == "call_method" and path[-1].target in _ROW_VIEWS \
            and len(path[-1].users) == 1:
        path.append(path[-1].args[0])
    if len(outs) != 1 or path[-1] is not outs[0] or len(outs[0].users) != 1:
        raise Skip("the cached latent is not kv_a_layernorm's output, read only by the cache write")
    eps = rmsnorm_eps(norm)
    weight = ctx.param_node(norm.weight)
    acts = [a for n in norm_nodes for a in n.all_input_nodes if a not in norm_set and a is not weight
            and isinstance(node_value(a), torch.Tensor) and node_value(a).dim() > 0]
    if eps is None or weight is None or len(set(acts)) != 1:
        raise Skip("kv_a_layernorm is not a module holding one weight and an eps, reading one input")
    kv = acts[0]
    kv_v, row_v, buf_v = node_value(kv), node_value(src), node_value(buf)
    b, lat_dim = concrete(kv_v.shape[0]), concrete(kv_v.shape[-1])
    rope_dim = concrete(buf_v.shape[-1]) - lat_dim
    if kv_v.dim() != 3 or concrete(kv_v.shape[1]) != 1 or row_v.dtype != buf_v.dtype or \
            kv_v.dtype not in (buf_v.dtype, torch.float32) or concrete(node_value(k_rope).numel()) != b * rope_dim:
        raise Skip("the step's latent, rope key and cache rows do not have the shapes and dtypes of a one-token step")
    problem = rmsnorm_problem(norm, eps, kv_v.dtype)
    if problem:
        raise Skip(f"kv_a_layernorm: {problem}")
    sizes = [n for n in norm_nodes if isinstance(node_value(n), (torch.SymInt, torch.SymFloat, int, float))]
    assembly = [n for n in region.nodes if n in set(path[:-1]) | set(chain)]
    try:
        sub = extract_subgraph(assembly, [outs[0], k_rope], src)
    except RewriteError as e:
        raise Skip(str(e)) from None
    g = torch.Generator(device="cpu").manual_seed(6)
    lat_x, rope_x = (torch.randn([concrete(s) for s in node_value(n).shape], generator=g).to(node_value(n).dtype)
                     for n in (outs[0], k_rope))
    with eager_probe():
        got = sub(lat_x, rope_x)
    want = torch.cat([lat_x.reshape(b, lat_dim), rope_x.reshape(b, rope_dim)], -1).view(b, 1, -1).to(row_v.dtype)
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype or not torch.equal(got, want):
        raise Skip("the written rows are not [latent | rope key] per sequence (probe)")
    return _StepWrite(kv, weight, eps, k_rope, slots, norm_nodes + assembly + [write], sizes)


def _split_sibling(node: fx.Node) -> fx.Node:
    """The second output of the split whose first output is ``node``."""
    if not (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0):
        raise Skip("the nope part is not the first output of a split")
    sib = [u for u in node.args[0].users if u.op == "call_function" and u.target is operator.getitem
           and u.args[1] == 1]
    if len(sib) != 1:
        raise Skip("the rope part is not the split's second output")
    return sib[0]


def _closure(region: Region, out: fx.Node, stop: fx.Node) -> tuple[set[fx.Node], list[fx.Node]]:
    """Nodes computing ``out`` from ``stop`` inside the region, and what they read from outside it (tables)."""
    nodes, tables, todo = set(), [], [out]
    while todo:
        n = todo.pop()
        if n in nodes or n is stop or n in tables:
            continue
        v = node_value(n)
        if isinstance(v, (torch.SymInt, torch.SymFloat, int, float)):
            continue  # sizes stay in the graph (extract_subgraph freezes them)
        if n not in region:
            tables.append(n)
            continue
        nodes.add(n)
        todo.extend(n.all_input_nodes)
    return nodes, tables


def _step_rope(ctx: PassContext, region: Region, q_nope: fx.Node, q_rope: fx.Node, write: _StepWrite,
               replaced: set[fx.Node]):
    """(q_pe, k_pe, cos, sin, layout, nodes): the RoPE of the step's query and key, proven by a probe, or Skip."""
    from runtime.ops.mla.step import rope_ref
    q_pe, k_pe = _split_sibling(q_nope), _split_sibling(write.kv)
    q_nodes, q_tables = _closure(region, q_rope, q_pe)
    k_nodes, k_tables = _closure(region, write.k_rope, k_pe)
    if set(q_tables) != set(k_tables) or not q_nodes or not k_nodes:
        raise Skip("the query and the key are not turned with the same tables")
    nodes = q_nodes | k_nodes
    allowed = nodes | replaced
    if any(u not in allowed for n in nodes for u in n.users):
        raise Skip("a RoPE node is also read elsewhere")
    tables = sorted(q_tables, key=lambda n: n.name)
    complex_tables = [t for t in tables if node_value(t).is_complex()]
    if not (len(tables) == 1 and complex_tables) and not (len(tables) == 2 and not complex_tables):
        raise Skip("RoPE reads neither one complex table nor two real ones")
    qv, kv_, ov, okv = (node_value(n) for n in (q_pe, k_pe, q_rope, write.k_rope))
    b, r = concrete(qv.shape[0]), concrete(qv.shape[-1])
    if qv.dtype != ov.dtype or kv_.dtype != okv.dtype or concrete(kv_.numel()) != b * r or r % 2:
        raise Skip("the rope parts do not keep their dtypes and shapes through RoPE")
    tv = [node_value(t) for t in tables]
    order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
    try:
        sub_q = extract_subgraph(sorted(q_nodes, key=order.__getitem__), [q_pe, *tables], q_rope)
        sub_k = extract_subgraph(sorted(k_nodes, key=order.__getitem__), [k_pe, *tables], write.k_rope)
    except RewriteError as e:
        raise Skip(str(e)) from None
    g = torch.Generator(device="cpu").manual_seed(7)
    rand = lambda v: torch.randn([concrete(s) for s in v.shape], generator=g, dtype=v.dtype)  # noqa: E731
    qx, kx, tx = rand(qv), rand(kv_), [rand(v) for v in tv]
    with eager_probe():
        got_q, got_k = sub_q(qx, *tx), sub_k(kx, *tx)
    if complex_tables:
        candidates = [(1, tx[0].real, tx[0].imag, None)]
    else:
        candidates = [(layout, tx[i], tx[1 - i], i) for layout in (2, 3) for i in (0, 1)]
    tol = 1e-5 if qv.dtype == torch.float32 else 2e-2
    for layout, c, s, first in candidates:
        n = r // 2 if layout == 1 else r
        if concrete(c.numel()) != b * n or concrete(c.shape[0]) != b:
            continue
        c2, s2 = c.reshape(b, n), s.reshape(b, n)
        want_q = rope_ref(qx.reshape(b, -1, r), c2[:, None], s2[:, None], layout).reshape(qx.shape)
        want_k = rope_ref(kx.reshape(b, r), c2, s2, layout).reshape(got_k.shape)
        if close(got_q, want_q, qv.dtype, tol=tol)[0] and close(got_k, want_k, kv_.dtype, tol=tol)[0]:
            break
    else:
        raise Skip("RoPE's sub-graphs match no layout the kernel knows (probe)")
    if complex_tables:
        cos, sin = _real_parts(ctx.gm.graph, tables[0])
    else:
        cos, sin = tables[first], tables[1 - first]
    return q_pe, k_pe, cos, sin, layout, sorted(nodes, key=order.__getitem__)


def _real_parts(graph: fx.Graph, z: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Nodes for the real and imaginary parts of complex ``z`` (``view_as_real(z)[..., 0 / 1]``), right after it."""
    with graph.inserting_after(z):
        vr = graph.call_function(torch.view_as_real, (z,))
    with graph.inserting_after(vr):
        re = graph.call_function(torch.select, (vr, -1, 0))
    with graph.inserting_after(re):
        im = graph.call_function(torch.select, (vr, -1, 1))
    for n in (vr, re, im):
        fake = _fake_call(n.target, n.args, n.kwargs)
        n.meta["val"] = n.meta["example_value"] = fake
    return re, im
