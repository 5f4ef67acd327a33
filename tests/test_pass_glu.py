"""passes/glu.py: a gated MLP's silu(gate) * up becomes the prologue of its down projection (hybrid::glu_linear);
logits unchanged; not for another activation, an activation read elsewhere, or a weight the one-row kernel does
not take; the switch turns it off."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from compiler import zoo
from compiler.numerics import rel_err
from harness import compiled_with_spy


def _ops(gm: fx.GraphModule) -> list[str]:
    names = {torch.ops.hybrid.glu_linear.default: "glu", torch.ops.hybrid.linear.default: "linear", F.silu: "silu"}
    return [names[n.target] for n in gm.graph.nodes if n.op == "call_function" and n.target in names]


def _notes(report) -> list[str]:
    return [n for g in report.graphs for n in g.notes if "SiLU" in n]


def _run(fn, args, options=None):
    with torch.no_grad():
        want = fn(*args)
    with compiled_with_spy(fn, options or {}, _ops) as (compiled, report, seen):
        got = compiled(*args)
    return got, want, [o for g in seen for o in g], _notes(report)


def test_deepseek_v2_shared_experts_fused_and_logits_unchanged():
    model = zoo.build("deepseek_v2")  # every layer: MoE with one shared expert (a gated MLP)
    ids = torch.randint(3, model.config.vocab_size, (1, 1))
    got, want, ops, notes = _run(lambda t: model(t).logits, (ids,))
    layers = model.config.num_hidden_layers
    assert rel_err(got, want) < 1e-5
    assert ops.count("glu") == layers and "silu" not in ops, ops
    assert notes == [f"{layers} SiLU-gated MLP activations -> the down projection's prologue (hybrid::glu_linear)"]


def test_deepseek_v3_dense_and_shared_mlps_fused():
    model = zoo.build("deepseek_v3")  # a dense first layer, then MoE layers with a shared expert
    ids = torch.randint(3, model.config.vocab_size, (1, 1))
    got, want, ops, notes = _run(lambda t: model(t).logits, (ids,))
    assert rel_err(got, want) < 1e-5 and ops.count("glu") == model.config.num_hidden_layers, ops


def test_gelu_mlp_is_not_touched():
    model = zoo.build("deepseek_v2", hidden_act="gelu")
    ids = torch.randint(3, model.config.vocab_size, (1, 1))
    got, want, ops, notes = _run(lambda t: model(t).logits, (ids,))
    assert rel_err(got, want) < 1e-5 and "glu" not in ops and not notes


class _MLP(torch.nn.Module):
    def __init__(self, K: int, keep_activation: bool = False):
        super().__init__()
        self.gate = torch.nn.Linear(16, K, bias=False)
        self.up = torch.nn.Linear(16, K, bias=False)
        self.down = torch.nn.Linear(K, 8)
        self.keep = keep_activation

    def forward(self, x):
        a = F.silu(self.gate(x))
        y = self.down(self.up(x) * a)  # the product the other way round
        return (y, a) if self.keep else y


def test_product_either_way_round_with_bias():
    m = _MLP(40).eval()
    got, want, ops, notes = _run(m, (torch.randn(1, 16),))
    torch.testing.assert_close(got, want)
    assert ops == ["glu"] and notes == ["1 SiLU-gated MLP activations -> the down projection's prologue "
                                        "(hybrid::glu_linear)"]


def test_activation_read_elsewhere_or_too_wide_stays():
    x = torch.randn(1, 16)
    got, want, ops, notes = _run(_MLP(40, keep_activation=True).eval(), (x,))
    torch.testing.assert_close(got, want)
    assert "glu" not in ops and notes == ["0 SiLU-gated MLP activations -> the down projection's prologue "
                                          "(hybrid::glu_linear); 1 left where the activation or the product has "
                                          "other readers"]
    got, want, ops, notes = _run(_MLP(8200).eval(), (x,))
    torch.testing.assert_close(got, want)
    assert "glu" not in ops and notes[0].endswith("1 left where the one-row kernel does not take a 8 x 8200 weight")


def test_switch_turns_it_off():
    got, want, ops, notes = _run(_MLP(40).eval(), (torch.randn(1, 16),), {"glu": False})
    torch.testing.assert_close(got, want)
    assert "glu" not in ops and ops.count("silu") == 1 and not notes
