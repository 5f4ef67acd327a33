"""The generation engine on the CPU: greedy outputs equal HF generate for every zoo model (several
requests, different prompt lengths, arrivals while others decode), cache isolation, admission and
preemption under a tiny cache, sampling, bad input, the CLI."""
import functools
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from runtime import zoo
from runtime.engine import Engine, SamplingParams
from runtime.engine.allocator import BlockAllocator, SlotAllocator
from test_modules import EXPECTED


def hf_greedy(name: str, prompt: list[int], max_tokens: int) -> list[int]:
    model = zoo.build(name)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 29)), [40, 41, 42]]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_greedy_matches_hf_generate_with_arrivals(name):
    engine = Engine(zoo.build(name), compile="hybrid-eager")
    params = SamplingParams(max_tokens=6)
    first = [engine.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(4):  # the first two are prefilled and decoding when the third arrives
        engine.step()
    late = engine.add_request(PROMPTS[2], params)
    while engine.has_unfinished():
        engine.step()
    torch._dynamo.reset()
    for rid, prompt in zip(first + [late], PROMPTS):
        assert engine.output(rid).token_ids == hf_greedy(name, prompt, 6), (name, prompt)


def _prefill_sizes(engine) -> list[int]:
    """Record the number of sequences of every prefill step the engine launches from now on."""
    sizes, launch = [], engine.runner.launch

    def recording(step, ahead=None):
        if step.kind == "prefill":
            sizes.append(len(step.seqs))
        return launch(step, ahead)
    engine.runner.launch = recording
    return sizes


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "gpt_oss", "mixtral"])
def test_fresh_prompts_prefill_together(name):
    """Prompts of different lengths arriving together prefill in one step, left-padded to the longest (gpt_oss:
    sliding windows and sinks over the padded rows; deepseek_v3: MLA), and a second call whose budget holds two rows
    of its longest prompt splits them over steps; greedy tokens equal HF's either way."""
    prompts = [list(range(5, 5 + n)) for n in (7, 9, 12, 5, 10)]
    want = [hf_greedy(name, p, 4) for p in prompts]
    engine = Engine(zoo.build(name), compile="hybrid-eager", block_size=4, packed_steps=False)
    assert engine.prefill_batch_note is None
    sizes = _prefill_sizes(engine)
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=4))] == want
    assert sizes == [5]
    engine.scheduler.max_num_batched_tokens = 24
    sizes.clear()
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=4))] == want
    assert sizes == [2, 2, 1]  # 7 + 9 (2 x 9 padded), 12 + 5 (2 x 12), 10: a third row would pass 24 tokens
    torch._dynamo.reset()  # a later test of the same class records its own compiles
    if name == "llama":
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            Engine(zoo.build(name), max_num_batched_tokens=0)


def _steps(engine) -> list[tuple[str, int, list[int]]]:
    """Record (kind, decoding sequences, tokens per sequence) of every step the engine launches from now on."""
    steps, launch = [], engine.runner.launch

    def recording(step, ahead=None):
        steps.append((step.kind, len(step.seqs) if step.kind == "decode" else step.num_decodes, list(step.num_tokens)))
        return launch(step, ahead)
    engine.runner.launch = recording
    return steps


def _staggered(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The first prompt alone for one step, then the others arriving while it decodes; greedy tokens of each."""
    params = SamplingParams(max_tokens=max_tokens)
    ids = [engine.add_request(prompts[0], params)]
    engine.step()
    ids += [engine.add_request(p, params) for p in prompts[1:]]
    while engine.has_unfinished():
        engine.step()
    return [engine.output(r).token_ids for r in ids]


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v2", "bamba", "mamba2",
                                  "granitemoehybrid", "qwen3_next", "kimi_linear", "gpt_oss"])
def test_packed_steps_mix_decodes_and_chunks(name):
    """Models of attention (MLA included: attention over the latent pages; gpt-oss's sinks and sliding windows) and
    state layers (each sequence on its own
    state row: Mamba2 through hybrid::mamba2_mixer_packed, delta-rule mixers through HF's forward per chunk,
    hybrid::engine_mixer_packed) take packed steps: the decoding sequences and chunks of prompts
    (fresh ones and ones continuing from several points) in one unpadded forward within the token budget; a decoding
    request gets a token at every step while a long prompt prefills; greedy tokens equal HF's."""
    prompts = [list(range(5, 10)), list(range(20, 50)), list(range(60, 73)), [80, 81]]
    want = [hf_greedy(name, p, 8) for p in prompts]
    engine = Engine(zoo.build(name), compile="hybrid-eager", block_size=4, max_prefill_tokens=8,
                    max_num_batched_tokens=12)
    assert engine.scheduler.packed and engine.packed_note is None
    steps = _steps(engine)
    assert _staggered(engine, prompts, 8) == want  # the short prompt alone for a step, then the others
    packed = [s for s in steps if s[0] == "packed"]
    assert steps[0] == ("packed", 0, [5])
    # the 30-token prompt goes in chunks cut to the budget beside the decoding request; all chunks are unpadded
    assert all(sum(tokens) <= 12 for _, _, tokens in packed), steps
    assert any(d >= 1 and len(tokens) - d >= 2 for _, d, tokens in packed), steps  # decodes + two prompts' chunks
    assert all(d >= 1 for kind, d, _ in steps[1:]), steps  # the first request decodes in every later step
    assert engine.stats["packed_steps"] == len(packed)
    # a prompt whose chunk left one token feeds it with the decodes, as in padded steps
    assert sum(map(len, prompts)) - len(prompts) <= engine.stats["prefill_tokens"] <= sum(map(len, prompts))
    torch._dynamo.reset()


@pytest.mark.parametrize("counts,ctx", [([1, 70, 5], [30, 70, 12]), ([64, 1, 100], [64, 9, 130]), ([80], [95])])
def test_packed_mla_forms_agree(counts, ctx):
    """A packed MLA step's two forms compute the same attention: sequences with 64+ tokens expanded (latents through
    kv_b_proj, hybrid::varlen_attention), the rest absorbed (hybrid::mla_prefill), against the whole step absorbed;
    shuffled pages, a decode, chunks continuing prompts and a fresh prompt (fp32)."""
    from runtime.engine import attention
    from runtime.engine.model_runner import ModelRunner, mla_split_arg
    torch.manual_seed(0)
    module = zoo.build("deepseek_v3").model.layers[0].self_attn
    h = module.config.num_attention_heads
    lat, rope = module.kv_lora_rank, module.qk_rope_head_dim
    bs, n = 4, sum(counts)
    nb = max(-(-c // bs) for c in ctx)
    table = torch.randperm(len(counts) * nb + 8)[:len(counts) * nb].view(len(counts), nb) + 1
    pages = torch.randn((len(counts) * nb + 9) * bs, 1, lat + rope)
    query = torch.randn(1, h, n, module.qk_nope_head_dim + rope)
    counts_t, ends = torch.tensor(counts), torch.tensor(ctx)
    cu = torch.cat([counts_t.new_zeros(1), counts_t.cumsum(0)])
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    kwargs = {"hybrid_latent_pages": {module.layer_idx: pages}, "hybrid_block_size": bs,
              "hybrid_packed_table": table.to(torch.int32), "hybrid_cu_q": cu.to(torch.int32),
              "hybrid_ctx": ends.to(torch.int32)}
    with torch.no_grad():
        absorbed, _ = attention._packed_mla(module, query, module.scaling, 0.0, kwargs)
        split = ModelRunner._mla_split(counts_t, owner, table, ends, bs)
        assert split and len(split["long_rows"]) == sum(c for c in counts if c >= 64)
        both, _ = attention._packed_mla(module, query, module.scaling, 0.0,
                                        {**kwargs, "hybrid_mla_split": mla_split_arg(split)})
    assert both.shape == absorbed.shape == (1, n, h, module.v_head_dim)
    torch.testing.assert_close(both, absorbed, rtol=1e-4, atol=1e-5)


def test_packed_mla_expands_long_chunks():
    """In a packed MLA step, sequences with 64 or more tokens in the step attend in the expanded form (their
    latents expanded through kv_b_proj, hybrid::varlen_attention), the decodes and short chunks beside them in the
    absorbed form; greedy tokens equal HF's."""
    prompts = [list(range(5, 10)), [3 + i % 90 for i in range(100)], [7 + i % 80 for i in range(70)]]
    want = [hf_greedy("deepseek_v3", p, 6) for p in prompts]
    engine = Engine(zoo.build("deepseek_v3"), compile="hybrid-eager", block_size=4, max_prefill_tokens=80,
                    max_num_batched_tokens=96)
    assert engine.scheduler.packed, engine.packed_note
    splits, real = [], engine.runner._mla_split
    engine.runner._mla_split = lambda *a: splits.append(real(*a)) or splits[-1]
    steps = _steps(engine)
    assert _staggered(engine, prompts, 6) == want
    assert any(kind == "packed" and d >= 1 and max(t) >= 64 for kind, d, t in steps), steps
    # both forms in one step: a decode (absorbed) beside a chunk of 64+ tokens (expanded)
    assert any(m and len(m["short_rows"]) and len(m["long_rows"]) >= 64 for m in splits), splits
    torch._dynamo.reset()


@pytest.mark.parametrize("name,kwargs,why", [("deepseek_v3", {"paged_decode": False}, "paged latent cache"),
                                             ("bamba", {"unrecognised": True}, "no mixer module of their own"),
                                             ("mamba2", {"other_math": True}, "differs from hybrid's mamba2 mixer")])
def test_packed_steps_left_off_with_a_reason(name, kwargs, why, monkeypatch):
    """MLA without the paged latent cache, state layers with no mixer module of their own (here: Bamba's mixers,
    hidden from the classifier, their forward taking a required argument besides the hidden states) and a Mamba2 mixer whose HF forward computes other than hybrid's op (here: the op's gated
    output doubled) keep the padded steps, and say why; asking for packed steps there is a one-line error."""
    def build():
        model = zoo.build(name)
        if unrecognised:
            for m in model.modules():
                if type(m).__name__ == "BambaMixer":
                    m.forward = functools.partial(lambda real, hidden_states, *, attention_mask, **kw:
                                                  real(hidden_states, attention_mask=attention_mask, **kw), m.forward)
        return model
    unrecognised = kwargs.pop("unrecognised", False)
    if unrecognised:
        from runtime.engine import packed_states
        monkeypatch.setattr(packed_states, "classify", lambda m: None)
    if kwargs.pop("other_math", False):
        from hybrid_kernels.ssm import mixer
        real = mixer._gated_output
        monkeypatch.setattr(mixer, "_gated_output", lambda *a: 2 * real(*a))
    engine = Engine(build(), compile="hybrid-eager", **kwargs)
    assert not engine.scheduler.packed
    assert why in engine.packed_note
    with pytest.raises(ValueError, match="packed_steps=True, but .* takes no packed steps"):
        Engine(build(), compile="hybrid-eager", packed_steps=True, **kwargs)


def test_packed_steps_run_an_unrecognised_mixer_through_its_hf_forward(monkeypatch):
    """A state layer whose mixer hybrid does not recognise (Bamba's, hidden from the classifier and the Mamba2
    recogniser, as a short convolution or another recurrence is) still takes packed steps: its own module (the innermost one with that
    layer_idx, its forward taking the cache by keyword) runs HF's forward per run of chunks and once for the decodes
    (hybrid::engine_mixer_packed); greedy tokens equal HF's."""
    from runtime.engine import packed_states
    prompts = [list(range(5, 10)), list(range(20, 50)), list(range(60, 73)), [80, 81]]
    want = [hf_greedy("bamba", p, 8) for p in prompts]
    monkeypatch.setattr(packed_states, "classify", lambda m: None)
    monkeypatch.setattr(packed_states, "mamba2_dims", lambda m: None)
    model = zoo.build("bamba")
    engine = Engine(model, compile="hybrid-eager", block_size=4, max_prefill_tokens=8, max_num_batched_tokens=12)
    assert engine.scheduler.packed and engine.packed_note is None
    mixers = [m for m in model.modules() if type(m).__name__ == "BambaMixer"]
    assert mixers and all(m._hybrid_packed and m._hybrid_hf_forward is not None for m in mixers)
    steps = _steps(engine)
    assert _staggered(engine, prompts, 8) == want
    assert any(kind == "packed" and d >= 1 and len(t) > d for kind, d, t in steps), steps


@pytest.mark.parametrize("name", ["mamba2", "qwen3_next"])
def test_packed_state_mixers_leave_other_callers_alone(name):
    """The engine forward packed steps give a model's mixers answers other callers as HF does: HF generate on the same
    model after an engine's packed steps, and a second engine on it, used in turn with the first (each call takes
    the cache it is given); greedy tokens equal HF's."""
    prompts = [list(range(5, 10)), list(range(20, 33))]
    model = zoo.build(name)
    want = [hf_greedy(name, p, 5) for p in prompts]
    first = Engine(model, compile=None, block_size=4, max_prefill_tokens=4, max_num_batched_tokens=8)
    assert first.scheduler.packed
    assert _staggered(first, prompts, 5) == want
    with torch.no_grad():
        assert model.generate(torch.tensor([prompts[1]]), max_new_tokens=5, do_sample=False)[0, 13:].tolist() == want[1]
    second = Engine(model, compile=None, block_size=4, max_prefill_tokens=4, max_num_batched_tokens=8)
    assert second.scheduler.packed
    assert _staggered(second, prompts, 5) == want and _staggered(first, prompts, 5) == want
    assert first.stats["packed_steps"] and second.stats["packed_steps"]


@pytest.mark.parametrize("name", ["mamba2", "qwen3_next"])
def test_packed_state_chunks_of_prompts_admitted_together_share_a_call(name, monkeypatch):
    """Chunks of prompts admitted together share one call of the mixer, fresh and continuing, beside a decoding
    request: Mamba2's op (``mixer.chunk_groups``) takes chunks of several lengths as right-padded rows; HF's forward
    (``mixer.chunk_runs``) takes chunks of one length lying back to back on consecutive state rows. Greedy tokens equal
    HF's."""
    from hybrid_kernels.ssm import mixer
    from runtime.engine import packed_states
    calls = []
    if name == "mamba2":
        real_groups = mixer.chunk_groups
        monkeypatch.setattr(mixer, "chunk_groups", lambda seqs, pad: calls.append(
            [(len(g.rows), g.continues, g.padded) for g in real_groups(seqs, pad)]) or real_groups(seqs, pad))
        lengths = [9, 7, 8]  # first chunks of 5 (one run), then 4, 2 and 3 tokens (one padded call)
    else:
        real_runs = mixer.chunk_runs
        monkeypatch.setattr(packed_states, "chunk_runs", lambda seqs: calls.append(
            [(n, n * cont, False) for _, _, _, cont, n in real_runs(seqs)]) or real_runs(seqs))
        lengths = [9, 9, 9]  # chunks of 5, then the rests of 4
    prompts = [[3, 4, 5]] + [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lengths, 1)]
    want = [hf_greedy(name, p, 4) for p in prompts]
    engine = Engine(zoo.build(name), compile=None, block_size=4, max_prefill_tokens=5, max_num_batched_tokens=16)
    assert _staggered(engine, prompts, 4) == want
    assert (3, 0, False) in sum(calls, []), calls  # three fresh 5-token chunks
    assert (3, 3, name == "mamba2") in sum(calls, []), calls  # then their rests, continuing


def test_packed_generic_mixer_state_writes_survive_functionalization():
    """hybrid::engine_mixer_packed writes the state rows through its declared mutable arguments: under AOTAutograd's
    functionalization without Inductor's re-inplacing (backend="aot_eager"), the rows of Qwen3-Next's Gated DeltaNet
    still carry each sequence's states from step to step; greedy tokens equal HF's."""
    prompts = [list(range(5, 10)), list(range(20, 33))]
    want = [hf_greedy("qwen3_next", p, 4) for p in prompts]
    model = zoo.build("qwen3_next")
    engine = Engine(model, compile=None, block_size=4, max_prefill_tokens=4, max_num_batched_tokens=8)
    assert engine.scheduler.packed
    engine.runner.forward = torch.compile(model, backend="aot_eager", dynamic=True)
    assert _staggered(engine, prompts, 4) == want
    assert engine.stats["packed_steps"] >= 2
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["jamba", "mamba"])
def test_packed_steps_with_whole_prompts(name):
    """Mamba1 mixers do not continue a multi-token chunk (no chunking): their prompts go whole, packed with the decodes
    where they fit the step's budget; a longer one takes a padded prefill step, a decode step between; greedy tokens
    equal HF's."""
    prompts = [list(range(5, 10)), list(range(20, 50)), list(range(60, 73)), [80, 81]]
    want = [hf_greedy(name, p, 8) for p in prompts]
    engine = Engine(zoo.build(name), compile="hybrid-eager", block_size=4, max_prefill_tokens=8,
                    max_num_batched_tokens=12)
    assert engine.scheduler.packed and engine.prefill_note
    steps = _steps(engine)
    assert _staggered(engine, prompts, 8) == want
    assert ("prefill", 0, [30]) in steps and steps[steps.index(("prefill", 0, [30])) + 1][0] == "decode", steps
    assert any(kind == "packed" and d >= 1 and len(t) > d for kind, d, t in steps), steps
    torch._dynamo.reset()


def test_packed_mla_checks_expand_kv(monkeypatch):
    """Packed MLA steps replace HF's expand_kv by its absorbed form: a model whose expand_kv computes something else
    (here: values scaled) is left on padded steps, with the reason."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
    real = m.DeepseekV3Attention.expand_kv
    monkeypatch.setattr(m.DeepseekV3Attention, "expand_kv", lambda self, kv, rot: (
        real(self, kv, rot)[0], 2 * real(self, kv, rot)[1]))
    engine = Engine(zoo.build("deepseek_v3"), compile="hybrid-eager")
    assert not engine.scheduler.packed and "expand_kv is not the per-head split" in engine.packed_note
    from runtime.engine.model_runner import _expand_kv_mismatch
    monkeypatch.undo()
    module = zoo.build("deepseek_v3").model.layers[0].self_attn
    assert _expand_kv_mismatch([module], 1) is None
    module.expand_kv = lambda kv: kv  # another signature
    assert "expand_kv failed on latents (TypeError" in _expand_kv_mismatch([module], 1)


def test_packed_probe_turns_packed_steps_off_when_tokens_differ(monkeypatch):
    """A packed forward that computes something else than the padded one (here: attention that ignores its
    window of one key) is caught by the construction probe: the engine stays on padded steps."""
    from runtime.engine import attention
    real = attention._packed
    monkeypatch.setattr(attention, "_packed", lambda q, buf, scaling, window, dropout, kw: real(
        q, buf, scaling, 1, dropout, kw))
    engine = Engine(zoo.build("llama"), compile="hybrid-eager")
    assert not engine.scheduler.packed and "packed steps gave tokens" in engine.packed_note


@pytest.mark.parametrize("name", ["mamba2", "bamba", "jamba", "qwen3_next"])
def test_state_layers_prefill_prompts_together(name):
    """With state layers (Mamba2 alone, beside attention, Mamba1 in Jamba, Gated DeltaNet) prompts of several
    lengths prefill in one step, left-padded, the state layers given HF's 2-D padding mask, once the construction
    probe has shown that the padding leaves their states exact; each prompt's states go to its own row. Compiled
    (hybrid's mixer ops under the mask), greedy tokens equal HF's for each prompt alone. Without padding (where the
    probe finds it inexact) prompts of one length still share a step, and so do the chunks of long prompts at one
    point of their prompts (the later ones continuing from the rows' states)."""
    prompts = [list(range(5 + i, 12 + i)) for i in range(3)] + [list(range(30, 39)), list(range(40, 47))]
    want = [hf_greedy(name, p, 4) for p in prompts]
    engine = Engine(zoo.build(name), compile="hybrid-eager", block_size=4, packed_steps=False)
    assert engine.prefill_batch_note is None and engine.runner.pad_states
    sizes = _prefill_sizes(engine)
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=4))] == want
    assert sizes == [5]
    engine.runner.pad_states, engine.scheduler.equal_lengths = False, True
    sizes.clear()
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=4))] == want
    assert sizes == [3, 1, 1]  # 7, 7, 7 | 9 | 7 (arrival order: the last 7 does not overtake the 9)
    if engine.prefill_note is None:  # chunked prefill: first chunks of 4 together, then the rest of each together
        engine.scheduler.max_prefill_tokens = 4
        sizes.clear()
        assert [o.token_ids for o in engine.generate(prompts[:3], SamplingParams(max_tokens=4))] == want[:3]
        assert sizes == [3, 3]
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "gpt_oss", "bamba", "qwen3_next", "kimi_linear"])
def test_chunks_that_continue_prompts_share_steps(name):
    """Long prompts in chunks of 4: those at the same point of their prompts with chunks of one length continue
    together (attention over their cached keys, MLA, sliding windows and sinks, Mamba2 and delta-rule state rows
    continuing), one of another length alone; greedy tokens equal HF's."""
    prompts = [list(range(5 + i, 18 + i)) for i in range(3)] + [list(range(40, 50))]
    want = [hf_greedy(name, p, 3) for p in prompts]
    engine = Engine(zoo.build(name), compile="hybrid-eager", block_size=4, max_prefill_tokens=4, packed_steps=False)
    sizes = _prefill_sizes(engine)
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=3))] == want
    # 13, 13, 13 and 10 tokens: chunks of 4 (all four), 4 (all four, each continuing from 4 cached), then 4 x 3 and
    # the 10's last 2 alone; a prompt's last token goes with the decode steps
    assert engine.prefill_note is None and sizes == [4, 4, 3, 1], (sizes, engine.prefill_note)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "bamba", "qwen3_next"])
def test_decoding_requests_advance_between_the_chunks_of_a_long_prompt(name):
    """A request decoding when a long prompt arrives gets a token after every chunk step of that prompt (a decode
    step between prefill steps), not after the whole prompt; both requests' greedy tokens equal HF's."""
    short, long = list(range(5, 10)), list(range(20, 50))
    want = [hf_greedy(name, short, 16), hf_greedy(name, long, 4)]
    engine = Engine(zoo.build(name), compile="hybrid-eager", block_size=4, max_prefill_tokens=4, packed_steps=False)
    kinds, launch = [], engine.runner.launch

    def recording(step, ahead=None):
        kinds.append(step.kind if step.kind == "decode" or len(step.seqs) != 1 or step.seqs[0].request_id != late
                     else "long")
        return launch(step, ahead)
    engine.runner.launch = recording
    first = engine.add_request(short, SamplingParams(max_tokens=16))
    late = None
    for _ in range(3):  # the short prompt's chunks, then its first decode
        engine.step()
    late = engine.add_request(long, SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(r).token_ids for r in (first, late)] == want
    chunks = [i for i, k in enumerate(kinds) if k == "long"]
    assert len(chunks) >= 7, kinds  # 30 tokens in chunks of 4, the last one with the decode steps
    assert all(kinds[i + 1] == "decode" for i in chunks[:-1]), " ".join(kinds)
    torch._dynamo.reset()


@pytest.mark.parametrize("packed", [False, None], ids=["padded", "packed"])
def test_decode_padding_leaves_a_prompt_under_way_alone(packed):
    """Decode steps pad their batch to a bucket (CUDA graphs' shapes), and padding rows update state rows n.. in
    place: while a prompt between its chunks holds row n (three sequences decoding on rows 0-2, a 13-token prompt in
    4-token chunks on row 3), the decode step runs unpadded instead; greedy tokens equal HF's."""
    prompts = [[3, 4, 5], [6, 7, 8], [9, 10, 11], list(range(20, 33))]
    want = [hf_greedy("mamba2", p, 6) for p in prompts]
    engine = Engine(zoo.build("mamba2"), compile=None, bucket_decode=True, max_prefill_tokens=4, max_num_seqs=4,
                    packed_steps=packed)
    batches = []
    real = engine.runner.launch
    engine.runner.launch = lambda step, ahead=None: (
        batches.append((step.kind, len(step.seqs), len(engine.slots.owners))), real(step, ahead))[1]
    params = SamplingParams(max_tokens=6)
    ids = [engine.add_request(p, params) for p in prompts[:3]]
    engine.step()  # the three short prompts prefill together
    ids.append(engine.add_request(prompts[3], params))
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(r).token_ids for r in ids] == want
    if packed is False:  # a decode of three beside the prompt under way happened, and was not padded into its row
        assert ("decode", 3, 4) in batches, batches


@pytest.mark.parametrize("name", ["mamba2", "bamba"])
def test_state_rows_gathered_where_not_consecutive(name, monkeypatch):
    """Padded steps: state rows of a prefill bound as gathered copies and stored back (the path of rows that are not
    consecutive, after a finished sequence's row was filled by a move): forced for every step here, tokens still equal
    HF's, with fresh and continuing chunks."""
    from runtime.engine import model_runner
    monkeypatch.setattr(model_runner, "state_rows", lambda slots, device: torch.tensor(slots, device=device))
    prompts = [list(range(5 + i, 16 + i)) for i in range(3)]
    want = [hf_greedy(name, p, 3) for p in prompts]
    engine = Engine(zoo.build(name), compile=None, block_size=4, max_prefill_tokens=4, packed_steps=False)
    sizes = _prefill_sizes(engine)
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=3))] == want
    assert sizes == [3, 3, 3]


def test_padding_that_moves_the_states_is_refused():
    """A Mamba2 whose in projection has a bias: a left-padded row's conv sees the bias where HF's mask zeroes the
    input, so its states differ from the prompt's alone. The construction probe finds it, says so in
    prefill_batch_note, and the engine batches only prompts of one length; tokens equal HF's."""
    model = zoo.build("mamba2", use_bias=True)
    engine = Engine(model, compile=None)
    assert not engine.runner.pad_states and engine.scheduler.equal_lengths
    assert engine.prefill_batch_note.startswith("state layers: prompts of equal length per prefill step (a padded "
                                                "prefill moved a state layer's states: relative error")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=3))] == want


@pytest.mark.parametrize("name", ["llama", "deepseek_v2", "mamba2", "bamba"])
def test_bucketed_decode_padding_rows_change_nothing(name):
    """CUDA-graph decode layout on the CPU: 3 sequences padded to a batch of 4 (padding rows attend to the
    reserved block, run on spare SSM state rows) and key widths padded to powers of two."""
    engine = Engine(zoo.build(name), compile=None, bucket_decode=True, max_num_seqs=3, block_size=4)
    assert engine.runner.bucket_decode
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=6))
    for out, prompt in zip(outs, PROMPTS):
        assert out.token_ids == hf_greedy(name, prompt, 6), (name, prompt)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "jamba", "bamba"])
def test_paged_decode_matches_hf_generate(name):
    """Decode attention read in place from the paged buffers (hybrid::mla_decode over the [v | k] rows),
    with bucketed batches: the layout the engine uses on the GPU."""
    engine = Engine(zoo.build(name), compile=None, paged_decode=True, bucket_decode=True, max_num_seqs=3,
                    block_size=4)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=6))
    for out, prompt in zip(outs, PROMPTS):
        assert out.token_ids == hf_greedy(name, prompt, 6), (name, prompt)


@pytest.mark.parametrize("triton", [False, True], ids=["reference", "triton-interpreter"])
def test_paged_attention_equals_sdpa_over_gathered_keys(monkeypatch, triton):
    from runtime.engine.attention import attention_forward, decode_maps
    if triton:
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    g = torch.Generator().manual_seed(3)
    b, hq, hkv, dk, dv, rows, bs = 3, 6, 2, 20, 12, 64, 4
    buf = torch.randn(rows, hkv, dv + dk, generator=g)
    lengths = torch.tensor([5, 17, 1])
    slots = torch.zeros(b, 20, dtype=torch.long)
    free = (torch.randperm(rows - bs, generator=g) + bs).tolist()  # rows of block 0 stay reserved
    for i, n in enumerate(lengths.tolist()):
        slots[i, :n] = torch.tensor([free.pop() for _ in range(n)])
    query = torch.randn(b, hq, 1, dk, generator=g)
    table, seq_lens = decode_maps(slots, lengths, hkv)
    out, _ = attention_forward(None, query, buf, buf, None, scaling=0.3, hybrid_block_table=table,
                               hybrid_seq_lens=seq_lens)
    for i, n in enumerate(lengths.tolist()):
        kv = buf[slots[i, :n]].transpose(0, 1)  # [hkv, n, dv + dk]
        k = kv[..., dv:].repeat_interleave(hq // hkv, 0)
        v = kv[..., :dv].repeat_interleave(hq // hkv, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(query[i], k, v, scale=0.3)  # [hq, 1, dv]
        torch.testing.assert_close(out[i, 0], ref[:, 0], atol=2e-5, rtol=2e-5)


def _compile_recording(monkeypatch, model, **kw):
    """Generate PROMPTS with the engine's hybrid-eager compile -> (outputs, the call targets of every graph after the
    passes, the MLA regions' explain notes and the graph notes)."""
    import compiler.backend
    from compiler.report import collect
    graphs, notes = [], []
    run_pipeline = compiler.backend.run_pipeline

    def recording(ctx, passes):
        counts = run_pipeline(ctx, passes)
        notes.extend(ctx.notes)
        graphs.append({str(n.target) for n in ctx.gm.graph.nodes if n.op in ("call_function", "call_method")})
        return counts
    monkeypatch.setattr(compiler.backend, "run_pipeline", recording)
    with collect() as report:
        engine = Engine(model, compile="hybrid-eager", bucket_decode=True, max_num_seqs=3, block_size=4, **kw)
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=6))
    torch._dynamo.reset()
    return outs, graphs, [r.reason for r in report.results if r.kind == "mla"] + notes


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_mla_decode_attends_over_the_pages_in_place(name, monkeypatch):
    """Decode graphs of DeepSeek models read the paged latent cache in place and write the step's row themselves
    (hybrid::mla_decode_step: kv_a_layernorm, the cache write and the absorbed query in one launch, then attention
    over the pages): the explain report says so, no gather of the cache (hybrid::paged_gather) and no index_copy_ is
    left in them, and tokens stay HF's with bucket padding and blocks of 4."""
    outs, graphs, notes = _compile_recording(monkeypatch, zoo.build(name))
    for out, prompt in zip(outs, PROMPTS):
        assert out.token_ids == hf_greedy(name, prompt, 6), (name, prompt)
    # prefill graphs never hold the gather: it must be gone from every graph, and decode graphs attend paged
    decode = [g for g in graphs if any("mla_decode_step" in t for t in g)]
    assert decode, graphs
    assert not any("paged_gather" in t for g in graphs for t in g), graphs
    assert not any("index_copy_" in g for g in decode), decode
    assert any("paged latent cache in place" in n for n in notes), notes
    assert any(re.match(r"[1-9]\d* MLA decode steps: the step's kv_a_layernorm, cache write and query absorption "
                        r"are one launch", n) for n in notes), notes


class _OnePlusWeightNorm(torch.nn.Module):
    """Gemma's RMSNorm, (1 + w) * norm(x): holds what an RMSNorm holds, computes something else."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n) * 0.3)
        self.variance_epsilon = eps

    def forward(self, x):
        t = x.float()
        return ((1 + self.weight.float()) * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                ).to(x.dtype)


def test_mla_decode_leaves_a_cache_write_it_cannot_prove(monkeypatch):
    """A kv_a_layernorm whose math is not RMSNorm's (the norm pass's probe says so): the decode step still attends
    over the pages in place (hybrid::mla_attention_paged), the norm and the cache write stay in the graph, the explain
    report says why, and tokens equal the uncompiled engine's on the same model."""
    def model():
        torch.manual_seed(0)
        m = zoo.build("deepseek_v2")
        for layer in m.model.layers:
            attn = layer.self_attn
            attn.kv_a_layernorm = _OnePlusWeightNorm(attn.kv_a_layernorm.weight.shape[0], 1e-6)
        return m
    want = Engine(model(), compile=None, bucket_decode=True, max_num_seqs=3, block_size=4).generate(
        PROMPTS, SamplingParams(max_tokens=6))
    outs, graphs, notes = _compile_recording(monkeypatch, model())
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert not any("mla_decode_step" in t for g in graphs for t in g), graphs
    assert any("mla_attention_paged" in t for g in graphs for t in g), graphs
    assert any("left to Inductor where kv_a_layernorm: its math is not RMSNorm's" in n for n in notes), notes


def test_mla_decode_step_fires_in_bf16(monkeypatch):
    """The engine's bf16 decode graphs (what the GPU runs) take the fused step too: the written rows' probe runs in
    the graph's dtypes. Tokens equal the uncompiled engine's on the same bf16 model."""
    want = Engine(zoo.build("deepseek_v2", dtype=torch.bfloat16), compile=None, bucket_decode=True, max_num_seqs=3,
                  block_size=4).generate(PROMPTS, SamplingParams(max_tokens=6))
    outs, graphs, notes = _compile_recording(monkeypatch, zoo.build("deepseek_v2", dtype=torch.bfloat16))
    assert any("mla_decode_step" in t for g in graphs for t in g), notes
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


@pytest.mark.parametrize("name", ["deepseek_v2", "jamba"])
def test_cache_isolation(name):
    """A sequence produces the same tokens alone and sharing every batch with others."""
    alone = Engine(zoo.build(name), compile=None).generate([PROMPTS[1]], SamplingParams(max_tokens=8))[0]
    together = Engine(zoo.build(name), compile=None).generate(PROMPTS, SamplingParams(max_tokens=8))
    assert together[1].token_ids == alone.token_ids


def test_preemption_under_a_tiny_cache_keeps_outputs_exact():
    name = "mixtral"
    engine = Engine(zoo.build(name), compile=None, block_size=4, cache_memory=12 * 4 * 2 * 2 * 2 * 16 * 4,
                    max_num_seqs=8)
    assert engine.blocks.num_blocks == 12
    prompts = [[i + 3, i + 4, i + 5, i + 6] for i in range(6)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.preemptions for o in outs) == engine.scheduler.num_preemptions
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(name, p, 8)
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1  # everything returned


def test_ssm_rows_limit_admission_and_compact():
    name = "mamba2"
    engine = Engine(zoo.build(name), compile=None, max_num_seqs=2)
    prompts = [[3, 4, 5], [6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16]]
    params = [SamplingParams(max_tokens=n) for n in (3, 7, 5, 4)]  # finish at different times: rows move
    running_max = 0
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    while engine.has_unfinished():
        engine.step()
        running_max = max(running_max, len(engine.scheduler.running))
    assert running_max == 2
    for rid, (p, sp) in enumerate(zip(prompts, params)):
        out = engine.output(list(engine._seqs)[rid])
        assert out.token_ids == hf_greedy(name, p, sp.max_tokens)


@pytest.mark.parametrize("name", ["mamba2"])
def test_ssm_prompts_prefill_in_chunks(name):
    """Mixers that continue from HF's cached states (Mamba2; Bamba's mixer chunks in the tests of chunks sharing steps
    and of decodes between chunks): long prompts are prefilled in chunks of max_prefill_tokens, each chunk after the
    first continuing from the sequence's state row (the SSM pass's hybrid::mamba2_mixer_chunk); greedy tokens equal HF
    generate's with the prompt in one piece."""
    engine = Engine(zoo.build(name), compile="hybrid-eager", max_prefill_tokens=4, packed_steps=False)
    assert engine.prefill_note is None and engine.scheduler.chunked_prefill
    prompts = [list(range(10, 29)), [5, 6, 7], list(range(30, 41))]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6))
    assert engine.stats["steps"] - engine.stats["decode_steps"] == 5 + 1 + 3  # prefill chunks of <= 4 tokens
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(name, p, 6)


@pytest.mark.parametrize("packed,blocks", [(False, 12), (None, 10)], ids=["padded", "packed"])
def test_ssm_sequence_starts_with_blocks_for_its_whole_prompt(packed, blocks, monkeypatch):
    """Bamba (SSM state rows + paged attention), 12 (10) blocks of 4 tokens, prompts in 4-token chunks, padded (packed)
    steps: a sequence starts only when its whole prompt fits (a half-prefilled sequence holds a state row that
    decode steps cannot skip, so it must never wait for blocks between chunks); the cache fills and preempts decoding
    sequences, never a half-prefilled one, and every output stays exact."""
    from runtime.engine.scheduler import Scheduler
    half = []
    real = Scheduler.preempt
    monkeypatch.setattr(Scheduler, "preempt", lambda self, seq: (half.append(0 < seq.num_cached < len(seq.prompt)),
                                                                 real(self, seq))[1])
    state_row, block = 21504, 4 * 256  # bytes of one SSM state row and one 4-token block of the tiny Bamba
    engine = Engine(zoo.build("bamba"), compile=None, block_size=4, cache_memory=4 * state_row + blocks * block,
                    max_num_seqs=4, max_prefill_tokens=4, packed_steps=packed)
    assert engine.blocks.num_blocks == blocks and engine.scheduler.chunked_prefill
    assert engine.scheduler.packed == (packed is None)
    prompts = [list(range(10, 29)), list(range(30, 41)), [5, 6, 7], list(range(50, 67))]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6))
    assert engine.scheduler.num_preemptions > 0 and half and not any(half)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy("bamba", p, 6)


@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_mamba1_prompts_prefill_whole(name):
    """HF's Mamba1 scan restarts from a zero state on every multi-token call: the engine finds that out by a probe
    and prefills whole prompts (chunks would lose the state)."""
    engine = Engine(zoo.build(name), compile=None, max_prefill_tokens=4)
    assert not engine.scheduler.chunked_prefill and "does not continue" in engine.prefill_note
    prompt = list(range(10, 29))
    assert engine.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids == hf_greedy(name, prompt, 4)
    assert engine.stats["steps"] - engine.stats["decode_steps"] == 1


def test_request_too_big_for_the_cache_is_refused():
    engine = Engine(zoo.build("llama"), compile=None, block_size=4, cache_memory=4 * 4 * 2 * 2 * 2 * 16 * 4)
    with pytest.raises(ValueError, match="needs .* cache blocks"):
        engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=4))


def test_bad_input_is_a_clear_error():
    engine = Engine(zoo.build("llama"), compile=None)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 300])
    with pytest.raises(ValueError, match="maximum length"):
        engine.add_request(list(range(3, 250)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("hello")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(FileNotFoundError, match="neither a zoo model"):
        Engine.from_pretrained("/no/such/model")


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    engine = Engine(zoo.build("qwen3_moe"), compile=None)
    hot = SamplingParams(max_tokens=8, temperature=1.5, seed=7)
    a, b, greedy, k1 = engine.generate([PROMPTS[0]] * 4, [hot, hot, SamplingParams(max_tokens=8),
                                                          SamplingParams(max_tokens=8, temperature=1.0, top_k=1,
                                                                         seed=3)])
    assert a.token_ids == b.token_ids
    assert k1.token_ids == greedy.token_ids
    c = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=1.5, seed=8))[0]
    assert c.token_ids != a.token_ids  # (probability of an 8-token collision at T=1.5 is negligible)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("vocab", [102400, 50280, 50257, 32000, 8191])
def test_greedy_ids_equal_argmax_first_maximum(vocab, device):
    from hybrid_kernels.sampling.ops import greedy_ids
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(device, torch.bfloat16)  # bf16: many exact ties
    logits[1] = 0.0  # all tied: index 0
    logits[2, vocab // 3] = logits[2, vocab - 1] = 99.0  # tie across chunks: the earlier one
    assert torch.equal(greedy_ids(logits), logits.argmax(-1))
    assert greedy_ids(logits)[1] == 0 and greedy_ids(logits)[2] == vocab // 3


def test_stream_yields_every_token_once():
    engine = Engine(zoo.build("deepseek_v3"), compile=None)
    events = list(engine.stream(PROMPTS[:2], SamplingParams(max_tokens=5)))
    assert sum(e.finished for e in events) == 2
    per_request = {}
    for e in events:
        per_request.setdefault(e.request_id, []).append(e.token_id)
    assert sorted(len(v) for v in per_request.values()) == [5, 5]


@pytest.mark.parametrize("name", ["llama", "mamba2"])
def test_decode_running_ahead_drops_tokens_after_a_stop(name):
    """Steps launched ahead of the host (overlap) give the same tokens as strictly serial steps, also when a
    sequence stops on a stop token mid-batch (its extra token is dropped, the batch shrinks, SSM rows move)."""
    prompts = PROMPTS + [list(range(60, 67))]
    serial = Engine(zoo.build(name), compile=None, overlap=False).generate(prompts, SamplingParams(max_tokens=12))
    stop = serial[1].token_ids[4]  # request 1 stops at its 5th token (others may stop earlier on it too)
    params = SamplingParams(max_tokens=12, stop_token_ids=(stop,))
    want = Engine(zoo.build(name), compile=None, overlap=False).generate(prompts, params)
    engine = Engine(zoo.build(name), compile=None, overlap=True)
    launched_ahead = []
    launch = engine.runner.launch

    def counting_launch(step, ahead=None):
        launched_ahead.append(ahead is not None)
        return launch(step, ahead)
    engine.runner.launch = counting_launch
    got = engine.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert want[1].token_ids[-1] == stop and want[1].finish_reason == "stop"
    assert sum(launched_ahead) >= 5, launched_ahead
    # dropped tokens are not output: each request's first token comes from its prefill, the rest from decode
    assert engine.stats["decode_tokens"] == sum(len(o.token_ids) for o in got) - len(prompts)
    assert not engine.has_unfinished()
    if engine.blocks is not None:  # every block back (block 0 stays reserved for padding)
        assert engine.blocks.num_free == engine.blocks.num_blocks - 1
    if engine.slots is not None:
        assert engine.slots.num_used == 0


def test_decode_runs_ahead_while_a_request_waits_for_cache():
    """A request that cannot start for lack of cache blocks does not stop decode steps from running ahead
    (Scheduler.would_prefill checks the blocks), and the tokens are the serial engine's."""
    bs = 4
    probe = Engine(zoo.build("llama"), compile=None, block_size=bs)
    token_bytes = sum(l.buf[0].numel() * l.buf.element_size() for l in probe.cache.attention)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    late = list(range(10, 29))  # 19 prompt tokens: 5 blocks, more than are free once the first two have grown

    def run(overlap: bool):
        # 11 blocks: block 0 reserved, the first two requests hold at most 5 + 4 of the other 10
        engine = Engine(zoo.build("llama"), compile=None, block_size=bs, cache_memory=11 * bs * token_bytes,
                        overlap=overlap)
        assert engine.blocks.num_blocks == 11
        launched = []
        launch = engine.runner.launch

        def recording(step, ahead=None):
            launched.append((ahead is not None, bool(engine.scheduler.waiting)))
            return launch(step, ahead)
        engine.runner.launch = recording
        ids = [engine.add_request(p, params) for p in ([5, 6, 7, 8, 9], [40, 41, 42])]
        for _ in range(8):
            engine.step()
        ids.append(engine.add_request(late, params))
        while engine.has_unfinished():
            engine.step()
        assert engine.scheduler.num_preemptions == 0
        return [engine.output(i).token_ids for i in ids], launched

    want, _ = run(False)
    got, launched = run(True)
    assert got == want
    assert any(ahead and waiting for ahead, waiting in launched), launched


def test_allocators():
    blocks = BlockAllocator(5, 4)
    a = blocks.allocate(2)
    assert 0 not in a and blocks.num_free == 2 and blocks.slot(a, 5) == a[1] * 4 + 1
    blocks.free(a)
    assert blocks.num_free == 4
    with pytest.raises(ValueError):
        blocks.free([0])
    slots = SlotAllocator(3)
    s0, s1, s2 = (slots.allocate(x) for x in "abc")
    assert (s0, s1, s2) == (0, 1, 2)
    assert slots.free(0) == (2, 0, "c") and slots.owners == ["c", "b"]
    assert slots.free(1) is None and slots.owners == ["c"]


def test_cli_generate_json():
    res = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "mamba", "--prompt-ids", "5,6,7",
                          "--prompt-ids", "9,10", "--max-new-tokens", "4", "--json", "--compile", "none"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(res.stdout)
    assert [len(o["token_ids"]) for o in data["outputs"]] == [4, 4]
    assert data["outputs"][0]["token_ids"] == hf_greedy("mamba", [5, 6, 7], 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", ["llama", "mamba2", "bamba", "mixtral"])
def test_cuda_graph_decode_matches_hf_generate(name):
    """Recorded decode steps (static inputs, bucket padding, paged attention) against HF, fp32 on the GPU.
    The eager forward is captured as is (models whose HF code syncs, e.g. Mixtral's expert loop, fall back
    to uncaptured steps with a warning, which must not change tokens either)."""
    prompts = PROMPTS + [list(range(50, 61))]
    model = zoo.build(name, device="cuda")
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    engine = Engine(zoo.build(name, device="cuda"), compile=None, bucket_decode=True, max_num_seqs=4, block_size=4)
    engine.runner.graphs_enabled = True
    outs = engine.generate(prompts, SamplingParams(max_tokens=10))
    assert [o.token_ids for o in outs] == ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", ["llama", "mamba2"])
def test_recorded_steps_advance_their_own_inputs(name):
    """A decode step running ahead of a replay of the same graph (same sequences and blocks) replays on the
    inputs that replay left (ids, positions + 1, padding - 1): tokens equal HF's across block and width
    changes (block_size=4, 40 tokens), and most steps took that path."""
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    model = zoo.build(name, device="cuda")
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=40, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    for batch in ([prompts[0]], prompts):
        engine = Engine(model, compile=None, bucket_decode=True, max_num_seqs=4, block_size=4)
        engine.runner.graphs_enabled = True
        outs = engine.generate(batch, SamplingParams(max_tokens=40))
        assert [o.token_ids for o in outs] == ref[:len(batch)]
        assert engine.runner.advanced_steps >= engine.stats["decode_steps"] // 4 > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels in recorded steps need a GPU")
@pytest.mark.parametrize("name", ["deepseek_v2", "jamba", "qwen3_next", "kimi_linear", "gpt_oss"])
def test_compiled_cuda_graph_engine_matches_hf_generate(name):
    """The GPU default (hybrid passes + Inductor, recorded decode steps) in fp32: DeepSeek-V2's decode attention
    is the paged Triton kernel over the latent pages (hybrid::mla_attention_paged); Jamba's Mamba1 scan traces
    as hybrid::selective_scan_rt (passes/prepare.py) next to paged attention and MoE layers; Qwen3-Next's and
    Kimi Linear's delta-rule mixers run the Triton chunked prefill and the in-place decode step on their state
    rows; gpt_oss's fresh prompts prefill together (sliding windows, sinks) before graphed decode."""
    prompts = PROMPTS + [list(range(50, 61))]
    model = zoo.build(name, device="cuda")
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    engine = Engine(model, compile="hybrid-cudagraphs", max_num_seqs=4, block_size=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10))
    torch._dynamo.reset()
    assert [o.token_ids for o in outs] == ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels in recorded steps need a GPU")
@pytest.mark.parametrize("name", ["llama", "mixtral", "deepseek_v3", "bamba", "qwen3_next"])
def test_compiled_packed_steps_on_the_gpu(name):
    """The GPU default with packed steps, fp32: prompts arriving while others decode share packed steps with them
    (hybrid::varlen_attention's Triton kernel under Inductor, or hybrid::mla_prefill's over MLA's latent pages;
    Bamba's Mamba2 layers through hybrid::mamba2_mixer_packed's conv, SSD and state-update kernels, Qwen3-Next's
    Gated DeltaNet through HF's forward per chunk with hybrid's delta-rule kernels;
    chunks cut to the budget), decode-only steps replay
    CUDA graphs; greedy tokens equal HF's."""
    prompts = [list(range(5, 10)), list(range(20, 50)), list(range(60, 73)), [80, 81]]
    model = zoo.build(name, device="cuda")
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    engine = Engine(model, compile="hybrid-cudagraphs", max_num_seqs=4, block_size=4, max_prefill_tokens=8,
                    max_num_batched_tokens=12)
    steps = _steps(engine)
    got = _staggered(engine, prompts, 8)
    torch._dynamo.reset()
    assert got == ref
    assert any(kind == "packed" and d >= 1 and len(t) > d for kind, d, t in steps), steps
    assert engine.runner._graphs, "decode-only steps replay CUDA graphs"


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon MLA decode kernel is for sm_90")
@pytest.mark.parametrize("heads", [128, 16])
def test_compiled_engine_mla_runs_the_gluon_kernel(heads, monkeypatch):
    """A bf16 DeepSeek-V3 layout at 128 (V3) and 16 (V2-Lite) heads with V3's latent widths (L 512, R 64): the
    engine's recorded decode steps take hybrid::mla_decode_wg (hybrid_kernels/mla/gluon_wide.py, gluon_narrow.py) through
    hybrid::mla_decode_step; greedy tokens are HF generate's."""
    from hybrid_kernels.mla import gluon
    if not gluon.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    launches = []
    real = gluon._launch
    monkeypatch.setattr(gluon, "_launch", lambda *a: launches.append(a) or real(*a))
    model = zoo.build("deepseek_v3", dtype=torch.bfloat16, device="cuda", hidden_size=256, num_attention_heads=heads,
                      num_key_value_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                      v_head_dim=32, q_lora_rank=64)
    prompts = [list(range(10, 17)), list(range(30, 70))]
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    engine = Engine(model, compile="hybrid-cudagraphs", max_num_seqs=2)
    outs = engine.generate(prompts, SamplingParams(max_tokens=6))
    torch._dynamo.reset()
    assert launches, "the decode steps did not reach the Gluon kernel"
    assert [o.token_ids for o in outs] == ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton SSM kernels need a GPU")
def test_compiled_ssm_prefill_chunks_on_the_gpu():
    """Mamba2 on the GPU default (passes + Inductor + recorded decode steps), a 31-token prompt in 8-token chunks:
    the chunks after the first run hybrid::mamba2_mixer_chunk's Triton conv and SSD scan from the cached states.
    Where the installed HF Mamba2 does not continue a multi-token call from its cache (transformers 5.17 on the
    H200), the engine's probe says so and prefills whole; tokens are HF's either way."""
    prompt = list(range(10, 41))
    model = zoo.build("mamba2", device="cuda")
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False)[0, 31:].tolist()
    engine = Engine(model, compile="hybrid-cudagraphs", max_prefill_tokens=8)
    out = engine.generate([prompt], SamplingParams(max_tokens=8))[0].token_ids
    torch._dynamo.reset()
    prefills = engine.stats["steps"] - engine.stats["decode_steps"]
    if engine.prefill_note is None:
        assert prefills == 4
    else:
        assert prefills == 1 and "does not continue" in engine.prefill_note
    assert out == ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton launch configs only exist on the GPU")
@pytest.mark.parametrize("name", ["mixtral", "deepseek_v2"])
def test_engine_compile_does_not_recompile_per_token_bucket(name):
    """The engine's compiled forward (run_time_configs) runs batches across every MoE token bucket and the
    MLA split choices with one graph; outputs stay eager's."""
    from torch._dynamo.utils import counters
    from torch.nn.attention import sdpa_kernel

    from runtime.engine.model_runner import SDPA_BACKENDS, ModelRunner
    model = zoo.build(name, device="cuda")
    torch._dynamo.reset()
    counters.clear()
    fn = ModelRunner._compiled(model, "hybrid")
    for batch in (2, 3, 6, 20, 70, 300):
        ids = torch.randint(0, model.config.vocab_size, (batch, 3), device="cuda")
        with torch.no_grad(), sdpa_kernel(SDPA_BACKENDS):  # as the runner calls it
            torch.testing.assert_close(fn(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-3)
        assert counters["stats"]["unique_graphs"] == 1, (batch, dict(counters["stats"]))


def test_compiled_engine_freezes_weights(monkeypatch):
    """freeze_weights=True: compile="hybrid" traces the weights as constants (runner._frozen): no graph Inductor
    compiles takes a parameter as an input, the passes still rewrite every region, and greedy tokens are HF's."""
    import torch._inductor.compile_fx as cfx

    from compiler import collect
    seen = []
    real = cfx.compile_fx

    def spy(gm, example_inputs, *args, **kwargs):
        seen.append(sum(isinstance(x, torch.nn.Parameter) for x in example_inputs))
        return real(gm, example_inputs, *args, **kwargs)
    monkeypatch.setattr(cfx, "compile_fx", spy)
    model = zoo.build("deepseek_v2")
    prompts = PROMPTS[:2]
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    torch._dynamo.reset()
    with collect() as report:
        outs = Engine(model, compile="hybrid", max_num_seqs=4, block_size=4, freeze_weights=True).generate(
            prompts, SamplingParams(max_tokens=4))
    torch._dynamo.reset()
    assert [o.token_ids for o in outs] == ref
    assert seen and all(n == 0 for n in seen), seen
    assert report.results and all(r.status == "rewritten" for r in report.results)


def test_freeze_weights_needs_inductor():
    with pytest.raises(ValueError, match="freeze_weights=True needs Inductor"):
        Engine(zoo.build("deepseek_v2"), compile="hybrid-eager", freeze_weights=True)


def test_compile_options_reach_the_backend():
    from compiler.report import collect
    engine = Engine(zoo.build("mixtral"), compile="hybrid-eager", compile_options={"moe": False})
    with collect() as report:
        outs = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=3))
    assert report.graphs and not any(g.rewritten.get("moe") for g in report.graphs)  # the switch reached the passes
    assert outs[0].token_ids == hf_greedy("mixtral", PROMPTS[0], 3)
    with pytest.raises(Exception, match="unknown hybrid option 'fuse_everything'"):
        Engine(zoo.build("mixtral"), compile="hybrid-eager",
               compile_options={"fuse_everything": True}).generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="need a hybrid compile mode"):
        Engine(zoo.build("mixtral"), compile=None, compile_options={"moe": False})


def test_capture_failure_during_a_compile_says_so(monkeypatch):
    """A recorded step that fails while dynamo compiles (here: a backend that raises) is reported as a compile inside
    the capture call; a failure without a compile passes through as it is. The graph context is faked (no GPU)."""
    import contextlib

    from runtime.engine.model_runner import record
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: contextlib.nullcontext())

    def broken(gm, example_inputs):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2, backend=broken)
    with pytest.raises(RuntimeError, match="compiled again inside the capture call.*TORCH_LOGS=recompiles"):
        record(None, None, lambda: fn(torch.ones(3)))
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="plain failure"):
        record(None, None, lambda: (_ for _ in ()).throw(ValueError("plain failure")))
    assert torch.equal(record(None, None, lambda: torch.ones(2) + 1), torch.full((2,), 2.0))


def test_step_maps_kernel_equals_torch():
    """The runner's one-kernel maps on the GPU (here through the interpreter): the same tensors as the torch version
    across batches, widths (several key blocks at 2048), prefill lengths and paged-MHA head counts."""
    from runtime.engine.step_maps import step_maps, triton_step_maps
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    g = torch.Generator().manual_seed(0)
    for batch, blocks, q_len, kv_heads, bs in [(1, 1, 1, 0, 16), (3, 3, 1, 2, 16), (2, 4, 5, 0, 16), (5, 2, 1, 4, 16),
                                               (1, 2, 1, 2, 16), (1, 1, 7, 0, 16), (2, 3, 1, 3, 7),
                                               (2, 128, 1, 2, 16)]:
        width = blocks * bs
        table = torch.randint(1, 50, (batch, blocks), generator=g).to(DEV)
        pads = torch.randint(0, width - q_len, (batch,), generator=g).to(DEV)
        want, got = step_maps(table, pads, width, q_len, bs, kv_heads), triton_step_maps(table, pads, width, q_len,
                                                                                         bs, kv_heads)
        for w, o in zip(want[:5], got[:5]):
            assert w.dtype == o.dtype and w.shape == o.shape and torch.equal(w, o)
        assert (want[5] is None) == (got[5] is None) == (kv_heads == 0)
        if kv_heads:
            assert all(w.dtype == o.dtype and torch.equal(w, o) for w, o in zip(want[5], got[5]))


def test_step_maps_fall_back_to_torch_when_the_kernel_fails(monkeypatch):
    from runtime.engine import step_maps as maps

    def broken(*args):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(maps, "triton_step_maps", broken)
    run = maps.device_step_maps()
    table, pads = torch.tensor([[3, 4]]), torch.tensor([5])
    with pytest.warns(UserWarning, match="cache-map kernel failed"):
        got = run(table, pads, 32, 1, 16, 0)
    want = maps.step_maps(table, pads, 32, 1, 16, 0)
    assert all(torch.equal(a, b) for a, b in zip(got[:5], want[:5]))
    assert all(torch.equal(a, b) for a, b in zip(run(table, pads, 32, 1, 16, 0)[:5], want[:5]))  # torch from now on


@pytest.mark.parametrize("name", ["llama", "mamba2"])
def test_warmup_compiles_ahead_and_leaves_no_trace(name):
    """After ``Engine.warmup()`` requests of new prompt lengths and batch sizes compile nothing (dynamo's frame
    counter stays), give HF's greedy tokens, and find the engine's statistics and cache as the warm-up left them:
    empty."""
    from torch._dynamo.utils import counters
    engine = Engine(zoo.build(name), compile="hybrid-eager", max_num_seqs=4, max_num_batched_tokens=256)
    lines = []
    report = engine.warmup(max_context=64, progress=lines.append)
    assert report["prefill_tokens"][0] == 16 and report["prefill_tokens"][-1] <= 256 and lines[-1].startswith(
        "warm-up done")
    assert engine.stats["steps"] == 0 and not engine.has_unfinished()
    if engine.blocks is not None:
        assert engine.blocks.num_free == engine.blocks.num_blocks - 1
    frames = counters["frames"]["total"]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2] * 7]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5))
    assert counters["frames"]["total"] == frames, "a request compiled after the warm-up"
    torch._dynamo.reset()
    assert [o.token_ids for o in outs] == [hf_greedy(name, p, 5) for p in prompts]
    engine.add_request([5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warmup()


def test_warmup_stays_within_a_short_length_limit():
    """A model (or engine directory) limited to fewer tokens than the warm-up's longest call kind: its requests are
    cut to the limit, new tokens included, and the warm-up (which `hybrid serve` runs first) completes."""
    model = zoo.build("llama")
    model.config.max_position_embeddings = 24
    engine = Engine(model, compile=None, max_num_seqs=2)
    assert engine.max_model_len == 24
    engine.warmup(progress=lambda msg: None)
    assert not engine.has_unfinished()
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids == hf_greedy("llama", [5, 6, 7], 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "qwen3_next"])
def test_warmup_records_every_decode_graph(name):
    """With CUDA graphs the warm-up records one decode graph per (batch bucket, key width) up to its context:
    later decode steps of those shapes record nothing and compile nothing, and their tokens are HF's."""
    from torch._dynamo.utils import counters

    from runtime.engine.model_runner import DECODE_BUCKETS
    model = zoo.build(name, device="cuda")
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2] * 7]
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    engine = Engine(model, compile="hybrid-cudagraphs", max_num_seqs=8, block_size=4)
    report = engine.warmup(max_context=64)
    widths = 5 if engine.cache.attention else 1  # 4, 8, ..., 64 keys
    assert report["graphs"] == len([b for b in DECODE_BUCKETS if b <= 8]) * widths
    graphs, frames = len(engine.runner._graphs), counters["frames"]["total"]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert (len(engine.runner._graphs), counters["frames"]["total"]) == (graphs, frames)
    torch._dynamo.reset()
    assert [o.token_ids for o in outs] == ref


def test_the_engine_compiles_past_dynamos_recompile_limit(monkeypatch):
    """Each kind of call the engine makes (prefill and decode, one row and several) compiles even where dynamo's
    recompile limit is lower than their number: past it dynamo would run the forward uncompiled, without hybrid's
    kernels (on the GPU: HF's eager attention inside a recorded graph, and out of memory)."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.utils import counters
    monkeypatch.setattr(dynamo_config, "recompile_limit", 1)
    engine = Engine(zoo.build("llama"), compile="hybrid-eager", max_num_seqs=4)
    before = counters["frames"]["ok"]
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=4))
    compiled = counters["frames"]["ok"] - before
    torch._dynamo.reset()
    assert compiled >= 2, f"only {compiled} graphs compiled: the others ran eagerly"  # packed steps, decodes
    assert [o.token_ids for o in outs] == [hf_greedy("llama", p, 4) for p in PROMPTS]
