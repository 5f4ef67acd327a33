"""SSM pass: a whole Mamba1 mixer (A_log [D, N]) or Mamba2/SSD mixer (A_log [H], dt_bias, gated norm) ->
one ``hybrid::mamba(2)_mixer`` call (prefill) or ``hybrid::mamba(2)_mixer_step`` call (decode).

Drop-in mode keeps HF's cache semantics. The three graph shapes HF produces are recognised from the
region's boundary, not from HF's code:
  - no cache: hidden in, output out;
  - prefill into a fresh cache: two fresh state tensors leave the region (conv state [B, C, K], ssm state);
  - decode (T=1): the cache's conv and ssm states come in and are written in place;
  - a prefill chunk that continues a cached one (T > 1, states in and written in place): Mamba2 only, where
    HF's mixer continues from both states (``hybrid::mamba2_mixer_chunk``). HF's Mamba1 scan starts such a chunk
    from a zero ssm state: left as HF computes it.
Anything else is left to Inductor with the reason.
The mixer's math (projection split order, activation, D skip, gating, dt/B/C norms, gated RMSNorm) is not
assumed: the live mixer is run on a probe batch and compared with the op before anything is rewritten.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from graphs.modules import SSM, mamba2_dims
from graphs.regions import Region, Rewrite, is_inplace, node_value
from hybrid_kernels.numerics import close
from hybrid_kernels.ssm.spec import Mamba1Spec, Mamba1Weights, Mamba2Spec, Mamba2Weights

from .base import Fused, PassContext, RegionPass, Skip, eager_probe


def _reads(state: fx.Node) -> bool:
    """Does the region compute with ``state`` (not only write into it in place)?"""
    return any(not (is_inplace(u) and u.args and u.args[0] is state) for u in state.users)


def _shape(n: fx.Node) -> tuple:
    v = node_value(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


class FuseSSM(RegionPass):
    kind = SSM
    name = "ssm"

    def required_params(self, module):
        return [("in_proj.weight", module.in_proj.weight), ("out_proj.weight", module.out_proj.weight)]

    def plan(self, ctx: PassContext, region: Region) -> Rewrite:
        if any(n.op == "call_function" and n.target is torch.ops.hybrid.mamba2_mixer_packed.default
               for n in region.nodes):
            raise Fused("the engine's packed step over its state rows (hybrid::mamba2_mixer_packed, called by the "
                        "mixer's engine forward, runtime/engine/packed_states.py)")
        # the cache's token counter (bumped in place by HF's cache layer inside the mixer) stays in the graph
        sub = region.without(region.counter_writes())
        rw = self._plan(ctx, sub)
        rw.nodes = rw.nodes or sub.nodes
        return rw

    def _plan(self, ctx: PassContext, region: Region) -> Rewrite:
        m = region.module
        if getattr(m, "activation", "silu") != "silu":
            raise Skip(f"conv activation {m.activation!r} is not silu")
        mamba2 = mamba2_dims(m)
        params = ctx.weight_nodes
        # scalars dynamo lifted to inputs under dynamic shapes (e.g. the norm's eps) are module constants
        # the op takes from the module itself
        acts = [n for n in region.inputs if n not in params and isinstance(node_value(n), torch.Tensor)
                and node_value(n).dim() > 0]
        hidden = [n for n in acts if node_value(n).dim() == 3 and _shape(n)[-1] == m.in_proj.in_features
                  and n not in region.mutated_inputs]
        masks = [n for n in acts if node_value(n).dim() == 2 and n not in hidden]
        written = region.mutated_inputs
        if len(hidden) != 1 or len(acts) != 1 + len(masks) + len(written) or len(masks) > 1:
            raise Skip(f"unexpected mixer inputs {[(n.name, tuple(node_value(n).shape)) for n in acts]} (hidden {len(hidden)}, masks {len(masks)}, written {len(written)})")
        hidden, mask = hidden[0], (masks[0] if masks else None)
        tensor_outputs = [o for o in region.outputs if isinstance(node_value(o), torch.Tensor)]
        # statically known: a plain == on symbolic sizes would add a guard (T != 64 for a state of width 64)
        main = [o for o in tensor_outputs if len(_shape(o)) == len(_shape(hidden))
                and statically_known_true(sym_eq(_shape(o), _shape(hidden)))]
        if len(main) != 1:
            raise Skip("cannot tell the mixer output among the region outputs")
        main = main[0]
        fresh = [o for o in tensor_outputs if o is not main]
        spec, live = mixer_spec(m, mamba2)
        self._check_probe(m, spec, live, masked=mask is not None)
        weights = self._nodes(ctx, live)
        kernel = m.conv1d.weight.shape[-1]

        if written:  # decode, or a chunk continuing a cached prefill: states come in and are written in place
            if len(written) != 2 or fresh:
                raise Skip(f"{len(written)} cache states written and {len(fresh)} created: expected the conv and "
                           "ssm states, written in place")
            conv, ssm = self._split_states(written, kernel, mamba2)
            if _shape(hidden)[1] == 1:
                op = torch.ops.hybrid.mamba2_mixer_step.default if mamba2 else torch.ops.hybrid.mamba_mixer_step.default
                args = spec.step_args(hidden, mask, weights, conv, ssm)
                return Rewrite(op, args, {}, {main: None}, mutates=[conv, ssm], note=self._note(m, mamba2, "decode"))
            if not _reads(ssm):
                raise Skip("a prefill chunk after a cached one, where HF's mixer does not read the cached ssm state "
                           "(HF's Mamba1 scan starts every multi-token call from zero): left as HF computes it")
            if not mamba2:
                raise Skip("a Mamba1 prefill chunk continuing from cached states has no hybrid op")
            if node_value(ssm).dtype != torch.float32:
                raise Skip(f"HF keeps the ssm state in {node_value(ssm).dtype}; hybrid continues from fp32")
            args = spec.chunk_args(hidden, mask, weights, conv, ssm)
            return Rewrite(torch.ops.hybrid.mamba2_mixer_chunk.default, args, {}, {main: None}, mutates=[conv, ssm],
                           note=self._note(m, mamba2, "prefill continuing from the cache"))

        outputs = {main: 0}
        width = kernel
        if fresh:  # prefill into a fresh cache: the region creates the states HF keeps
            if len(fresh) != 2:
                raise Skip(f"{len(fresh)} extra outputs leave the mixer; expected the conv and ssm states")
            conv, ssm = self._split_states(fresh, kernel, mamba2)
            width = _shape(conv)[-1]
            if node_value(ssm).dtype != torch.float32:
                raise Skip(f"HF keeps the ssm state in {node_value(ssm).dtype}; hybrid produces fp32")
            outputs.update({conv: 1, ssm: 2})
        op = torch.ops.hybrid.mamba2_mixer.default if mamba2 else torch.ops.hybrid.mamba_mixer.default
        return Rewrite(op, spec.prefill_args(hidden, mask, weights, width), {}, outputs,
                       note=self._note(m, mamba2, "prefill"))

    # -- pieces -------------------------------------------------------------------------------------
    @staticmethod
    def _note(m, mamba2, phase):
        if mamba2:
            return f"mamba2/SSD mixer ({phase}): {mamba2['heads']} heads x {mamba2['head_dim']}, state {mamba2['state']}"
        norms = " + dt/B/C norms" if getattr(m, "dt_layernorm", None) is not None else ""
        return f"mamba1 mixer ({phase}): d_inner {m.A_log.shape[0]}, state {m.A_log.shape[1]}{norms}"

    @staticmethod
    def _split_states(nodes: list[fx.Node], kernel: int, mamba2) -> tuple[fx.Node, fx.Node]:
        """(conv state, ssm state): the conv state is [B, C, W>=K-1] and is read by a cat/conv; the ssm
        state is [B, D, N] (Mamba1) or [B, H, P, N] (Mamba2)."""
        if mamba2:
            conv = [n for n in nodes if node_value(n).dim() == 3]
            ssm = [n for n in nodes if node_value(n).dim() == 4]
        else:
            conv = [n for n in nodes if _shape(n)[-1] in (kernel, kernel - 1)]
            ssm = [n for n in nodes if n not in conv]
            if len(conv) != 1:
                conv = [n for n in nodes if any(u.target is torch.cat for u in n.users)]
                ssm = [n for n in nodes if n not in conv]
        if len(conv) != 1 or len(ssm) != 1:
            raise Skip("cannot tell the conv state from the ssm state")
        return conv[0], ssm[0]

    @staticmethod
    def _nodes(ctx: PassContext, weights):
        """The live weights' graph nodes, in the same named tuple (None stays None)."""
        def node(name, t):
            if t is None:
                return None
            n = ctx.param_node(t)
            if n is None:
                raise Skip(f"{name} is not an input of this graph")
            return n
        return type(weights)(*(node(name, t) for name, t in zip(weights._fields, weights)))

    @staticmethod
    def _check_probe(m, spec, weights, masked: bool = False) -> None:
        """The live mixer (no cache) on a probe batch must equal the op: proves the math, not the cache. ``masked``
        (the graph hands the mixer HF's 2-D padding mask): the same with a left-padded row, compared at its tokens."""
        w = m.in_proj.weight
        g = torch.Generator(device="cpu").manual_seed(77)
        x = torch.randn(2, 7, w.shape[1], generator=g).to(w.device, w.dtype)
        mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7], device=w.device) if masked else None
        op = torch.ops.hybrid.mamba2_mixer if isinstance(spec, Mamba2Spec) else torch.ops.hybrid.mamba_mixer
        with eager_probe():
            try:
                expected = m(x, attention_mask=mask) if masked else m(x)
            except TypeError as e:
                raise Skip(f"the mixer takes no attention_mask keyword to probe the padded case with ({e})") from e
            expected = expected[0] if isinstance(expected, tuple) else expected
            got = op(*spec.prefill_args(x, mask, weights, m.conv1d.weight.shape[-1]))[0]
        if masked:
            keep = mask.bool()
            got, expected = got[keep], expected[keep]
        ok, msg = close(got, expected, w.dtype, tol=1e-4 if w.dtype == torch.float32 else 3e-2)
        if not ok:
            raise Skip(f"mixer math differs from hybrid's {'mamba2' if isinstance(spec, Mamba2Spec) else 'mamba'} "
                       f"mixer{' under a padding mask' if masked else ''}: {msg}")


def _eps(norm) -> float:
    """An RMS norm's epsilon under either of HF's attribute names (1e-6 where the mixer has no such norm)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def mixer_spec(m, mamba2: dict | None):
    """(spec, live weights) of a Mamba1 mixer (``mamba2`` None) or a Mamba2 mixer of sizes ``mamba2``."""
    if mamba2:
        lo, hi = (float(v) for v in getattr(m, "time_step_limit", (0.0, float("inf"))))
        norm = m.norm
        spec = Mamba2Spec(mamba2["head_dim"], mamba2["groups"], int(m.chunk_size),
                          _eps(norm),
                          int(getattr(norm, "group_size", mamba2["d_inner"])), lo, hi,
                          float(getattr(m, "ssm_in_multiplier", 1.0)))
        return spec, Mamba2Weights(m.in_proj.weight, m.in_proj.bias, m.conv1d.weight, m.conv1d.bias, m.dt_bias,
                                   m.A_log, m.D, getattr(norm, "weight", None), m.out_proj.weight, m.out_proj.bias,
                                   getattr(m, "mup_vector", None))
    norms = [getattr(m, f"{k}_layernorm", None) for k in ("dt", "b", "c")]
    widths = (m.dt_proj.weight.shape[1], m.A_log.shape[1], m.A_log.shape[1])
    spec = Mamba1Spec(_eps(norms[0]), bcdt_norm=norms[0] is not None)
    return spec, Mamba1Weights(m.in_proj.weight, m.in_proj.bias, m.conv1d.weight, m.conv1d.bias, m.x_proj.weight,
                               m.dt_proj.weight, m.dt_proj.bias, m.A_log, m.D, m.out_proj.weight, m.out_proj.bias,
                               *[_norm_weight(n, w) for n, w in zip(norms, widths)])


def _norm_weight(norm, width: int):
    """The scale a dt/B/C norm applies, or None for a weightless norm: one whose weight is no parameter of
    width ``width`` (a placeholder buffer, possibly of another size). The probe proves the choice."""
    w = getattr(norm, "weight", None)
    return w if isinstance(w, torch.nn.Parameter) and tuple(w.shape) == (width,) else None
