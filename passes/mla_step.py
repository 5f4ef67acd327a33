"""An engine MLA decode step's cache write and kv_a_layernorm -> the first launch of its paged attention
(``hybrid::mla_attention_paged`` -> ``hybrid::mla_decode_step``).

Runs after passes/mla.py, on the paged attentions it emitted. In the engine's decode graphs the cache layer writes the
step's rows with ``hybrid_kernels.mla.ops.write_rows`` (one ``hybrid::mla_cache_write``, the form declared there and matched
here) just before the attention reads the pages. Inductor runs kv_a_layernorm and that write as two kernels, each a
fixed cost of 2-3 us for a few KB at one sequence; ``hybrid::mla_decode_step`` normalises the latent, writes the row
and absorbs the query in one launch (hybrid_kernels/mla/triton_step.py), then attends.

What fires: a paged attention whose buffer is read by nothing but it and one ``hybrid::mla_cache_write`` before it,
whose written latent is, through views, the output of the attention module's ``kv_a_layernorm`` and nothing else
reads it; the norm holds one weight and an eps and computes RMSNorm (the shared probe), on one input of [B, 1, L]; the
write covers one token per sequence. Anything else stays as it is (correct: the write and the norm run as Inductor
compiles them) and the explain report's graph note says why.
"""
from __future__ import annotations

import torch
from torch import fx

from graphs.modules import MLA, classify, node_module_keys
from graphs.regions import Rewrite, RewriteError, apply_rewrite, concrete, node_value
from hybrid_kernels.library import twin
from hybrid_kernels.mla.ops import CACHE_WRITE

from .base import Pass, PassContext, PassResult, Skip
from .probes import rmsnorm_eps, rmsnorm_problem

#: views and casts between kv_a_layernorm's output and the latent rows the cache write reads
_ROW_VIEWS = {"view", "reshape", "transpose", "contiguous", "to", "float"}


class FuseMLADecodeStep(Pass):
    kind = MLA
    name = "mla_step"

    def apply(self, ctx: PassContext) -> PassResult:
        paged = torch.ops.hybrid.mla_attention_paged.default
        targets = {paged, twin(paged)}
        calls = [n for n in ctx.gm.graph.nodes if n.op == "call_function" and n.target in targets]
        fused, why = 0, {}
        for call in calls:
            try:
                rw, nodes = self._plan(ctx, call)
                apply_rewrite(ctx.gm, nodes, rw, meta_from=call)
                fused += 1
            except (Skip, RewriteError) as e:
                why[str(e)] = why.get(str(e), 0) + 1
        if not calls:
            return PassResult()
        left = "; ".join(f"{k} left to Inductor where {reason}" for reason, k in why.items())
        note = (f"{fused} MLA decode steps: the step's kv_a_layernorm, cache write and query absorption are one launch "
                f"(hybrid::mla_decode_step)" + (f"; the step's cache write of {left}" if left else ""))
        return PassResult(fused, notes=[note])

    def _plan(self, ctx: PassContext, call: fx.Node) -> tuple[Rewrite, list[fx.Node]]:
        q_nope, q_rope, buf, table, lens, weight, block_size, scale = call.args
        writes = [u for u in buf.users if u is not call]
        if len(writes) != 1 or writes[0].target not in CACHE_WRITE or writes[0].args[0] is not buf or writes[0].users:
            raise Skip("the pages are not written by one hybrid::mla_cache_write (hybrid_kernels.mla.ops.write_rows)")
        write = writes[0]
        _, lat_rows, rope_rows, slots = write.args
        module = next((m for m in map(ctx.index.module, reversed(node_module_keys(call))) if classify(m) == MLA), None)
        norm = getattr(module, "kv_a_layernorm", None)
        if norm is None:
            raise Skip("the attention module has no kv_a_layernorm")
        key = str(id(norm))
        norm_nodes = [n for n in ctx.gm.graph.nodes if n.op != "placeholder" and key in node_module_keys(n)]
        norm_set = set(norm_nodes)
        outs = [n for n in norm_nodes if any(u not in norm_set for u in n.users)]
        path = [lat_rows]  # the written latent back to the norm's output: views and casts, each read once
        while path[-1] not in norm_set and path[-1].op == "call_method" and path[-1].target in _ROW_VIEWS \
                and len(path[-1].users) == 1:
            path.append(path[-1].args[0])
        if len(outs) != 1 or path[-1] is not outs[0] or len(outs[0].users) != 1:
            raise Skip("the cached latent is not kv_a_layernorm's output, read only by the cache write")
        eps = rmsnorm_eps(norm)
        norm_weight = ctx.param_node(getattr(norm, "weight", None))
        acts = {a for n in norm_nodes for a in n.all_input_nodes if a not in norm_set and a is not norm_weight
                and isinstance(node_value(a), torch.Tensor) and node_value(a).dim() > 0}
        if eps is None or norm_weight is None or len(acts) != 1:
            raise Skip("kv_a_layernorm is not a module holding one weight and an eps, reading one input")
        kv = acts.pop()
        kv_v, buf_v = node_value(kv), node_value(buf)
        b, lat_dim = concrete(kv_v.shape[0]), concrete(kv_v.shape[-1])
        rope_dim = concrete(buf_v.shape[-1]) - lat_dim
        if kv_v.dim() != 3 or concrete(kv_v.shape[1]) != 1 or kv_v.dtype not in (buf_v.dtype, torch.float32) \
                or concrete(node_value(rope_rows).numel()) != b * rope_dim \
                or concrete(node_value(lat_rows).shape[0]) != b:
            raise Skip("the step's latent, rope key and cache rows do not have the shapes and dtypes of a one-token step")
        problem = rmsnorm_problem(norm, eps, kv_v.dtype)
        if problem:
            raise Skip(f"kv_a_layernorm: {problem}")
        sizes = [n for n in norm_nodes if isinstance(node_value(n), (torch.SymInt, torch.SymFloat, int, float))]
        order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
        nodes = sorted(set(norm_nodes) | set(path[:-1]) | {write, call}, key=order.__getitem__)
        op = torch.ops.hybrid.mla_decode_step.default
        if getattr(ctx.options, "run_time_configs", False):
            op = twin(op)
        args = (q_nope, q_rope, kv, norm_weight, rope_rows, buf, slots, table, lens, weight, eps, block_size, scale)
        return Rewrite(op, args, {}, {call: None}, mutates=[buf], unused=sizes), nodes
