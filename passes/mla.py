"""MLA pass: DeepSeek-style latent attention -> ``hybrid::mla_attention`` from the latent on.

Found by parameters (``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``q_proj`` or
``q_a_proj``/``q_b_proj``). In the graph the rewrite is anchored on two nodes: the ``kv_b_proj`` linear
(its input is the cached latent, after HF's cache update) and the SDPA call. Everything between the
anchors' inputs (query halves, latent, rope key, kv_b_proj weight, mask) and the SDPA output is replaced:
the per-head re-expansion of the whole cache, the key assembly (``new_empty`` + two ``copy_``) and the
attention itself. Projections, RoPE, HF's cache update and ``o_proj`` stay in the graph; so do HF's cache
semantics. A query that is one projection of nope + rope channels per head, no RoPE applied (Kimi Linear), is
first put in the cat(q_nope, q_rope) form the op takes (``_split_query``). Before rewriting, the replaced
sub-graph is cut out and run on random inputs against the op: a structure that computes something else is
left to Inductor. In the engine's decode graphs the cache update returns ``hybrid::paged_gather`` (the paged-decode contract, hybrid_kernels/mla/ops.py): a one-token attention whose latent
and rope key come straight from it becomes ``hybrid::mla_attention_paged`` over the pages, and the gather is erased.
passes/mla_step.py then takes the step's cache write and kv_a_layernorm into that op where it can prove them.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from graphs.modules import MLA, node_module_keys
from graphs.regions import Region, Rewrite, RewriteError, concrete, extract_subgraph, is_inplace, node_value, view_base
from hybrid_kernels.mla.ops import PREFILL
from hybrid_kernels.numerics import close

from .base import Fused, PassContext, RegionPass, Skip, eager_probe

_SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
_LINEAR = {torch._C._nn.linear, F.linear}
#: what the replaced sub-graph may contain besides the anchors
_ALLOWED_METHODS = {"view", "reshape", "transpose", "expand", "new_empty", "copy_", "contiguous", "split", "to"}
_ALLOWED_FUNCS = _SDPA | _LINEAR | {operator.getitem, torch.split, torch.functional.split, torch.cat}


class FuseMLA(RegionPass):
    kind = MLA
    name = "mla"

    def required_params(self, module):
        return [("kv_b_proj.weight", module.kv_b_proj.weight), ("o_proj.weight", module.o_proj.weight)]

    def plan(self, ctx: PassContext, region: Region) -> Rewrite:
        sdpa = [n for n in region.nodes if n.op == "call_function" and n.target in _SDPA]
        if not sdpa and any(n.op == "call_function" and n.target in PREFILL for n in region.nodes):
            raise Fused("absorbed latent attention over the engine's paged latent cache on a packed step "
                        "(hybrid::mla_prefill, called by the engine's attention function)")
        if len(sdpa) != 1:
            raise Skip("attention does not run through scaled_dot_product_attention "
                       "(attn_implementation must be 'sdpa'; eager/flex are left to Inductor)")
        sdpa = sdpa[0]
        region, undo = self._split_query(region, sdpa)
        try:
            return self._plan(ctx, region, sdpa)
        except BaseException:
            undo()
            raise

    def _plan(self, ctx: PassContext, region: Region, sdpa: fx.Node) -> Rewrite:
        m = region.module
        weight = ctx.param_node(m.kv_b_proj.weight)
        key = str(id(m.kv_b_proj))
        lins = [n for n in region.nodes if n.op == "call_function" and n.target in _LINEAR
                and key in node_module_keys(n)]
        if len(lins) != 1 or lins[0].args[1] is not weight or _arg(lins[0], 2, "bias") is not None:
            raise Skip("kv_b_proj is not a single bias-free linear over the cached latent")
        latent = lins[0].args[0]
        q_nope, q_rope = self._query_halves(sdpa)
        k_rope = self._rope_key(region, sdpa)
        mask = _arg(sdpa, 3, "attn_mask")
        if _arg(sdpa, 4, "dropout_p", 0.0) != 0.0 or sdpa.kwargs.get("enable_gqa", False):
            raise Skip("SDPA with dropout or GQA flags")
        is_causal = bool(_arg(sdpa, 5, "is_causal", False))
        scale = _arg(sdpa, 6, "scale")
        if isinstance(scale, fx.Node):  # dynamic shapes lift the module's float constant to an input
            hint = concrete(node_value(scale)) if isinstance(node_value(scale), (torch.SymFloat, float)) else None
            module_scale = getattr(m, "scaling", None)
            if hint is None or module_scale is None or abs(float(hint) - float(module_scale)) > 1e-12:
                raise Skip("SDPA scale is computed at run time")
            scale = float(module_scale)
        head_dim = node_value(q_nope).shape[-1] + node_value(q_rope).shape[-1]
        scale = float(scale) if scale is not None else float(concrete(head_dim)) ** -0.5
        args = [q_nope, q_rope, latent, k_rope, weight, mask]
        nodes = self._replaced_nodes(region, sdpa, [a for a in args if a is not None])
        self._probe(ctx, nodes, sdpa, args, is_causal, scale, m.kv_b_proj.weight)
        heads = concrete(node_value(q_nope).shape[1])
        note = (f"absorbed latent attention: {heads} heads, latent {m.kv_b_proj.weight.shape[1]} + rope "
                f"{concrete(node_value(q_rope).shape[-1])} per cached token")
        gather = _paged_gather(latent, k_rope)
        if gather is not None and concrete(node_value(q_nope).shape[2]) == 1:
            buf, _, table, lens, _, block_size = gather.args
            return Rewrite(torch.ops.hybrid.mla_attention_paged.default,
                           (q_nope, q_rope, buf, table, lens, weight, block_size, scale), {}, {sdpa: None},
                           note=note + "; decode reads the engine's paged latent cache in place", nodes=nodes,
                           unused=[latent, k_rope, gather])
        return Rewrite(torch.ops.hybrid.mla_attention.default, (*args, is_causal, scale), {}, {sdpa: None},
                       note=note, nodes=nodes)

    # -- structure ----------------------------------------------------------------------------------
    @staticmethod
    def _split_query(region: Region, sdpa: fx.Node):
        """A query that is not cat(q_nope, q_rope) but one projection of nope + rope channels per head (no rotary
        embedding: Kimi Linear's NoPE MLA) is put in that form: SDPA reads cat(q[..., :nope], q[..., nope:]), the
        same tensor, with the three nodes in the region. Returns the region and an undo for when the plan fails."""
        q, m = sdpa.args[0], region.module
        if isinstance(q, fx.Node) and q.target is torch.cat:
            return region, lambda: None
        nope, qv = getattr(m, "qk_nope_head_dim", None), node_value(q)
        if not (isinstance(q, fx.Node) and isinstance(nope, int) and isinstance(qv, torch.Tensor) and qv.dim() == 4
                and 0 < nope < concrete(qv.shape[-1])):
            raise Skip("the query is not cat(q_nope, q_rope) on the last dim")
        graph = sdpa.graph
        with graph.inserting_before(sdpa):
            halves = [graph.call_function(operator.getitem, (q, (Ellipsis, part)))
                      for part in (slice(None, nope), slice(nope, None))]
            cat = graph.call_function(torch.cat, (halves,), {"dim": -1})
        for n, v in zip([*halves, cat], [qv[..., :nope], qv[..., nope:], qv]):
            n.meta.update(val=v, nn_module_stack=dict(sdpa.meta.get("nn_module_stack") or {}))
        sdpa.replace_input_with(q, cat)
        at = region.nodes.index(sdpa)
        region = Region(region.kind, region.key, region.path, region.cls_name, m,
                        [*region.nodes[:at], *halves, cat, *region.nodes[at:]])

        def undo():
            sdpa.replace_input_with(cat, q)
            for n in (cat, *reversed(halves)):
                graph.erase_node(n)
        return region, undo

    @staticmethod
    def _query_halves(sdpa: fx.Node) -> tuple[fx.Node, fx.Node]:
        q = sdpa.args[0]
        if not (isinstance(q, fx.Node) and q.target is torch.cat and len(q.args[0]) == 2
                and _arg(q, 1, "dim", 0) in (-1, 3)):
            raise Skip("the query is not cat(q_nope, q_rope) on the last dim")
        return q.args[0][0], q.args[0][1]

    @staticmethod
    def _rope_key(region: Region, sdpa: fx.Node) -> fx.Node:
        """The cached rope key [B, 1, S, R]: copied (expanded over heads) into the key buffer."""
        buf = view_base(sdpa.args[1])
        if not (buf.op == "call_method" and buf.target == "new_empty"):
            raise Skip("the key is not assembled in a new buffer (HF's MLA key layout changed)")
        copies = [n for n in region.nodes if n.op == "call_method" and n.target == "copy_"
                  and view_base(n.args[0]) is buf]
        ropes = [c.args[1].args[0] for c in copies if isinstance(c.args[1], fx.Node)
                 and c.args[1].op == "call_method" and c.args[1].target == "expand"]
        if len(copies) != 2 or len(ropes) != 1:
            raise Skip("the key buffer is not filled by exactly a nope part and an expanded rope part")
        return ropes[0]

    @staticmethod
    def _replaced_nodes(region: Region, sdpa: fx.Node, stops: list[fx.Node]) -> list[fx.Node]:
        """Tensor nodes on the paths from the op arguments to SDPA, plus the writes into the key buffer."""
        stop = set(stops)
        keep: set[fx.Node] = set()
        todo = [sdpa]
        while todo:
            while todo:  # backward closure, stopping at the op arguments
                n = todo.pop()
                if n in keep or n in stop:
                    continue
                v = node_value(n)
                if isinstance(v, (torch.SymInt, torch.SymFloat, int, float)) or (
                        isinstance(v, torch.Tensor) and v.dim() == 0):
                    continue  # sizes and scalars stay in the graph (cheap; other nodes may use them)
                if n not in region:
                    raise Skip(f"the attention reads {n.name}, computed outside the module")
                keep.add(n)
                todo.extend(n.all_input_nodes)
            for n in list(keep):  # in-place writes into buffers created here (the key assembly)
                for u in n.users:
                    if u not in keep and u.op == "call_function" and u.target is operator.getitem:
                        writes = [w for w in u.users if is_inplace(w)]
                        if writes and len(writes) == len(u.users):
                            keep.add(u)
                            for w in writes:
                                keep.add(w)
                                todo.extend(a for a in w.all_input_nodes if a not in keep)
        for n in keep:
            if n.op == "call_method" and n.target not in _ALLOWED_METHODS:
                raise Skip(f"unexpected {n.target} in the attention (not a plain MLA)")
            if n.op == "call_function" and n.target not in _ALLOWED_FUNCS:
                raise Skip(f"unexpected {getattr(n.target, '__name__', n.target)} in the attention (not a plain MLA)")
            if n is not sdpa and any(u not in keep for u in n.users):
                raise Skip(f"{n.name} inside the attention is also used elsewhere")
        return [n for n in region.nodes if n in keep]

    @staticmethod
    def _probe(ctx, nodes, sdpa, args, is_causal, scale, weight) -> None:
        """Cut the replaced sub-graph out and run it and the op on the same random inputs."""
        inputs = [a for a in args if a is not None]
        try:
            sub = extract_subgraph(nodes, inputs, sdpa)
        except RewriteError as e:
            raise Skip(str(e)) from None
        g = torch.Generator(device="cpu").manual_seed(5)
        values = []
        for a in inputs:
            v = node_value(a)
            shape = [concrete(s) for s in v.shape]
            if a is args[4]:
                values.append(weight)
            elif v.dtype == torch.bool:
                values.append(_random_mask(shape, g).to(weight.device))
            else:
                values.append(torch.randn(shape, generator=g).to(weight.device, v.dtype))
        with eager_probe():
            expected = sub(*values)
            mask = values[5] if len(values) > 5 else None
            got = torch.ops.hybrid.mla_attention(*values[:5], mask, is_causal, scale)
        ok, msg = close(got, expected, weight.dtype, tol=1e-4 if weight.dtype == torch.float32 else 3e-2)
        if not ok:
            raise Skip(f"the attention sub-graph differs from hybrid::mla_attention on a probe: {msg}")


def _paged_gather(latent: fx.Node, k_rope: fx.Node) -> fx.Node | None:
    """The engine's ``hybrid::paged_gather`` when the latent and the rope key are its two outputs, used by
    nothing else (the op also carries the step's block table and lengths)."""
    srcs = []
    for node, idx in ((latent, 0), (k_rope, 1)):
        if not (node.op == "call_function" and node.target is operator.getitem and node.args[1] == idx
                and len(node.users) == 1):
            return None
        srcs.append(node.args[0])
    src = srcs[0]
    if src is not srcs[1] or src.op != "call_function" or src.target not in (
            torch.ops.hybrid.paged_gather, torch.ops.hybrid.paged_gather.default):
        return None
    return src if len(src.users) == 2 else None


def _random_mask(shape: list[int], g: torch.Generator) -> torch.Tensor:
    """A bool mask with every query row attending at least its last key (no empty rows)."""
    mask = torch.rand(shape, generator=g) > 0.3
    mask[..., -1] = True
    return mask


def _arg(node: fx.Node, pos: int, name: str, default=None):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)
