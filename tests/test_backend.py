"""The backend as users meet it: found by name without imports, options, pass switches, verify mode."""
import subprocess
import sys
import textwrap

import pytest
import torch

from compiler import Options, collect
from runtime import zoo
from compiler.verify import Verifier
from graphs.regions import Rewrite
from harness import capture_graphs, prompt
from passes.base import PassContext, RegionPass


def test_backend_found_by_name_without_importing_hybrid():
    code = textwrap.dedent("""
        import sys, torch, transformers
        cfg = transformers.AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=32, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_local_experts=3,
            num_experts_per_tok=2)
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        ids = torch.randint(0, 64, (1, 5))
        with torch.no_grad():
            ref = m(ids).logits
            out = torch.compile(m, backend="hybrid", options={"inductor": False})(ids).logits
        assert "compiler.backend" in sys.modules, "entry point did not load hybrid"
        print("maxdiff", (out - ref).abs().max().item())
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert float(res.stdout.split("maxdiff")[1]) < 1e-5


def test_unknown_option_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown hybrid option 'verfy'.*verify"):
        Options.parse({"verfy": True})
    with pytest.raises(ValueError, match="unknown hybrid pass 'mo'"):
        Options.parse({"disable": ["mo"]})
    opts = Options.parse({"moe": False, "verify": True, "disable": "ssm"})
    assert opts.passes == {"moe": False, "ssm": False} and opts.verify


@pytest.mark.parametrize("options, says", [({"verify": "yes"}, "'verify' is a switch"),
                                           ({"moe": "off"}, "'moe' is a switch"),
                                           ({"passes": {"ssm": "no"}}, "passes\\['ssm'\\]"),
                                           ({"passes": ["ssm"]}, "'passes' takes a dict"),
                                           ({"inductor_config": "max_autotune"}, "'inductor_config' takes a dict")])
def test_an_option_of_the_wrong_type_is_a_clear_error(options, says):
    """A string for a switch would read as True through bool(): "off" must not turn a pass on."""
    with pytest.raises(ValueError, match=says):
        Options.parse(options)
    assert Options.parse({"verify": 1, "moe": 0}).passes == {"moe": False}


def test_inductor_gets_the_gpu_defaults_and_user_config_wins(monkeypatch):
    """A graph on CUDA tensors compiles with combo kernels (and Inductor's PDL where ours is on: Hopper, HYBRID_PDL not 0); a CPU
    graph with neither; a key in options["inductor_config"] or TORCHINDUCTOR_ENABLE_PDL in the environment overrides
    the default. Checked on the patches compile_fx receives (fake CUDA inputs: no GPU here)."""
    import torch._inductor.compile_fx as cfx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compiler.backend import hybrid_backend
    seen = []
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, ex, config_patches=None: seen.append(config_patches) or gm)
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda_x = torch.empty(3, device="cuda")
    hybrid_backend(gm, [cuda_x])
    hybrid_backend(gm, [cuda_x], {"inductor_config": {"combo_kernels": False}})
    hybrid_backend(gm, [torch.ones(3)])
    assert seen[0]["combo_kernels"] is True and seen[1]["combo_kernels"] is False
    assert seen[2] is None
    monkeypatch.setattr("compiler.backend.pdl", lambda: True)  # as on a Hopper GPU
    hybrid_backend(gm, [cuda_x])
    assert seen[3]["triton.enable_pdl"] is True and "triton.enable_pdl" not in seen[0]
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "0")
    hybrid_backend(gm, [cuda_x])
    assert "triton.enable_pdl" not in seen[4]


def test_disabled_pass_reports_skipped():
    model = zoo.build("mixtral")
    ids = prompt(model, 1, 5)
    torch._dynamo.reset()
    with collect() as report, torch.no_grad():
        torch.compile(model.forward, backend="hybrid", options={"moe": False, "inductor": False})(ids)
    torch._dynamo.reset()
    regions = report.regions()
    assert regions and all(r["status"] == "skipped" and "disabled" in r["reason"] for r in regions)


@torch.library.custom_op("hybrid_test::wrong_moe", mutates_args=())
def wrong_moe(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0  # not what an MoE block computes


@wrong_moe.register_fake
def _(x):
    return torch.empty_like(x)


class WrongMoE(RegionPass):
    kind, name = "moe", "wrong_moe"

    def plan(self, ctx, region):
        x = next(n for n in region.inputs if n.op != "placeholder" or "layernorm" in n.name)
        (out,) = region.outputs
        return Rewrite(torch.ops.hybrid_test.wrong_moe.default, (x,), {}, {out: None})


def test_verify_rejects_a_wrong_rewrite_and_keeps_the_graph():
    model = zoo.build("mixtral")
    ids = prompt(model, 1, 6)
    (gm, ex), *_ = capture_graphs(model, ids)
    expected = gm(*ex)
    n_nodes = len(gm.graph.nodes)
    ctx = PassContext(gm, ex, Options(verify=True))
    ctx.verifier = Verifier(gm, ex, ctx.regions("moe"))
    assert WrongMoE().run(ctx).matches == 0
    assert len(ctx.results) == 2
    assert all(r.status == "skipped" and r.reason.startswith("verify:") for r in ctx.results)
    assert len(gm.graph.nodes) == n_nodes
    torch.testing.assert_close(gm(*ex)[-1], expected[-1])


def test_without_verify_the_same_wrong_rewrite_would_apply():
    """Control for the test above: the wrong rewrite is only caught because verify is on."""
    model = zoo.build("mixtral")
    (gm, ex), *_ = capture_graphs(model, prompt(model, 1, 6))
    ctx = PassContext(gm, ex, Options())
    assert WrongMoE().run(ctx).matches == 2


@pytest.mark.parametrize("name,twins", [("mixtral", {"moe_block_rt"}), ("deepseek_v2", {"moe_block_rt", "mla_attention_rt"})])
def test_run_time_configs_emit_opaque_twins(name, twins):
    """run_time_configs: MoE / MLA calls become their opaque run-time twins (no guard on the token count) and
    the results stay eager's, for several batch sizes through one compiled function."""
    from compiler.backend import hybrid_backend
    model = zoo.build(name)
    graphs = capture_graphs(model, prompt(model))
    found = set()
    for gm, example_inputs in graphs:
        hybrid_backend(gm, example_inputs, options={"inductor": False, "run_time_configs": True})
        found |= {str(n.target).split(".")[1] for n in gm.graph.nodes
                  if n.op == "call_function" and str(n.target).startswith("hybrid.")}
    assert twins <= found and not {t[:-3] for t in twins} & found, found
    torch._dynamo.reset()
    fn = torch.compile(model, backend="hybrid", dynamic=True, options={"run_time_configs": True})
    for batch in (2, 5):
        ids = prompt(model, batch=batch, tokens=7, seed=batch)
        with torch.no_grad():
            torch.testing.assert_close(fn(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("experts", ["default", "eager"])
def test_run_time_configs_compile_once_across_token_buckets(monkeypatch, experts):
    """The GPU's launch-config choices (here the Triton launchers run by the interpreter on the CPU) must not
    become guards: after the first batch size, batches in other MoE token buckets compile nothing. "eager":
    HF's experts loop, which hybrid swaps for its own experts implementation (an op called from model code)."""
    from torch._dynamo.utils import counters
    monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    model = zoo.build("mixtral")
    if experts == "eager":
        model.config._experts_implementation = "eager"
    torch._dynamo.reset()
    fn = torch.compile(model, backend="hybrid", dynamic=True, options={"inductor": False, "run_time_configs": True})
    with torch.no_grad():
        for _ in range(2):  # "eager": the first call switches the experts implementation and retraces
            fn(prompt(model, batch=2, tokens=3))
        counters.clear()
        for batch in (3, 6, 20):  # top-2 x 3 tokens: 18, 36, 120 (token buckets 64 and 256 on the GPU)
            ids = prompt(model, batch=batch, tokens=3, seed=batch)
            torch.testing.assert_close(fn(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
