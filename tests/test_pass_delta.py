"""Delta-rule mixers (Qwen3-Next's Gated DeltaNet, Kimi Linear's KDA) on real HF model classes: compiled with the
hybrid backend they match eager (logits and greedy tokens), the mixers' graphs hold ``hybrid::delta_rule`` after
the one retrace, and prompts of new lengths compile no new graph. Negative cases: a Mamba2 mixer is never a delta
mixer; a function with the delta-rule interface that computes something else is refused with the reason."""
import sys
import types

import pytest
import torch

from graphs.modules import DELTA, SSM, classify
from harness import assert_matches, run_both
from passes import prepare
from runtime import zoo


def _delta_status(report) -> set[str]:
    return {status for r in report.regions() if r["kind"] == DELTA for status in r["graphs"].values()}


@pytest.mark.parametrize("name", ["qwen3_next", "kimi_linear"])
def test_delta_mixers_rewritten_and_equal_eager(name):
    run = run_both(name, new_tokens=3, tokens=9)
    assert_matches(run)
    assert "rewritten" in _delta_status(run.report), run.report.regions()
    # the graph traced before the one retrace ran once: the report shows the graphs that last
    assert {r["status"] for r in run.report.regions() if r["kind"] == DELTA} == {"rewritten"}


def test_mamba2_mixer_is_not_a_delta_mixer():
    model = zoo.build("mamba2")
    assert classify(model.backbone.layers[0].mixer) == SSM


def test_function_that_differs_is_refused(monkeypatch):
    """A mixer module whose delta-rule-shaped function computes something else keeps it, with the reason."""
    model = zoo.build("qwen3_next")
    mixer = model.model.layers[0].linear_attn
    mod = types.ModuleType("fake_delta_module")

    def chunk_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, **kwargs):
        return value * 2, initial_state
    mod.chunk_rule = chunk_rule
    cls = type("FakeDeltaNet", (type(mixer),), {"__module__": mod.__name__})
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    mixer.__class__ = cls
    with torch.no_grad():
        assert not prepare.install_delta(mixer)
    assert mod.chunk_rule is chunk_rule
    assert "differs" in prepare.DELTA_REFUSED.pop(cls)


@pytest.mark.parametrize("packed", [False, None], ids=["padded", "packed"])
@pytest.mark.parametrize("name", ["qwen3_next", "kimi_linear"])
def test_engine_greedy_equals_hf(name, packed, monkeypatch):
    """The engine (compiled, hybrid::delta_rule in its padded prefill graphs, the in-place hybrid::delta_rule_step in
    its decode graphs, state rows beside the paged caches) gives HF's greedy tokens for two prompts of different
    lengths decoded together; with packed steps too (their mixers run HF's forward per run of chunks, with hybrid's
    delta-rule functions, so only the decode graphs hold the pass's rewrite)."""
    from passes import delta
    from runtime.engine import Engine
    steps = []
    real = delta._in_place_step
    monkeypatch.setattr(delta, "_in_place_step", lambda g, c: steps.append(real(g, c)) or steps[-1])
    from runtime.engine.sequence import SamplingParams
    model = zoo.build(name)
    model.generation_config.eos_token_id = None  # the engine below ignores EOS: so must HF
    ids = torch.randint(3, 256, (2, 37), generator=torch.Generator().manual_seed(0))
    prompts = [ids[0].tolist(), ids[1, :20].tolist()]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    engine = Engine(zoo.build(name), packed_steps=packed)
    out = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in out] == want
    assert engine.scheduler.packed == (packed is None)
    assert True in steps  # decode graphs rewritten in place
    assert (False in steps) == (packed is False)  # padded prefill graphs (no state) not; packed ones hold no region
