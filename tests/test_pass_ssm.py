"""The SSM pass on real HF mixers (Mamba, Mamba2, Jamba, Bamba, Falcon-H1, FalconMamba): rewritten in prefill and decode graphs,
HF's cache states come out identical (drop-in), and cases where it must not fire."""
import pytest
import torch
import transformers

from compiler import explain
from runtime import zoo
from runtime.hf import cache_kwarg, output_cache
from hybrid_kernels.numerics import rel_err
from harness import cache_tensors, compile_forward, prompt

FAMILIES = ["mamba", "mamba2", "jamba", "bamba"]


def ssm_statuses(model, ids, **kw):
    return {r["module"]: r for r in explain(model, ids, **kw).regions() if r["kind"] == "ssm"}


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_and_decode_rewritten(name):
    model = zoo.build(name)
    regions = ssm_statuses(model, prompt(model, 1, 9), generate_tokens=3)
    assert regions and all(r["status"] == "rewritten" for r in regions.values()), regions
    assert all(len(r["graphs"]) >= 2 for r in regions.values())


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_cache_states_identical_to_hf(name):
    """Prefill then two decode steps: conv and ssm states in HF's cache match eager exactly (fp32)."""
    eager, compiled = zoo.build(name), compile_forward(zoo.build(name), {"inductor": False})
    ids = prompt(eager, 2, 11)
    key = cache_kwarg(eager)
    states = []
    with torch.no_grad():
        for model in (eager, compiled):
            out = model(ids, use_cache=True)
            cache = output_cache(out)
            logits = [out.logits]
            for step in range(2):
                nxt = out.logits[:, -1:].argmax(-1)
                out = model(nxt, use_cache=True, **{key: cache})
                logits.append(out.logits)
            states.append((cache_tensors(cache), torch.cat(logits, 1)))
    torch._dynamo.reset()
    (ref_states, ref_logits), (got_states, got_logits) = states
    assert len(ref_states) == len(got_states) >= 4
    for a, b in zip(got_states, ref_states):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a, b) < 1e-5
    assert rel_err(got_logits, ref_logits) < 1e-5


@pytest.mark.parametrize("name", ["mamba", "mamba2", "bamba"])
def test_left_padded_batch_with_mask_rewritten_and_identical_to_hf(name):
    """A batch with a left-padded row and HF's 2-D attention mask: the mixer gets the mask, the probe checks the op
    against the live mixer under it, the region is rewritten, and the real tokens' logits and the cache states (the
    padded row's included) equal eager's."""
    eager = zoo.build(name)
    ids = prompt(eager, 2, 9)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    regions = {r["module"]: r for r in explain(eager, ids, attention_mask=mask).regions() if r["kind"] == "ssm"}
    assert regions and all(r["status"] == "rewritten" for r in regions.values()), regions
    compiled = compile_forward(zoo.build(name), {"inductor": False})
    got = []
    with torch.no_grad():
        for model in (eager, compiled):
            out = model(ids, attention_mask=mask, use_cache=True)
            got.append((out.logits[mask.bool()], cache_tensors(output_cache(out))))
    torch._dynamo.reset()
    (ref_logits, ref_states), (logits, states) = got
    assert rel_err(logits, ref_logits) < 1e-5
    assert len(states) == len(ref_states) >= 4
    for a, b in zip(states, ref_states):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5


def test_non_silu_conv_activation_must_not_fire():
    model = zoo.build("mamba")
    for layer in model.backbone.layers:
        layer.mixer.activation = "relu"  # HF applies ACT2FN[activation] after the conv; our op is silu-only
    regions = ssm_statuses(model, prompt(model, 1, 6))
    assert all(r["status"] == "skipped" and "silu" in r["reason"] for r in regions.values()), regions


def test_mixer_math_change_is_caught_by_the_probe():
    """A mixer whose D skip is disabled in code (same parameters) must be left alone."""
    model = zoo.build("mamba2")
    for layer in model.backbone.layers:
        mixer = layer.mixer
        orig = mixer.forward

        def forward(hidden_states, *args, orig=orig, **kwargs):
            return orig(hidden_states, *args, **kwargs) * 0.5
        mixer.forward = forward
    regions = ssm_statuses(model, prompt(model, 1, 6))
    assert all(r["status"] == "skipped" and "mixer math differs" in r["reason"] for r in regions.values()), regions


def _continue_prefill(name: str):
    """Eager and compiled: a 6-token prefill, then a 5-token chunk on top of the cached states. Returns the second
    chunk's logits, the cache tensors after it and the SSM results of the second chunk's graph."""
    eager, compiled = zoo.build(name), compile_forward(zoo.build(name), {"inductor": False})
    a, b = prompt(eager, 2, 6, seed=1), prompt(eager, 2, 5, seed=2)
    key = cache_kwarg(eager)
    outs = []
    from compiler import collect
    with torch.no_grad(), collect() as report:
        for model in (eager, compiled):
            cache = output_cache(model(a, use_cache=True))
            outs.append((model(b, use_cache=True, **{key: cache}).logits, cache_tensors(cache)))
    torch._dynamo.reset()
    second = max(r.graph for r in report.results)
    return outs, [r for r in report.results if r.kind == "ssm" and r.graph == second]


@pytest.mark.parametrize("name", ["mamba2", "bamba"])
def test_prefill_chunk_continuing_from_cache_rewritten(name):
    """A second multi-token chunk on top of the cached states (HF's Mamba2 mixer continues from both states):
    hybrid::mamba2_mixer_chunk, logits and the cache states after it equal eager's."""
    ((ref, ref_states), (got, got_states)), results = _continue_prefill(name)
    assert results and all(r.status == "rewritten" and "continuing" in r.reason for r in results), results
    assert rel_err(got, ref) < 1e-5
    assert len(got_states) == len(ref_states) >= 4
    for x, y in zip(got_states, ref_states):
        assert rel_err(x, y) < 1e-5


def test_mamba1_prefill_chunk_continuing_from_cache_is_left_alone():
    """HF's Mamba1 scan starts a multi-token call from a zero ssm state even with a cache: the pass must not
    fire (hybrid's op would continue from the cached state), and the results stay eager's."""
    ((ref, _), (got, _)), results = _continue_prefill("mamba")
    assert rel_err(got, ref) < 1e-5
    assert results and all(r.status == "skipped" and "does not read the cached ssm state" in r.reason
                           for r in results), results


@pytest.mark.parametrize("name", ["mamba2", "bamba", "mamba", "jamba"])
def test_prompt_lengths_compile_once(name, monkeypatch):
    """With dynamic shapes the rewritten mixers keep the length symbolic: one graph for every prompt
    length (Inductor included). HF's Mamba1 scan (Mamba, Jamba) specialises on the length while dynamo
    traces it: hybrid routes it through an opaque op when it first sees it (passes/prepare.py), which costs
    one retrace on the second call; no length compiles anything after that."""
    import sys

    from compiler import collect
    from passes.prepare import SCAN_NAME as NAME
    eager = zoo.build(name)
    model = zoo.build(name)
    for m in model.modules():  # start from HF's own scan (an earlier test in this process may have wrapped it)
        scan = getattr(sys.modules[type(m).__module__], NAME, None)
        if hasattr(scan, "_hybrid_original"):
            monkeypatch.setattr(sys.modules[type(m).__module__], NAME, scan._hybrid_original)
    torch._dynamo.reset()
    fwd = torch.compile(model.forward, backend="hybrid", dynamic=True)
    compiled_after = []
    with torch.no_grad(), collect() as report:
        for t in (20, 29, 45, 61):
            ids = prompt(eager, 1, t, seed=t)
            assert rel_err(fwd(ids, use_cache=True).logits, eager(ids, use_cache=True).logits) < 1e-5
            compiled_after.append(len(report.graphs))
    torch._dynamo.reset()
    # the first call may hand the backend more than one graph (dynamo restarts its analysis once when
    # Inductor specialises a float); later lengths must not compile anything
    mamba1 = name in ("mamba", "jamba")
    assert compiled_after[0] >= 1 and compiled_after[1] == compiled_after[2] == compiled_after[3], compiled_after
    assert (compiled_after[1] == compiled_after[0] + 1) if mamba1 else (compiled_after[1] == compiled_after[0])
    assert all(r["status"] == "rewritten" for r in report.regions())
    if mamba1:  # the explain report says what happened to HF's scan, and eager runs stay HF's
        notes = [n for g in report.graphs for n in g.notes]
        assert any("hybrid::selective_scan_rt" in n for n in notes), notes
        ids = prompt(eager, 1, 33, seed=3)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, eager(ids).logits)


def _falcon_h1():
    """Falcon-H1: a Mamba2 mixer without a gated norm (y * silu(z)), an input multiplier and per-channel multipliers
    of the in projection's output (mup_vector), beside attention layers."""
    cfg = transformers.AutoConfig.for_model(
        "falcon_h1", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8, max_position_embeddings=256, ssm_in_multiplier=0.7,
        ssm_multipliers=[1.3, 0.6, 1.1, 0.9, 1.2])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    zoo._randomize_zero_init(model, 0)
    return model


def test_mixer_with_multipliers_and_no_norm_rewritten():
    model = _falcon_h1()
    ids = prompt(model, 2, 9)
    regions = ssm_statuses(model, ids, generate_tokens=3)
    assert len(regions) == 2 and all(r["status"] == "rewritten" and len(r["graphs"]) >= 2 for r in regions.values())
    compiled = compile_forward(_falcon_h1(), {"inductor": False})
    with torch.no_grad():
        assert rel_err(compiled(ids).logits, model(ids).logits) < 1e-5
        gen = dict(max_new_tokens=5, do_sample=False)
        assert torch.equal(compiled.generate(ids, **gen), model.generate(ids, **gen))
    torch._dynamo.reset()


def test_mamba1_with_weightless_bcdt_norms_rewritten():
    """FalconMamba: Mamba1 with RMS norms on B, C and dt that hold no weight (their epsilon is ``eps``)."""
    def build():
        cfg = transformers.AutoConfig.for_model(
            "falcon_mamba", vocab_size=256, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
            conv_kernel=4, time_step_rank=4, mixer_rms_eps=1e-3)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        zoo._randomize_zero_init(model, 0)
        return model
    model = build()
    ids = prompt(model, 2, 9)
    regions = ssm_statuses(model, ids, generate_tokens=3)
    assert len(regions) == 2 and all(r["status"] == "rewritten" for r in regions.values()), regions
    compiled = compile_forward(build(), {"inductor": False})
    with torch.no_grad():
        assert rel_err(compiled(ids).logits, model(ids).logits) < 1e-5
        gen = dict(max_new_tokens=5, do_sample=False)
        assert torch.equal(compiled.generate(ids, **gen), model.generate(ids, **gen))
    torch._dynamo.reset()


def test_verify_mode_reads_past_the_mamba1_scans_vmap():
    """HF's Mamba1 scan runs under torch.vmap: verify mode snapshots the region's values after it, where its batched
    intermediates can no longer be read; they are left out (no op reads one) and the prefill graph is verified and
    rewritten instead of falling back whole."""
    model = zoo.build("mamba")
    report = explain(model, prompt(model, 1, 9), options={"verify": True})
    notes = [n for g in report.graphs for n in g.notes]
    assert not [n for n in notes if "passes failed" in n], notes
    regions = [r for r in report.regions() if r["kind"] == "ssm"]
    assert regions and all(r["status"] == "rewritten" for r in regions), regions
