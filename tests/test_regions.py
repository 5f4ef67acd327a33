"""Region extraction and region surgery on real HF graphs (prefill and decode)."""
import pytest
import torch
from torch import fx

from runtime import zoo
from graphs.modules import ModuleIndex, param_placeholders
from graphs.regions import Rewrite, RewriteError, apply_rewrite, find_regions, node_value
from harness import capture_graphs, prompt


@torch.library.custom_op("hybrid_test::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def is_rms_norm(m):
    w = getattr(m, "weight", None)
    return "norm" if (hasattr(m, "variance_epsilon") and isinstance(w, torch.Tensor) and w.dim() == 1
                      and len(list(m.parameters())) == 1) else None


def graphs_of(name, generate_tokens=0, batch=2, tokens=7):
    model = zoo.build(name)
    return model, capture_graphs(model, prompt(model, batch, tokens), generate_tokens=generate_tokens)


def test_moe_region_boundary():
    model, graphs = graphs_of("mixtral")
    gm, ex = graphs[0]
    regions = [r for r in find_regions(gm, ModuleIndex(gm)) if r.kind == "moe"]
    assert [r.path for r in regions] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    params = {id(p) for p in model.parameters()}
    ph = param_placeholders(gm, ex)
    for r in regions:
        activations = [n for n in r.inputs if not any(ph.get(i) is n for i in params)]
        assert len(activations) == 1 and tuple(node_value(activations[0]).shape) == (2, 7, 64)
        assert len(r.outputs) == 1 and tuple(node_value(r.outputs[0]).shape) == (2, 7, 64)
        assert r.module is model.get_submodule(r.path)
        assert not r.mutated_inputs


def test_mamba_decode_region_writes_states_in_place():
    model, graphs = graphs_of("mamba", generate_tokens=2)
    decode = [(gm, ex) for gm, ex in graphs if any(
        n.op == "placeholder" and tuple(getattr(node_value(n), "shape", ())) == (2, 1) for n in gm.graph.nodes)]
    assert decode, "no decode graph captured"
    gm, _ = decode[0]
    regions = [r for r in find_regions(gm, ModuleIndex(gm)) if r.kind == "ssm"]
    assert len(regions) == 2
    for r in regions:
        counters = r.counter_writes()  # transformers >= 5.25 counts tokens in a 0-d tensor of the cache layer
        assert len(counters) <= 1 and all(node_value(n).dim() == 0 for n in counters)
        written = r.without(counters).mutated_inputs
        assert len(written) == 2 and all(n.op == "placeholder" for n in written)
        shapes = sorted(tuple(node_value(n).shape) for n in written)
        assert shapes == [(2, 64, 4), (2, 64, 8)]  # conv state [B, D, K], ssm state [B, D, N]


def test_mamba_prefill_region_creates_states():
    _, graphs = graphs_of("mamba", generate_tokens=1)
    gm, _ = graphs[0]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for r in [r for r in find_regions(gm, ModuleIndex(gm)) if r.kind == "ssm"]:
        r = r.without(r.counter_writes())  # the cache's token counter stays in the graph
        escaping = [o for o in r.outputs if out_node in o.users]
        assert len(escaping) == 2  # the conv and ssm state tensors the cache keeps


def _rewrite_norms(gm) -> int:
    index = ModuleIndex(gm)
    count = 0
    for r in find_regions(gm, index, classifier=is_rms_norm):
        weight = next(n for n in r.inputs if n.op == "placeholder" and node_value(n).dim() == 1)
        x = next(n for n in r.inputs if n is not weight)
        (out,) = r.outputs
        apply_rewrite(gm, r.nodes, Rewrite(torch.ops.hybrid_test.rms_norm.default,
                                           (x, weight, r.module.variance_epsilon), {}, {out: None}))
        count += 1
    return count


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_replace_regions_with_op_keeps_results_and_meta(name):
    model, graphs = graphs_of(name)
    gm, ex = graphs[0]
    expected = gm(*ex)
    n_before = len(gm.graph.nodes)
    count = _rewrite_norms(gm)
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.hybrid_test.rms_norm.default]
    assert count == len(calls) > 0 and len(gm.graph.nodes) < n_before
    for n in calls:
        assert isinstance(node_value(n), torch.Tensor) and n.meta["nn_module_stack"]
    got = gm(*ex)
    for a, b in zip(got, expected):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b)


def test_rewritten_graph_compiles_with_inductor():
    from torch._inductor.compile_fx import compile_fx
    model, graphs = graphs_of("llama", batch=1, tokens=5)
    gm, ex = graphs[0]
    expected = gm(*ex)
    _rewrite_norms(gm)
    gm.recompile()
    with torch.no_grad():
        got = compile_fx(gm, ex)(*ex)
    torch.testing.assert_close(got[-1], expected[-1])


def test_unmapped_region_output_is_refused():
    model, graphs = graphs_of("llama", batch=1, tokens=5)
    gm, _ = graphs[0]
    r = find_regions(gm, ModuleIndex(gm), classifier=is_rms_norm)[0]
    weight = next(n for n in r.inputs if n.op == "placeholder")
    with pytest.raises(RewriteError, match="has no replacement"):
        apply_rewrite(gm, r.nodes, Rewrite(torch.ops.hybrid_test.rms_norm.default, (weight, weight, 1e-6), {}, {}))



def test_view_base_stops_at_gathers():
    """Writes into ``x[tensor]`` (a gather, as HF's grouped experts do before masked_fill_) stay local; writes
    through basic indexing and views reach the base tensor."""
    import operator

    from graphs.regions import view_base

    g = fx.Graph()
    x, idx = g.placeholder("x"), g.placeholder("idx")
    x.meta["val"], idx.meta["val"] = torch.empty(4, 3), torch.tensor([0, 2])
    gathered = g.call_function(operator.getitem, (x, idx))
    sliced = g.call_function(operator.getitem, (x, (slice(1, None), None)))
    sliced.meta["val"] = torch.empty(3, 1, 3)
    view = g.call_method("view", (sliced, -1))
    assert view_base(gathered) is gathered
    assert view_base(g.call_function(operator.getitem, (x, [0, 2]))) is not x
    assert view_base(view) is x
