"""The MLA pass on real HF DeepSeek attentions: rewritten in prefill and decode graphs, HF's latent cache
unchanged, padded batches, and cases where it must not fire."""
import pytest
import torch

from compiler import explain
from runtime import zoo
from runtime.hf import cache_kwarg, output_cache
from hybrid_kernels.numerics import rel_err
from harness import cache_tensors, compile_forward, prompt


def mla_statuses(model, ids, **kw):
    return {r["module"]: r for r in explain(model, ids, **kw).regions() if r["kind"] == "mla"}


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "kimi_linear"])
def test_prefill_and_decode_rewritten(name):
    model = zoo.build(name)
    regions = mla_statuses(model, prompt(model, 1, 9), generate_tokens=3)
    assert regions and all(r["status"] == "rewritten" and len(r["graphs"]) >= 2 for r in regions.values()), regions


def test_latent_cache_identical_to_hf():
    eager, compiled = zoo.build("deepseek_v3"), compile_forward(zoo.build("deepseek_v3"), {"inductor": False})
    ids = prompt(eager, 2, 10)
    key = cache_kwarg(eager)
    results = []
    with torch.no_grad():
        for model in (eager, compiled):
            out = model(ids, use_cache=True)
            cache, logits = output_cache(out), [out.logits]
            for _ in range(3):
                out = model(out.logits[:, -1:].argmax(-1), use_cache=True, **{key: cache})
                logits.append(out.logits)
            results.append((cache_tensors(cache), torch.cat(logits, 1)))
    torch._dynamo.reset()
    (ref_cache, ref_logits), (got_cache, got_logits) = results
    assert len(ref_cache) == len(got_cache) > 0
    for a, b in zip(got_cache, ref_cache):
        assert a.shape == b.shape and rel_err(a, b) < 1e-6
    assert rel_err(got_logits, ref_logits) < 1e-5


@pytest.mark.parametrize("name", ["deepseek_v2", "mamba2"])
def test_left_padded_batch_generate(name):
    """Attention masks reach the rewritten regions (MLA: SDPA mask; SSM: padding mask on the states)."""
    eager, compiled = zoo.build(name), compile_forward(zoo.build(name), {"inductor": False})
    ids = prompt(eager, 2, 8)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of the second row
    ids[1, :3] = eager.config.pad_token_id or 0
    gen = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad():
        ref = eager.generate(ids, **gen)
        out = compiled.generate(ids, **gen)
    torch._dynamo.reset()
    assert torch.equal(out, ref)


def test_eager_attention_implementation_must_not_fire():
    model = zoo.build("deepseek_v3", attn_implementation="eager")
    regions = mla_statuses(model, prompt(model, 1, 6))
    assert regions and all(r["status"] == "skipped" and "sdpa" in r["reason"] for r in regions.values()), regions


def test_changed_key_assembly_is_caught_by_the_probe():
    """An attention whose expansion differs from DeepSeek's (value scaled by 2) must be left alone."""
    model = zoo.build("deepseek_v2")
    for layer in model.model.layers:
        attn = layer.self_attn
        orig = attn.expand_kv

        def expand_kv(kv_nope, k_rot, orig=orig):
            k, v = orig(kv_nope, k_rot)
            return k, v.transpose(2, 3).contiguous().transpose(2, 3) * 2.0
        attn.expand_kv = expand_kv
    ids = prompt(model, 1, 6)
    regions = mla_statuses(model, ids)
    assert regions and all(r["status"] == "skipped" for r in regions.values()), regions


def test_nope_query_split_matches_eager():
    """Kimi Linear's MLA has no rotary embedding: its query is one projection of nope + rope channels, which the pass
    splits for the op; logits and greedy tokens through prefill and decode graphs equal eager."""
    eager, compiled = zoo.build("kimi_linear"), compile_forward(zoo.build("kimi_linear"), {"inductor": False})
    ids = prompt(eager, 2, 9)
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad():
        assert rel_err(compiled(ids).logits, eager(ids).logits) < 1e-5
        assert torch.equal(compiled.generate(ids, **gen), eager.generate(ids, **gen))
    torch._dynamo.reset()


def test_nope_query_split_undone_when_the_probe_fails():
    """A NoPE MLA whose value expansion differs (scaled by 2): the query is split for the plan, the plan rejects the
    attention, the split is undone and the model compiles to eager's logits."""
    model = zoo.build("kimi_linear")
    for m in model.modules():
        if hasattr(m, "expand_kv") and hasattr(m, "kv_b_proj"):
            def expand_kv(kv_nope, k_rot, orig=m.expand_kv):
                k, v = orig(kv_nope, k_rot)
                return k, v.transpose(2, 3).contiguous().transpose(2, 3) * 2.0
            m.expand_kv = expand_kv
    ids = prompt(model, 1, 6)
    regions = mla_statuses(model, ids)
    assert regions and all(r["status"] == "skipped" and "not a plain MLA" in r["reason"]
                           for r in regions.values()), regions
    compiled = compile_forward(model, {"inductor": False})
    with torch.no_grad():
        assert rel_err(compiled(ids).logits, model(ids).logits) < 1e-5
    torch._dynamo.reset()
