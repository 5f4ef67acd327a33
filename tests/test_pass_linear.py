"""passes/linear.py: linear layers with parameter weights become hybrid::linear, siblings reading one input
hybrid::linear_group (one launch); logits unchanged; computed weights are left alone; the switch turns it off."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from runtime import zoo
from hybrid_kernels.numerics import rel_err
from harness import compiled_with_spy


def _ops(gm: fx.GraphModule) -> list[str]:
    names = {torch.ops.hybrid.linear.default: "linear", torch.ops.hybrid.linear_group.default: "group",
             torch._C._nn.linear: "F.linear", F.linear: "F.linear"}
    return [names[n.target] for n in gm.graph.nodes if n.op == "call_function" and n.target in names]


def _compiled(fn, options):
    return compiled_with_spy(fn, options, _ops)


def _notes(report) -> list[str]:
    return [n for g in report.graphs for n in g.notes if "linear layers" in n]


def test_deepseek_v2_linears_grouped_and_logits_unchanged():
    model = zoo.build("deepseek_v2")
    ids = torch.randint(3, model.config.vocab_size, (1, 1))  # one row: the decode shape
    with torch.no_grad():
        want = model(ids).logits
    with _compiled(model.forward, {"norm": False}) as (fn, report, seen):  # the norms' pass would take some linears
        assert rel_err(fn(ids).logits, want) < 1e-5
    ops = [o for g in seen for o in g]
    # per layer: q_proj + kv_a_proj_with_mqa share the input; the dense MLP's and the shared experts' gate + up too
    layers = model.config.num_hidden_layers
    assert ops.count("group") == 2 * layers and "F.linear" not in ops, ops
    assert ops.count("linear") == 2 * layers + 1  # o_proj and down_proj per layer, lm_head
    assert _notes(report) == [f"{6 * layers + 1} linear layers -> hybrid::linear ({4 * layers} of them in "
                              f"{2 * layers} shared-input launches): Triton kernels at one row, F.linear otherwise"]


class _Computed(torch.nn.Module):
    """q/k share an input with parameter weights; v's weight is computed in the graph; o has a bias."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(24, 16, bias=False)
        self.k = torch.nn.Linear(24, 8, bias=False)
        self.v = torch.nn.Parameter(torch.randn(8, 24))
        self.o = torch.nn.Linear(32, 24)

    def forward(self, x):
        v = F.linear(x, self.v * 2.0)  # a computed weight: not this pass's business
        return self.o(torch.cat([self.q(x), self.k(x), v], -1))


def test_computed_weights_stay_and_bias_runs_alone():
    m = _Computed().eval()
    x = torch.randn(1, 1, 24)
    with torch.no_grad():
        want = m(x)
    with _compiled(m, {}) as (fn, report, seen):
        torch.testing.assert_close(fn(x), want)
    assert sorted(o for g in seen for o in g) == ["F.linear", "group", "linear"]
    assert _notes(report) == ["3 linear layers -> hybrid::linear (2 of them in 1 shared-input launches): Triton "
                              "kernels at one row, F.linear otherwise"]


def test_fixed_rows_the_kernels_never_take_stay_f_linear():
    """Where the graph fixes the row count at one that the Triton kernels never take (DeepSeek-V2 decoding two
    sequences, three rows of small weights), every linear stays F.linear for Inductor and the report says why; the
    same rows marked dynamic keep the ops, which decide per call."""
    model = zoo.build("deepseek_v2")
    ids = torch.randint(3, model.config.vocab_size, (2, 1))
    with torch.no_grad():
        want = model(ids).logits
    with _compiled(model.forward, {}) as (fn, report, seen):
        assert rel_err(fn(ids).logits, want) < 1e-5
    ops = [o for g in seen for o in g]
    n = 6 * model.config.num_hidden_layers + 1
    assert ops == ["F.linear"] * n
    assert _notes(report) == [f"{n} linear layers left to Inductor: their row count is fixed in this graph and the "
                              "Triton kernels take no call at it (the op would run F.linear)"]
    m = _Computed().eval()
    x = torch.randn(1, 3, 24)
    torch._dynamo.mark_dynamic(x, 1)
    with torch.no_grad():
        want = m(x)
    with _compiled(m, {}) as (fn, report, seen):
        torch.testing.assert_close(fn(x), want)
    assert sorted(o for g in seen for o in g) == ["F.linear", "group", "linear"]


def test_switch_turns_it_off():
    m = _Computed().eval()
    with _compiled(m, {"linear": False}) as (fn, report, seen):
        fn(torch.randn(1, 3, 24))
    assert sorted(o for g in seen for o in g) == ["F.linear"] * 4 and not _notes(report)


class _WriteBetween(torch.nn.Module):
    """q and k read one input, which is written in place between them: they must not run as one launch."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(24, 16, bias=False)
        self.k = torch.nn.Linear(24, 8, bias=False)

    def forward(self, x):
        h = x + 1
        a = self.q(h)
        h.mul_(2)
        return torch.cat([a, self.k(h)], -1)


def test_siblings_with_a_write_between_are_not_grouped():
    m = _WriteBetween().eval()
    x = torch.randn(1, 1, 24)
    with torch.no_grad():
        want = m(x)
    with _compiled(m, {}) as (fn, report, seen):
        torch.testing.assert_close(fn(x), want)
    assert sorted(o for g in seen for o in g) == ["linear", "linear"]


def test_autocast_keeps_f_linear():
    m = _WriteBetween().eval()
    x = torch.randn(1, 3, 24)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = m(x)
        with _compiled(m, {}) as (fn, report, seen):
            got = fn(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert sorted(o for g in seen for o in g) == ["F.linear", "F.linear"]  # fp32 in, bf16 out: not this pass's


class _LowRank(torch.nn.Module):
    """Kimi Delta Attention's low-rank projections: q and the gate's first factor read one input (a group), the
    factor's output feeds a second linear (with a bias: it runs alone) and, as input, a second group."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(24, 16, bias=False)
        self.f_a = torch.nn.Linear(24, 8, bias=False)
        self.f_b = torch.nn.Linear(8, 16)
        self.u = torch.nn.Linear(8, 16, bias=False)
        self.w = torch.nn.Linear(8, 16, bias=False)

    def forward(self, x):
        a = self.f_a(x)
        return self.q(x) * self.f_b(a) + self.u(a) * self.w(a)


def test_a_grouped_linears_output_feeding_other_linears():
    """The linears that read a grouped linear's output take its new node: the erased one fails the graph's lint and
    drops the pass for the whole graph (Kimi Linear's low-rank gate projections have this shape)."""
    m = _LowRank().eval()
    x = torch.randn(1, 1, 24)
    with torch.no_grad():
        want = m(x)
    with _compiled(m, {}) as (fn, report, seen):
        torch.testing.assert_close(fn(x), want)
    assert sorted(o for g in seen for o in g) == ["group", "group", "linear"]
    assert _notes(report) == ["5 linear layers -> hybrid::linear (4 of them in 2 shared-input launches): Triton "
                              "kernels at one row, F.linear otherwise"]
