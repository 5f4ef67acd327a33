"""passes/complex.py: DeepSeek-V2's complex RoPE becomes real arithmetic (no complex op reaches Inductor), logits
unchanged; a graph whose complex values reach an op the pass does not know keeps its complex ops, says which."""
from __future__ import annotations

import torch
from torch import fx

from runtime import zoo
from hybrid_kernels.numerics import rel_err
from harness import compiled_with_spy, prompt


def _complex_nodes(gm: fx.GraphModule) -> list[str]:
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if (isinstance(v, torch.Tensor) and v.is_complex()) or n.target in (torch.view_as_real, torch.polar):
            out.append(n.name)
    return out


def _compiled(fn, options):
    return compiled_with_spy(fn, options, _complex_nodes)


def test_deepseek_v2_rope_lowered_and_logits_unchanged():
    model = zoo.build("deepseek_v2")
    ids = prompt(model, 2, 9)
    with torch.no_grad():
        want = model(ids).logits
    with _compiled(model.forward, {}) as (fn, report, seen):
        got = fn(ids).logits
        assert rel_err(got, want) < 1e-5
        assert seen and all(not names for names in seen), seen  # no complex node reaches Inductor
        notes = [n for g in report.graphs for n in g.notes if "complex" in n]
        assert notes and all("lowered to real arithmetic" in n for n in notes), notes
        assert "lowered to real arithmetic" in report.table()


def rope_then_abs(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * torch.polar(torch.ones_like(t), t)
    return torch.view_as_real(z).flatten(-2) + z.abs().sum()  # abs(): not a form the pass knows


def rope_only(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * torch.polar(torch.ones_like(t), t)
    z = (z.unsqueeze(0) * 2.0 - z.unsqueeze(0)).squeeze(0)  # scalar and complex arithmetic, shape methods
    return torch.view_as_real(z).flatten(-2)


def test_unknown_complex_op_keeps_the_graph_complex():
    x, t = torch.randn(3, 5, 8), torch.randn(5, 4)
    with _compiled(rope_then_abs, {}) as (fn, report, seen):
        torch.testing.assert_close(fn(x, t), rope_then_abs(x, t))
        assert seen and all(names for names in seen)  # left as it was
        notes = [n for g in report.graphs for n in g.notes if "complex" in n]
        assert notes and all("complex ops kept" in n and "abs" in n for n in notes), notes
    with _compiled(rope_only, {}) as (fn, report, seen):
        torch.testing.assert_close(fn(x, t), rope_only(x, t), rtol=1e-6, atol=1e-6)
        assert seen and all(not names for names in seen), seen


def test_complex_pass_can_be_disabled():
    x, t = torch.randn(3, 5, 8), torch.randn(5, 4)
    with _compiled(rope_only, {"complex": False}) as (fn, report, seen):
        torch.testing.assert_close(fn(x, t), rope_only(x, t))
        assert seen and all(names for names in seen)


def mixed_real_complex(x: torch.Tensor, b: torch.Tensor) -> tuple:
    z = torch.view_as_complex(x.reshape(3, 4, 4, 2))  # b broadcasts z to [5, 3, 4, 4]
    return torch.view_as_real(z - b), torch.view_as_real(b - z), torch.view_as_real(z + b)


def complex_constant(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(torch.view_as_complex(x.reshape(3, 4, 4, 2)) * 1j)


def write_through_view(x: torch.Tensor) -> torch.Tensor:
    torch.view_as_real(torch.view_as_complex(x)).mul_(0)  # a view in eager: x becomes zeros
    return x + 1


def test_broadcasts_constants_and_views_stay_eager_exact():
    """Real operands that broadcast the result lower with both halves broadcast; a Python complex constant and
    an in-place write through view_as_real (a view, where the lowering's stack copies) keep the graph complex."""
    x, b = torch.randn(3, 4, 8), torch.randn(5, 3, 4, 4)
    with _compiled(mixed_real_complex, {}) as (fn, report, seen):
        for got, want in zip(fn(x, b), mixed_real_complex(x, b)):
            torch.testing.assert_close(got, want)
        assert seen and all(not names for names in seen), seen
    for f, arg, why in ((complex_constant, x, "complex constant"), (write_through_view, torch.randn(4, 2), "in-place")):
        with _compiled(f, {}) as (fn, report, seen):
            torch.testing.assert_close(fn(arg.clone()), f(arg.clone()))
            notes = [n for g in report.graphs for n in g.notes if "complex" in n]
            assert notes and all(why in n for n in notes), notes
