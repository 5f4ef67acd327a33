"""passes/glu.py: a gated MLP's silu(gate) * up becomes the epilogue of its gate + up launch
(hybrid::norm_linear with glu=True): Llama's MLPs, DeepSeek's dense MLP and shared experts; logits unchanged. Not fired:
a GELU MLP, gate and up in a plain linear group (the norm pass off; the explain note says why), the switch off."""
from __future__ import annotations

import pytest
import torch
from torch import fx

from runtime import zoo
from hybrid_kernels.numerics import rel_err
from harness import compiled_with_spy


def _glu_calls(gm: fx.GraphModule) -> dict[str, int]:
    out = {"glu": 0, "plain": 0}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.hybrid.norm_linear.default:
            glu = n.args[8] if len(n.args) > 8 else n.kwargs.get("glu", False)
            out["glu" if glu else "plain"] += 1
    return out


def _decode(model, options=None, rows=1):
    """One decode-shaped call through the backend: (logits error vs eager, norm_linear calls by kind, GLU notes)."""
    ids = torch.randint(3, model.config.vocab_size, (rows, 1))
    if rows > 1:  # one graph for every batch size, as the engine's (at a fixed count above one the linears stay
        torch._dynamo.maybe_mark_dynamic(ids, 0)  # F.linear for Inductor: test_pass_linear.py)
    with torch.no_grad():
        want = model(ids).logits
    with compiled_with_spy(model.forward, options or {}, _glu_calls) as (fn, report, seen):
        got = fn(ids).logits
    notes = [n for g in report.graphs for n in g.notes if "SiLU-gated" in n]
    return rel_err(got, want), seen[0], notes


@pytest.mark.parametrize("name,fused", [("llama", 2), ("deepseek_v2", 2), ("deepseek_v3", 3)])
@pytest.mark.parametrize("rows", [1, 3])
def test_gated_mlps_fuse_their_activation(name, fused, rows):
    """Every gated MLP (Llama's two, DeepSeek-V2's shared experts, DeepSeek-V3's dense MLP and shared experts) leaves
    its activation to the gate + up launch; logits equal eager at one row and at three. On the CPU the op runs its
    eager fallback (the gemv epilogue itself: tests/ops/test_linear.py, GPU logits: tests/test_engine.py's GPU
    tests through the engine)."""
    err, calls, notes = _decode(zoo.build(name), rows=rows)
    assert err < 1e-5, err
    assert calls["glu"] == fused, calls
    assert notes == [f"{fused} SiLU-gated MLP activations -> the epilogue of their gate + up launch "
                     "(hybrid::norm_linear glu)"]


def test_bf16_one_row():
    """bf16 weights, one row: the rewritten graph (the op's fallback on the CPU) rounds as the eager ops do."""
    err, calls, _ = _decode(zoo.build("deepseek_v3", dtype=torch.bfloat16))
    assert calls["glu"] == 3 and err < 2e-2, (calls, err)


def test_not_fired_on_gelu_plain_groups_or_when_off():
    """A GELU MLP has no silu-gated product; with the norm pass off, gate and up are a plain linear group (said why);
    the switch turns the pass off."""
    model = zoo.build("llama")
    model.config.hidden_act = "gelu"
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    err, calls, notes = _decode(model)
    assert err < 1e-5 and calls["glu"] == 0 and notes == []
    err, calls, notes = _decode(zoo.build("llama"), {"norm": False})
    assert err < 1e-5 and calls["glu"] == 0
    assert notes == ["0 SiLU-gated MLP activations -> the epilogue of their gate + up launch (hybrid::norm_linear "
                     "glu); 2 left to Inductor where gate and up are a plain linear group (the norm before them is not "
                     "fused)"], notes
    err, calls, notes = _decode(zoo.build("llama"), {"glu": False})
    assert err < 1e-5 and calls == {"glu": 0, "plain": 5} and notes == []
