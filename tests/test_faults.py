"""Fault containment in the backend: no exception of ours reaches the user as a compile failure. A pass that raises,
or leaves a graph that fails lint, is rolled back and dropped for that graph (explain says so, with the exception);
a failure outside the passes compiles the graph as traced; Inductor failing on the rewrite falls back to the graph as
traced. Results stay eager's in every case."""
from __future__ import annotations

import logging
import operator

import pytest
import torch

import passes
from compiler import collect
from harness import prompt
from hybrid_kernels.numerics import rel_err
from passes.moe import FuseMoE
from passes.norm import FuseNorm
from runtime import zoo


def _compiled_vs_eager(model, options=None):
    ids = prompt(model, 2, 7)
    torch._dynamo.reset()
    with torch.no_grad(), collect() as report:
        want = model(ids).logits
        got = torch.compile(model.forward, backend="hybrid", options={"inductor": False, **(options or {})})(ids).logits
    torch._dynamo.reset()
    return rel_err(got, want), report


def _notes(report) -> list[str]:
    return [n for g in report.graphs for n in g.notes]


def test_a_region_plan_that_raises_skips_that_region(monkeypatch, caplog):
    def boom(self, ctx, region):
        raise RuntimeError("boom in plan")
    monkeypatch.setattr(FuseMoE, "plan", boom)
    with caplog.at_level(logging.WARNING, logger="hybrid"):
        err, report = _compiled_vs_eager(zoo.build("mixtral"))
    assert err < 1e-5
    moe = [r for r in report.regions() if r["kind"] == "moe"]
    assert moe and all(r["status"] == "skipped" and "RuntimeError: boom in plan" in r["reason"] for r in moe), moe
    assert any("boom in plan" in rec.message for rec in caplog.records)


def test_a_pass_that_raises_midway_is_rolled_back(monkeypatch):
    """The MoE pass rewrites one block, then raises: the graph is restored (no half-rewritten graph compiles), every
    MoE region is reported skipped with the exception, and other passes still run."""
    real = FuseMoE.apply

    def apply(self, ctx):
        real(self, ctx)  # every block rewritten...
        raise ValueError("late failure")  # ...then a bug
    monkeypatch.setattr(FuseMoE, "apply", apply)
    err, report = _compiled_vs_eager(zoo.build("mixtral"))
    assert err < 1e-5
    moe = [r for r in report.regions() if r["kind"] == "moe"]
    assert moe and all(r["status"] == "skipped" and "pass 'moe' failed on this graph (ValueError: late failure)"
                       in r["reason"] for r in moe), moe
    assert any("linear layers" in n for n in _notes(report))  # later passes ran on the restored graph


def test_a_pass_that_breaks_the_graph_is_caught_by_lint(monkeypatch):
    """A whole-graph pass leaves a node that reads a value defined after it (lint fails): rolled back, the graph's
    note says so, results unchanged."""
    def apply(self, ctx):
        graph = ctx.gm.graph
        nodes = [n for n in graph.nodes if n.op == "call_function"]
        first, last = nodes[0], nodes[-1]
        with graph.inserting_before(first):
            graph.call_function(operator.add, (last, 1))  # uses a node defined later
        return passes.PassResult(1)
    monkeypatch.setattr(FuseNorm, "apply", apply)
    err, report = _compiled_vs_eager(zoo.build("llama"))
    assert err < 1e-5
    assert any(n.startswith("pass 'norm' failed on this graph") and "the graph compiles without it" in n
               for n in _notes(report)), _notes(report)


def test_a_failure_outside_the_passes_compiles_the_graph_as_traced(monkeypatch):
    import compiler.backend

    def prepare(ctx):
        raise KeyError("no such module")
    monkeypatch.setattr(compiler.backend, "prepare_graph", prepare)
    err, report = _compiled_vs_eager(zoo.build("deepseek_v2"))
    assert err < 1e-5
    assert not report.results
    assert any("hybrid's passes failed on this graph (KeyError: 'no such module'); it compiles as traced" in n
               for n in _notes(report)), _notes(report)


def test_a_graph_with_symbolic_sizes_rolled_back_still_compiles_with_inductor(monkeypatch):
    """The rolled-back graph keeps what dynamo put on its placeholders outside ``meta`` (their sources, which AOT
    autograd needs for symbolic sizes): the traced graph compiles with Inductor instead of running eagerly."""
    import compiler.backend

    def prepare(ctx):
        raise KeyError("no such module")
    monkeypatch.setattr(compiler.backend, "prepare_graph", prepare)
    model = zoo.build("llama")
    torch._dynamo.reset()
    with torch.no_grad(), collect() as report:
        compiled = torch.compile(model, backend="hybrid", dynamic=True)
        for n in (7, 5):
            ids = prompt(model, 1, n)
            assert rel_err(compiled(ids).logits, model(ids).logits) < 1e-5
    torch._dynamo.reset()
    assert report.graphs and all(g.compiler == "inductor" for g in report.graphs), _notes(report)
    assert not any("runs eagerly" in n for n in _notes(report)), _notes(report)


@pytest.mark.slow
def test_verify_mode_checks_graphs_with_symbolic_sizes():
    """``verify`` runs the graph on the call's concrete sizes where dynamo made them symbolic: the regions are checked
    and rewritten, nothing falls back, on prompt lengths the graph was not first compiled for."""
    model = zoo.build("deepseek_v3")
    torch._dynamo.reset()
    with torch.no_grad(), collect() as report:
        compiled = torch.compile(model, backend="hybrid", dynamic=True, options={"verify": True})
        for n in (7, 5):
            ids = prompt(model, 1, n)
            assert rel_err(compiled(ids).logits, model(ids).logits) < 1e-4
    torch._dynamo.reset()
    assert not any("failed" in n or "skipped" in n for n in _notes(report)), _notes(report)
    assert {r.kind for r in report.results if r.status == "rewritten"} >= {"mla", "moe"}, report.results


def test_inductor_failing_on_the_rewrite_falls_back_to_the_traced_graph(monkeypatch):
    """compile_fx raises on a graph that holds hybrid ops: the graph is restored and compiled as traced (here the
    stand-in compile runs it eagerly), the rewritten regions are reported skipped."""
    import torch._inductor.compile_fx as cfx
    seen = []

    def fake_compile_fx(gm, example_inputs, **kwargs):
        has_ours = any("hybrid" in str(n.target) for n in gm.graph.nodes)
        seen.append(has_ours)
        if has_ours:
            raise RuntimeError("inductor cannot lower this")
        return gm.forward
    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    model = zoo.build("mixtral")
    ids = prompt(model, 2, 7)
    torch._dynamo.reset()
    with torch.no_grad(), collect() as report:
        want = model(ids).logits
        got = torch.compile(model.forward, backend="hybrid")(ids).logits
    torch._dynamo.reset()
    assert rel_err(got, want) < 1e-5
    assert seen[:2] == [True, False], seen
    assert all(r["status"] == "skipped" for r in report.regions())
    assert any("Inductor failed on the rewritten graph (RuntimeError: inductor cannot lower this)" in n
               for n in _notes(report)), _notes(report)


@pytest.mark.parametrize("bad", ["moe", "ssm", "mla"])
def test_plan_failures_on_every_region_kind_leave_eager_results(bad, monkeypatch):
    """Every region pass contains its faults: hybrid models with each kind's plan raising still compile and match."""
    cls = {p.name: type(p) for p in passes.PIPELINE}[bad]
    monkeypatch.setattr(cls, "plan", lambda self, ctx, region: 1 / 0)
    name = {"moe": "jamba", "ssm": "bamba", "mla": "deepseek_v3"}[bad]
    err, report = _compiled_vs_eager(zoo.build(name))
    assert err < 1e-5
    hit = [r for r in report.regions() if r["kind"] == bad]
    assert hit and all("ZeroDivisionError" in r["reason"] for r in hit), hit


def test_compile_control_flow_exceptions_pass_through(monkeypatch):
    """torch.compile's own restarts (here Inductor asking dynamo to re-analyse) are not failures to contain: dynamo
    restarts, the backend compiles again, and no fallback is reported."""
    import torch._inductor.compile_fx as cfx
    calls = []

    def fake_compile_fx(gm, example_inputs, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()
        return gm.forward
    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    model = zoo.build("llama")
    ids = prompt(model, 1, 5)
    torch._dynamo.reset()
    with torch.no_grad(), collect() as report:
        got = torch.compile(model.forward, backend="hybrid")(ids).logits
        want = model(ids).logits
    torch._dynamo.reset()
    assert rel_err(got, want) < 1e-5 and len(calls) >= 2
    assert not any("failed" in n for n in _notes(report)), _notes(report)
