"""The engine runs every model feature it accepts exactly and refuses the rest in one line (runtime/engine/features.py):
sliding windows per layer, learned sinks and logit soft-capping give HF generate's greedy tokens, over gathered and
paged keys, uncompiled and compiled; ALiBi, shared KV, chunked and non-causal attention are refused by name."""
from __future__ import annotations

import functools

import pytest
import torch
import transformers

from runtime import zoo
from runtime.engine import Engine, SamplingParams
from runtime.engine.features import Unsupported

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
#: windows of 4 keys: shorter than every prompt, so a window left out changes the tokens
FAMILIES = {
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"] * 2),   # windows on half the layers, sinks
    "gemma2": dict(sliding_window=4, query_pre_attn_scalar=16),                 # soft-capping, alternating windows
    "mistral": dict(sliding_window=4),                                           # a window on every layer
}
PROMPTS = [list(range(5, 17)), [7, 8, 9, 10, 11, 3, 4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]


def _model(name: str, **overrides):
    cfg = transformers.AutoConfig.for_model(name, **{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    zoo._randomize_zero_init(model, 0)
    return model


def _hf_greedy(model, n: int = 8) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):]
                .tolist() for p in PROMPTS]


def _engine(model, **kw) -> list[list[int]]:
    engine = Engine(model, max_num_seqs=3, block_size=4, **kw)
    torch._dynamo.reset()
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    torch._dynamo.reset()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_windows_sinks_softcap_equal_hf(name):
    """Over gathered keys and over the pages (the kernel with windowed rows; the exact path for sinks and
    soft-capping), uncompiled, then compiled with the hybrid passes."""
    model = _model(name, **FAMILIES[name])
    want = _hf_greedy(model)
    assert _engine(model, compile=None, paged_decode=False) == want
    assert _engine(model, compile=None, paged_decode=True) == want
    assert _engine(model, compile="hybrid-eager", paged_decode=True) == want


def test_the_window_matters(monkeypatch):
    """Control: with the layers' windows left out of the masks the engine's tokens differ from HF's."""
    import runtime.engine.attention as attention
    model = _model("mistral", **FAMILIES["mistral"])
    want = _hf_greedy(model)
    monkeypatch.setattr(attention, "_windowed", lambda mask, window: mask)
    assert _engine(model, compile=None, paged_decode=False) != want


@pytest.mark.parametrize("name,overrides,feature", [
    ("bloom", dict(n_layer=2, n_head=4, hidden_size=64), "ALiBi"),
    ("llama", dict(attention_chunk_size=4), "chunked attention"),
    ("llama", dict(num_kv_shared_layers=1), "shared across layers"),
])
def test_unsupported_features_are_refused_by_name(name, overrides, feature):
    cfg = transformers.AutoConfig.for_model(name, **({} if name == "bloom" else TINY), **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(Unsupported, match=feature) as err:
        Engine(model, compile=None)
    assert "\n" not in str(err.value)


def test_non_causal_attention_is_refused():
    model = zoo.build("llama")
    model.model.layers[1].self_attn.is_causal = False
    with pytest.raises(Unsupported, match=r"non-causal attention \(model.layers.1.self_attn"):
        Engine(model, compile=None)


def test_attention_beside_ssm_in_one_layer_equals_hf():
    """Layers whose attention and Mamba2 mixer run side by side (one HF cache layer holds keys and states): paged
    keys and state rows in one engine layer, over gathered and paged keys, prompts prefilled whole and in chunks
    of 4 tokens (the mixer continues from the row's states), uncompiled and compiled."""
    model = _model("falcon_h1", num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                   mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8)
    want = _hf_greedy(model)
    assert _engine(model, compile=None, paged_decode=False) == want
    assert _engine(model, compile=None, paged_decode=True, max_prefill_tokens=4) == want
    assert _engine(model, compile="hybrid-eager", paged_decode=True) == want


def test_a_model_that_adds_cache_rows_is_refused():
    """A model that caches more key rows than it was given tokens (a learned prompt of its own) is refused: the
    engine writes one cache row per token."""
    cfg = transformers.AutoConfig.for_model("cpmant", vocab_size=256, hidden_size=64, dim_ff=64, num_hidden_layers=2,
                                            num_attention_heads=4, dim_head=16, prompt_length=8)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(Unsupported, match="caches 10 key rows for a 2-token prompt"):
        Engine(model, compile=None)


@pytest.mark.parametrize("name, overrides", [
    ("gpt_neox_japanese", dict(intermediate_multiple_size=1, rotary_pct=0.5)),
    # BERT-style query / key / value projections (found by the cache update in its forward, not by their names)
    ("big_bird", dict(is_decoder=True, attention_type="original_full")),
], ids=["gpt_neox_japanese", "big_bird"])
def test_attention_of_the_models_own_gets_contiguous_gathered_keys(name, overrides):
    """An attention module that does not call HF's attention functions (it views the keys the cache returns) gets
    them gathered and contiguous: HF's greedy tokens, uncompiled and compiled; paged decode, which would hand it the
    raw buffer, is refused by name."""
    model = _model(name, **overrides)
    want = _hf_greedy(model)
    assert _engine(model, compile=None) == want
    assert _engine(model, compile="hybrid-eager") == want
    with pytest.raises(Unsupported, match="paged decode for attention that does not call HF's attention functions"):
        Engine(model, compile=None, paged_decode=True)


@pytest.mark.parametrize("name, config, match", [
    ("rwkv", dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                  intermediate_size=128, context_length=256),
     r"forward takes no HF cache .*keeps its state in 'state'"),
    ("xlnet", dict(vocab_size=256, d_model=64, n_layer=2, n_head=4, d_inner=128),
     r"forward takes no HF cache .*keeps its state in 'mems'"),
    ("xlstm", dict(vocab_size=256, hidden_size=64, embedding_dim=64, num_hidden_layers=2, num_heads=4),
     r"xLSTMForCausalLM's cache: a prefill with HF's DynamicCache failed \(AttributeError"),
])
def test_a_model_that_keeps_its_state_outside_hfs_cache_is_refused(name, config, match):
    """Recurrent models with a state argument of their own would decode each token without its context: refused."""
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(name, **config)).eval()
    with pytest.raises(Unsupported, match=match):
        Engine(model, compile=None)


def test_cross_attention_layers_on_text_prompts_equal_hf():
    """Mllama's text model: its cross-attention layers run only on image states, which a text prompt has none of.
    HF's generate leaves their cache layers empty and the model skips them; the engine's empty layers say the same
    (not initialised), and its attention layers hold keys, as HF's do, when the model asks every layer."""
    from transformers.models.mllama import MllamaForCausalLM, MllamaTextConfig
    cfg = MllamaTextConfig(**{**TINY, "cross_attention_layers": [1, 3], "bos_token_id": 1, "eos_token_id": 2,
                              "pad_token_id": 0})
    torch.manual_seed(0)
    model = MllamaForCausalLM(cfg).eval()
    zoo._randomize_zero_init(model, 0)
    want = _hf_greedy(model)
    assert _engine(model, compile=None) == want
    assert _engine(model, compile="hybrid-eager") == want


def test_a_cache_window_the_attention_does_not_apply_caps_the_length():
    """Moshi's config has a sliding window that HF's cache keeps (older keys dropped) but its attention call does not
    pass, so HF's cached generate and its own forward part ways past the window. The engine caps sequences at the
    window, where both agree: its tokens equal HF's there, and a longer request is refused in one line."""
    model = _model("moshi", sliding_window=8)
    engine = Engine(model, compile=None, block_size=4)
    assert engine.max_model_len == 8
    prompts = [[5, 6, 7], [20, 21, 22, 23]]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=4))] == want
    with pytest.raises(ValueError, match="exceeds the model's maximum length of 8 tokens"):
        engine.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=4))
    mistral = Engine(_model("mistral", sliding_window=8), compile=None)  # its attention applies the window
    assert mistral.max_model_len == 256


def test_a_model_whose_forward_cannot_run_over_the_cache_is_refused_at_construction():
    """XLM slices its inputs by the cache length and builds masks from the full sequence: the construction's probe
    request fails inside HF's code, and the engine refuses the model in one line naming where (not each request
    later with finish_reason='error')."""
    cfg = transformers.XLMConfig(vocab_size=128, emb_dim=32, n_layers=2, n_heads=2, max_position_embeddings=64,
                                 causal=True)
    torch.manual_seed(0)
    model = transformers.XLMWithLMHeadModel(cfg).eval()
    with pytest.raises(Unsupported) as info:
        Engine(model, compile=None, max_num_seqs=2, block_size=4, cache_memory=8 << 20)
    message = str(info.value)
    assert "\n" not in message and "probe request failed" in message and "modeling_xlm.py" in message


def test_a_batched_prefill_that_fails_on_the_probe_makes_prefills_single(monkeypatch, caplog):
    """A model whose forward raises on several prompts at once (and runs one prompt): the probe turns batched
    prefill off, and the requests then give HF generate's tokens (one prompt per prefill step)."""
    model = _model("llama")
    want = _hf_greedy(model)
    real = model.forward

    @functools.wraps(real)  # the same signature: the engine finds the cache argument
    def one_prompt_prefills(input_ids=None, **kw):
        if input_ids.shape[0] > 1 and input_ids.shape[1] > 1:
            raise RuntimeError("this forward prefills one prompt at a time")
        return real(input_ids=input_ids, **kw)
    monkeypatch.setattr(model, "forward", one_prompt_prefills)
    engine = Engine(model, compile=None, max_num_seqs=4, block_size=4, cache_memory=8 << 20)
    assert engine.scheduler.max_prefill_seqs == 1 and "batched prefill failed" in engine.prefill_batch_note
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == want
    assert engine.stats["failed_steps"] == 0


def test_longrope_runs_up_to_where_a_batch_leaves_it_alone():
    """HF's longrope takes one set of factors per forward call from the call's longest position, so past
    ``original_max_position_embeddings`` a batch's rows would change each other's rotations (the tokens would differ,
    with no error). The engine runs such a model up to that length: there batched tokens equal each prompt's HF generate,
    and a longer request is refused in one line that says why."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
            "short_factor": [1.0] * 8, "long_factor": [100.0] * 8}
    model = _model("llama", max_position_embeddings=64, initializer_range=0.5, rope_parameters=rope)
    engine = Engine(model, compile=None, block_size=4)
    assert engine.max_model_len == 24
    prompts = [[5, 6, 7], list(range(30, 42)), list(range(60, 76))]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=8))] == want
    with pytest.raises(ValueError, match="maximum length of 24 tokens .its longrope RoPE"):
        engine.generate([list(range(5, 25))], SamplingParams(max_tokens=8))


def test_the_longrope_limit_matters(monkeypatch):
    """Without the limit, a prompt past ``original_max_position_embeddings`` batched with a short one changes the short
    one's tokens: the case the limit exists for."""
    import runtime.engine.engine as engine_module
    monkeypatch.setattr(engine_module, "batch_rope_limit", lambda cfg: None)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
            "short_factor": [1.0] * 8, "long_factor": [100.0] * 8}
    model = _model("llama", max_position_embeddings=64, initializer_range=0.5, rope_parameters=rope)
    prompts = [[5, 6, 7], list(range(30, 60))]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    got = [o.token_ids for o in Engine(model, compile=None, block_size=4).generate(prompts, SamplingParams(max_tokens=8))]
    assert got[0] != want[0] and got[1] == want[1], (got, want)
