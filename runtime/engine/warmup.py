"""``warm_up``: compile and record before serving what the first requests would otherwise wait for.

Without it the first request of each new shape pays for it: dynamo and Inductor compile the prefill and decode
graphs on first use, Triton compiles each launch configuration that an op picks for a new token count, and the
runner records one CUDA graph per (decode batch bucket, key width) the first time a decode step needs it (tens of
milliseconds each, seconds where a kernel compiles too). A server that warms up lazily measures compilation under
its first load, not serving. vLLM captures its decode graphs at startup for the same reason.

What it runs:
1. Call kinds (``call_kinds``, the workload ``hybrid export`` traces too): one-token and several-token prompts, prompts
   of several lengths together, decodes of one and several sequences over one and several blocks, chunks continuing
   a prompt, and, with state layers, prompts around every scan chunk length: each branch the model takes on a size
   compiles here.
2. Mixed steps (``_mixed``): one and two sequences decoding while one and two prompts arrive, and for MLA long and
   short prompts together, so the packed steps' branches (decode rows of state layers, MLA's two forms) compile here.
3. Prefills: requests through the engine's own scheduler with step token counts 16, 64, 256, ... up to the step
   budget (``max_num_batched_tokens``), each request decoding two tokens, so the compiled graphs, their guards and
   the ops' launch configurations for these token counts exist before the first real request.
4. CUDA graphs (``compile="hybrid-cudagraphs"``): one decode graph per batch bucket up to ``max_num_seqs`` and per
   key width (powers of two of blocks) up to ``max_context`` tokens, recorded over padding rows only (they read and
   write the reserved block 0; state rows are restored). Longer contexts record their graphs on first use.

Nothing of the warm-up stays in the engine: its requests are finished and freed, the engine's statistics and expert
loads are reset. It must run while the engine has no request (every tensor-parallel rank calls it alike).
"""
from __future__ import annotations

import logging
import time

from hybrid_kernels.mla.ops import EXPANDED_MIN_QUERIES

from .model_runner import DECODE_BUCKETS, decode_bucket
from .sequence import SamplingParams

log = logging.getLogger(__name__)
#: warm-up contexts beyond this are left to first use (each width is one more graph per batch bucket)
DEFAULT_MAX_CONTEXT = 8192


def warm_up(engine, max_context: int | None = None, progress=None) -> dict:
    """Warm ``engine`` up (module docstring). ``max_context``: the longest context whose decode graphs are recorded
    now (default: the model's length limit, the cache's capacity or 8192 tokens, whichever is least). ``progress``:
    called with one line of text per phase (default: the engine's logger). Returns what it did: prefill token
    counts, graphs recorded, seconds."""
    if engine.has_unfinished():
        raise RuntimeError("Engine.warmup() runs before the first request: this engine has requests in flight")
    say = progress or (lambda msg: log.info("hybrid engine: %s", msg))
    runner, t0 = engine.runner, time.perf_counter()
    capacity = engine.blocks.num_blocks * engine.blocks.block_size if engine.blocks is not None else None
    limits = [x for x in (max_context or DEFAULT_MAX_CONTEXT, engine.max_model_len, capacity) if x]
    context = min(limits)
    stats = dict(engine.stats)
    runs = call_kinds(engine, engine.blocks.block_size if engine.blocks is not None else 16,
                      min(engine.scheduler.max_prefill_tokens, max(8, context // 2)), context)
    for i, (prompts, n) in enumerate(runs):
        say(f"warm-up: call kind {i + 1} of {len(runs)} ({len(prompts)} x {len(prompts[0])} tokens, {n} new; "
            f"{time.perf_counter() - t0:.1f} s)")
        _check(engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True)))
    mixed = _mixed(engine, min(engine.scheduler.max_prefill_tokens, max(8, context // 2)), context, say)
    counts = _prefills(engine, context, say)
    graphs = _graphs(engine, context, say) if runner.graphs_enabled else 0
    engine.stats = stats
    engine.reset_expert_loads()
    seconds = time.perf_counter() - t0
    say(f"warm-up done in {seconds:.1f} s: {mixed} mixed steps, prefill steps of {counts} tokens, {graphs} decode "
        f"graphs recorded (contexts up to {context} tokens)")
    return dict(prefill_tokens=counts, mixed_steps=mixed, graphs=graphs, max_context=context, seconds=seconds)


def _mixed(engine, chunk: int, max_len: int, say) -> int:
    """Packed steps of decodes beside prompts, as requests arriving while others decode make them: one and two
    decoding sequences beside one and two prompts, and for MLA a prompt long enough for the expanded form beside
    short ones (both forms in one step). State layers take another branch with decode rows in a step, MLA layers
    with both forms, and dynamo compiles a size of 1 apart (one decode row, one prompt, one long sequence), so each
    of these is a graph of its own that a server would otherwise compile in the middle of its first mixed load.
    Returns the mixed steps run."""
    sched = engine.scheduler
    if not sched.packed or sched.max_num_seqs < 2:
        return 0
    p = lambda n, seed: prompt_ids(engine, max(1, min(n, max_len - 10)), seed)  # noqa: E731
    long = EXPANDED_MIN_QUERIES  # a prompt (or its first chunk) of at least this many tokens attends expanded
    mla = engine.runner.paged_latent and long <= min(chunk, max_len - 10)
    bs = engine.blocks.block_size if engine.blocks is not None else 16
    # contexts within one cache block and beyond it (a block table of one column is a graph of its own)
    shapes = [(d, [3 + j for j in range(c)], ctx) for ctx in (2, bs + 3) for d in (1, 2) for c in (1, 2)]
    if mla:
        shapes += [(1, [long], bs + 3), (2, [3, long + 1], bs + 3), (1, [long + 2, long + 4], bs + 3)]
    shapes = [(d, lens, ctx) for d, lens, ctx in shapes if d + len(lens) <= sched.max_num_seqs
              and max(lens) + ctx + 10 <= max_len]
    mixed = 0
    for i, (d, lens, ctx) in enumerate(shapes):
        say(f"warm-up: {d} decoding beside prompts of {lens} tokens ({i + 1}/{len(shapes)})")
        first = [engine.add_request(p(ctx + k, 60 + k), SamplingParams(max_tokens=8, ignore_eos=True))
                 for k in range(d)]
        while not all(engine.output(r).token_ids for r in first):
            engine.step()
        ids = [engine.add_request(p(n, 70 + k), SamplingParams(max_tokens=2, ignore_eos=True))
               for k, n in enumerate(lens)]
        steps = engine.stats.get("packed_steps", 0)
        while engine.has_unfinished():
            engine.step()
        mixed += engine.stats.get("packed_steps", 0) - steps
        _check([engine.output(r) for r in first + ids])
    return mixed


def _prefills(engine, context: int, say) -> list[int]:
    """Prefill steps of 16, 64, 256, ... tokens up to the step budget: prompts of at most a chunk
    (``max_prefill_tokens``) each, as many as the step takes; each decodes two tokens."""
    sched = engine.scheduler
    chunk = max(1, min(sched.max_prefill_tokens, context - 2))
    budget = min(sched.max_num_batched_tokens, chunk * sched.max_prefill_seqs, chunk * sched.max_num_seqs)
    if engine.blocks is not None:  # every prompt keeps its blocks until the call ends: use at most half the cache
        budget = max(1, min(budget, engine.blocks.num_free * engine.blocks.block_size // 2))
    counts, n = [], 16
    while True:
        counts.append(min(n, budget))
        if n >= budget:
            break
        n *= 4
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    done = []
    for i, total in enumerate(counts):
        length = min(chunk, total)
        prompts = [[3 + (7 * j + 11 * k + i) % max(1, vocab - 3) for k in range(length)]
                   for j in range(max(1, total // length))]
        done.append(len(prompts) * length)
        say(f"warm-up: prefill of {len(prompts)} x {length} tokens ({i + 1}/{len(counts)})")
        _check(engine.generate(prompts, params))
    return done


def _check(outs) -> None:
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"Engine.warmup(): a warm-up request failed ({failed[0].error})")


def _graphs(engine, context: int, say) -> int:
    """Record the decode graphs of every (batch bucket, key width) not recorded yet; returns how many."""
    runner = engine.runner
    buckets = [b for b in DECODE_BUCKETS if b <= decode_bucket(engine.scheduler.max_num_seqs)]
    widths = [0]
    if engine.cache.attention:
        bs = engine.blocks.block_size
        widths, w = [], bs
        while True:
            widths.append(w)
            if w >= context:
                break
            w *= 2
    recorded, t0 = 0, time.perf_counter()
    for i, batch in enumerate(buckets):
        for width in widths:
            if runner.record_idle(batch, width):
                recorded += 1
        say(f"warm-up: decode graphs of batch {batch} for {len(widths)} context widths "
            f"({i + 1}/{len(buckets)} batch sizes, {time.perf_counter() - t0:.1f} s)")
    return recorded


def prompt_ids(engine, n: int, seed: int) -> list[int]:
    v = engine.vocab_size
    return [(seed * 7 + 3 * i) % (v - 1) + 1 for i in range(n)]


def call_kinds(engine, block_size: int, chunk: int, max_len: int) -> list[tuple[list[list[int]], int]]:
    """Requests that reach every kind of model call the engine makes: a one-token prompt; one and several sequences
    decoding over one and several cache blocks; prefills of several tokens; and, where prompts are chunked, chunks
    continuing a prompt, of one token and of several."""
    p = lambda n, seed: prompt_ids(engine, min(n, max_len - 3), seed)  # noqa: E731
    long = 2 * block_size + 3
    # several sequences reach a decode step together only after each prompt's prefill step and the decode steps
    # between them (the scheduler interleaves): four new tokens each get the pairs there
    runs = [([p(1, 1)], 3), ([p(5, 2), p(3, 3)], 4), ([p(long, 4)], 2), ([p(long, 5), p(long + 7, 6)], 4)]
    if engine.prefill_note is None and chunk + 3 < max_len - 3:
        runs += [([p(chunk + 3, 7)], 2), ([p(chunk + 1, 8)], 2)]
        if engine.scheduler.max_prefill_seqs > 1:  # chunks of two prompts together, fresh and then continuing
            runs += [([p(chunk + 3, 15), p(chunk + 2, 16)], 2)]
    if engine.scheduler.packed and EXPANDED_MIN_QUERIES + 3 <= min(chunk, max_len - 3):
        # a short prompt beside a long one in one packed step: MLA layers attend in both forms (attention.py)
        runs += [([p(5, 9), p(EXPANDED_MIN_QUERIES + 3, 10)], 2)]
    # a state layer's scan may branch on sizes where no range shows it (whole scan chunks or a padded one, one chunk
    # or several), each branch a program: prompts around every scan chunk length, fresh and continuing a chunk
    if engine.cache.states:
        longest = min(2 * chunk if engine.prefill_note is None else chunk, max_len - 3)
        edges = {n for c in scan_chunks(engine.model) for k in (1, 2) for n in (k * c - 1, k * c, k * c + 1)}
        lengths = sorted({2, 3, 4, 5} | edges | {chunk + n for n in {2, 3, 4, 5} | edges})
        runs += [([p(n, 20 + n)], 1) for n in lengths if 2 <= n <= longest]
    # a short length limit: every request within it, its new tokens included (cut prompts stay at least a token)
    return [([q[:max(1, max_len - n)] for q in prompts], min(n, max_len - 1)) for prompts, n in runs]


def scan_chunks(model) -> set[int]:
    """The chunk lengths a model's scans may pad to: its configs' ``*chunk_size`` fields, and 64 (HF's chunked gated
    delta rule)."""
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
    found = {v for c in configs for k, v in c.to_dict().items() if k.endswith("chunk_size") and isinstance(v, int)}
    return {c for c in found | {64} if c > 1}
