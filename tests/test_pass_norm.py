"""passes/norm.py: an RMSNorm (and the residual add before it) read by a hybrid linear becomes that linear's
prologue (hybrid::norm_linear), which also writes the norm's output when others read it (an MoE block); logits and
greedy tokens unchanged. Not fired: norms only a mixer reads, a norm whose math is not RMSNorm's (Gemma's 1 + w),
and with the switch off."""
from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from runtime import zoo
from hybrid_kernels.numerics import rel_err
from harness import compiled_with_spy


def _ops(gm: fx.GraphModule) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("hybrid."):
            name = str(n.target).split(".")[1]
            out[name] = out.get(name, 0) + 1
    return out


def _decode(model, options=None):
    """One decode-shaped call (one row) through the backend: (logits error vs eager, ops per graph, norm note)."""
    ids = torch.randint(3, model.config.vocab_size, (1, 1))
    with torch.no_grad():
        want = model(ids).logits
    with compiled_with_spy(model.forward, options or {}, _ops) as (fn, report, seen):
        got = fn(ids).logits
    notes = [n for g in report.graphs for n in g.notes if "RMSNorm" in n]
    return rel_err(got, want), seen, notes


def test_llama_every_norm_fused_with_its_residual_add():
    """Llama: per layer input_layernorm -> q/k/v and post_attention_layernorm -> gate + up (each after a residual
    add, except the first layer's), and the final norm -> lm_head: five norm_linear calls, no group / linear left
    for them, logits equal."""
    model = zoo.build("llama")
    err, seen, notes = _decode(model)
    assert err < 1e-5
    layers = model.config.num_hidden_layers
    ops = seen[0]
    assert ops.get("norm_linear") == 2 * layers + 1 and "linear_group" not in ops, ops
    assert ops.get("linear") == 2 * layers  # o_proj and down_proj read no norm
    assert notes == [f"{2 * layers + 1} RMSNorm (+ residual add) -> prologue of the linear that reads it "
                     "(hybrid::norm_linear)"]


def _moe_inputs(gm: fx.GraphModule) -> list[str]:
    """What produces each hybrid::moe_block's input: 'norm_linear[i]' for an output of a norm_linear call."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and "moe_block" in str(n.target):
            x = n.args[0]
            src = x.args[0] if x.op == "call_function" and x.target is operator.getitem else None
            out.append(f"norm_linear[{x.args[1]}]" if src is not None and "norm_linear" in str(src.target)
                       else str(x.target))
    return out


def test_moe_norm_fuses_and_is_written_for_the_block():
    """DeepSeek-V2: the post-attention norm feeds the shared experts' gate + up and the MoE block (router, experts):
    it fuses into that linear, whose op also writes the norm's output (after the two linear outputs and the sum),
    which the block reads; kv_a_layernorm feeds the MLA op: left to Inductor and said why. Mamba2: the block norm
    feeds the mixer op; only norm_f -> lm_head fuses (fp32 residual stream in bf16)."""
    model = zoo.build("deepseek_v2")
    err, seen, notes = _decode(model)
    layers = model.config.num_hidden_layers
    assert err < 1e-5 and seen[0].get("norm_linear") == 2 * layers + 1
    assert len(notes) == 1 and "where no hybrid linear reads it (model.layers.0.self_attn.kv_a_layernorm" \
        in notes[0] and "post_attention" not in notes[0]
    with compiled_with_spy(model.forward, {"glu": False}, _moe_inputs) as (fn, _, moe_inputs):  # (glu: one output)
        fn(torch.randint(3, model.config.vocab_size, (1, 1)))
    assert moe_inputs[0] == ["norm_linear[3]"] * layers, moe_inputs
    model = zoo.build("mamba2", dtype=torch.bfloat16)
    err, seen, notes = _decode(model)
    assert err < 2e-2 and seen[0].get("norm_linear") == 1
    assert "where no hybrid linear reads it (backbone.layers.0.norm, backbone.layers.1.norm)" in notes[0]


def test_not_rmsnorm_math_is_left_alone():
    """Gemma's RMSNorm (weight applied as 1 + w) holds what an RMSNorm holds: the probe rejects it, the logits stay
    right."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    model = zoo.build("llama")
    hidden = model.config.hidden_size
    model.model.norm = GemmaRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        model.model.norm.weight.normal_()
    err, seen, notes = _decode(model)
    assert err < 1e-5 and seen[0].get("norm_linear") == 2 * model.config.num_hidden_layers
    assert "where its math is not RMSNorm's" in notes[0] and "(model.norm)" in notes[0]


class _WriteBetween(torch.nn.Module):
    """The norm's input is written in place between the residual add and the norm: the norm must read the written
    values, so the pass must not move it up to the add."""

    def __init__(self):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        self.norm = LlamaRMSNorm(64, eps=1e-6)
        self.lin = torch.nn.Linear(64, 32, bias=False)
        with torch.no_grad():
            self.norm.weight.normal_()

    def forward(self, a, b):
        h = a + b
        h.add_(1.0)
        return self.lin(self.norm(h)), h


def test_write_in_place_between_keeps_the_norm():
    m = _WriteBetween().eval()
    a, b = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    with torch.no_grad():
        want = m(a, b)
    with compiled_with_spy(m, {}, _ops) as (fn, report, seen):
        got = fn(a, b)
    torch.testing.assert_close(got, want)
    notes = [n for g in report.graphs for n in g.notes if "RMSNorm" in n]
    assert "norm_linear" not in seen[0] and "something between its input and its readers may write in place" in notes[0]


class _ReadThroughCast(torch.nn.Module):
    """The linear reads the norm through a cast and something else reads the norm too: the op could hand the other
    reader only the cast's input dtype if it wrote it, so the pass leaves the norm (must not fire). A second norm read
    by the linear and another op directly fuses and hands that reader the op's copy."""

    def __init__(self):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        self.n1, self.n2 = LlamaRMSNorm(64, eps=1e-6), LlamaRMSNorm(64, eps=1e-6)
        self.l1, self.l2 = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 16, bias=False)
        with torch.no_grad():
            self.n1.weight.normal_()
            self.n2.weight.normal_()

    def forward(self, a):
        h1 = self.n1(a)
        h2 = self.n2(a * 2)
        return self.l1(h1.to(torch.float32)), h1 * 3, self.l2(h2), torch.tanh(h2)


def test_norm_read_through_a_cast_by_the_linear_and_by_others_stays():
    m = _ReadThroughCast().eval()
    a = torch.randn(1, 1, 64)
    with torch.no_grad():
        want = m(a)
    with compiled_with_spy(m, {}, _ops) as (fn, report, seen):
        got = fn(a)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    notes = [n for g in report.graphs for n in g.notes if "RMSNorm" in n]
    assert seen[0].get("norm_linear") == 1 and seen[0].get("linear") == 1, seen
    why = "where its output is read by more than the linear, through a cast (n1)"
    assert notes[0].startswith("1 RMSNorm") and why in notes[0], notes


def test_lm_head_sized_weight_keeps_the_norm_kernel():
    """A 128 MB lm_head (2^20 x 64 in bf16): the one-row prologue does not take it (a norm kernel, then the dot
    kernel, are faster there); the layers' norms still fuse."""
    model = zoo.build("llama", dtype=torch.bfloat16, vocab_size=1 << 20)
    err, seen, notes = _decode(model, {"inductor": False})
    assert err < 2e-2 and "the one-row prologue does not take its linear (1048576 x 64: an lm_head-sized weight" \
        in notes[0] and "(model.norm)" in notes[0]
    assert notes[0].startswith(f"{2 * model.config.num_hidden_layers} RMSNorm")


def test_greedy_generate_unchanged_bf16():
    """Greedy generate through the backend (the static two-row prefill keeps F.linear and Inductor's norm,
    passes/linear.py; decode rows take the prologue where the kernels run) equals eager, bf16 Llama and Mixtral."""
    for name in ("llama", "mixtral"):
        model = zoo.build(name, dtype=torch.bfloat16)
        ids = torch.randint(3, model.config.vocab_size, (2, 7))
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=5, do_sample=False)
            fwd = model.forward
            torch._dynamo.reset()
            model.forward = torch.compile(fwd, backend="hybrid")
            try:
                got = model.generate(ids, max_new_tokens=5, do_sample=False)
            finally:
                model.forward = fwd
                torch._dynamo.reset()
        assert torch.equal(got, want), name


def test_fires_in_the_engine_graphs():
    """The engine compiles with dynamic shapes, where dynamo lifts each norm's eps to a 0-d graph input: the decode
    graph's five norms still fuse; the prefill graph's final norm feeds a gather of the last tokens, not a linear."""
    from compiler.report import collect
    from runtime.engine import Engine, SamplingParams
    model = zoo.build("llama")
    with collect() as report:
        engine = Engine(model, compile="hybrid-eager")
        out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4))
    torch._dynamo.reset()
    notes = [n for g in report.graphs for n in g.notes if "RMSNorm" in n]
    assert [n.split(" RMSNorm")[0] for n in notes] == ["4", "5"], notes
    assert "1 where no hybrid linear reads it (model.norm)" in notes[0]
    assert out[0].token_ids == zoo.build("llama").generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=4,
                                                           do_sample=False)[0, 5:].tolist()


def test_switch_turns_it_off():
    model = zoo.build("llama")
    err, seen, notes = _decode(model, {"norm": False})
    assert err < 1e-5 and "norm_linear" not in seen[0] and not notes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU: the one-row prologue kernel runs there")
def test_gpu_decode_logits_with_the_prologue():
    """On the GPU the decode row takes the gemv kernel with the norm (and residual add) prologue: logits within bf16
    rounding of eager (measured on the H200: 0.36-0.60% with the pass, 0-0.42% without; the prologue keeps the
    normalised row in fp32 where HF rounds it to bf16 twice)."""
    errs = {}
    for name in ("llama", "mixtral", "deepseek_v2", "mamba2"):
        model = zoo.build(name, dtype=torch.bfloat16, device="cuda")
        torch.manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (1, 1), device="cuda")
        with torch.no_grad():
            want = model(ids).logits
        for on in (True, False):
            with compiled_with_spy(model.forward, {"norm": on, "inductor": False}, _ops) as (fn, report, seen):
                errs[name, on] = rel_err(fn(ids).logits, want)
    print("logits rel err vs eager (pass on / off):", errs)
    assert all(errs[n, True] < 1e-2 for n, _ in errs), errs
