"""Soak: a few hundred requests of random lengths and sampling parameters arrive while others run, through
add_request / step, generate and streams left early, with random aborts and injected step failures (before a launch,
after it, while reading it) under a small cache that preempts. Afterwards every request has exactly one final
output (finished, aborted or failed), its events are its tokens, the requests nothing touched have the tokens they
have alone, and every cache block and state row is free. The GPU variant runs the same with CUDA graphs on."""
import itertools
import random

import pytest
import torch

from runtime import zoo
from runtime.engine import Engine, SamplingParams
from test_engine_faults import assert_idle, within


class Faults:
    """Wrap a runner's launch and finish: each call raises with probability ``p`` (before the real launch, after
    it, or instead of reading the step)."""

    def __init__(self, engine: Engine, rng: random.Random, p: float):
        self.rng, self.p, self.count = rng, p, 0
        runner = engine.runner
        launch, finish = runner.launch, runner.finish

        def faulty_launch(step, ahead=None):
            self._maybe("before launch")
            pending = launch(step, ahead)
            self._maybe("after launch")
            return pending

        def faulty_finish(pending):
            self._maybe("in finish")
            return finish(pending)
        runner.launch, runner.finish = faulty_launch, faulty_finish

    def _maybe(self, where: str) -> None:
        if self.rng.random() < self.p:
            self.count += 1
            raise RuntimeError(f"injected fault {where}")


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    sampled = rng.random() < 0.5
    return SamplingParams(max_tokens=rng.randint(1, 10),
                          temperature=rng.uniform(0.5, 1.5) if sampled else 0.0,
                          top_k=rng.choice([0, 5, 50]) if sampled else 0,
                          top_p=rng.choice([1.0, 0.9, 0.5]) if sampled else 1.0,
                          seed=rng.randrange(2 ** 32) if sampled else None,
                          stop_token_ids=tuple(rng.sample(range(vocab), 16)) if rng.random() < 0.3 else (),
                          ignore_eos=rng.random() < 0.5)


def soak(make_engine, num_requests: int, seed: int) -> None:
    rng = random.Random(seed)
    engine = make_engine()
    vocab = engine.vocab_size
    faults = Faults(engine, rng, p=0.015)
    events: dict[int, list] = {}
    step = engine.step

    def recording_step():  # every event of every request, whichever call drove the step
        out = step()
        for e in out:
            events.setdefault(e.request_id, []).append(e)
        return out
    engine.step = recording_step
    specs = [([rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))], random_params(rng, vocab))
             for _ in range(num_requests)]
    todo = list(specs)
    ids: dict[int, tuple] = {}
    streamed: dict[int, list] = {}

    def run():
        while todo or engine.has_unfinished():
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                if todo:
                    spec = todo.pop()
                    ids[engine.add_request(*spec)] = spec
            roll = rng.random()
            if roll < 0.03 and todo:  # a stream over new requests, left after a few events
                batch = [todo.pop() for _ in range(min(len(todo), rng.randint(1, 2)))]
                gen = engine.stream([p for p, _ in batch], [sp for _, sp in batch])
                got = list(itertools.islice(gen, rng.randint(1, 8)))  # queued at the first event
                gen.close()
                rids = sorted(set(engine._seqs) - set(ids))  # the stream's, in its order
                assert len(rids) == len(batch)
                for rid, spec in zip(rids, batch):
                    ids[rid] = spec
                    streamed[rid] = [e.token_id for e in got if e.request_id == rid and e.token_id is not None]
            elif roll < 0.05 and todo:  # a generate call over new requests
                batch = [todo.pop() for _ in range(min(len(todo), rng.randint(1, 3)))]
                outs = engine.generate([p for p, _ in batch], [sp for _, sp in batch])
                for out, spec in zip(outs, batch):
                    ids[out.request_id] = spec
                    assert out.finish_reason in ("stop", "length", "error")
            else:
                engine.step()
            live = [r for r in ids if engine.output(r).finish_reason is None]
            if live and rng.random() < 0.05:
                assert engine.abort(rng.choice(live))
    within(240, run)
    assert len(ids) == num_requests and faults.count > 0
    assert_idle(engine)

    reasons = {}
    for rid, (prompt, params) in ids.items():
        out = engine.output(rid)
        reasons[rid] = out.finish_reason
        assert out.finish_reason in ("stop", "length", "abort", "error"), (rid, out)
        mine = events.get(rid, [])
        finals = [e for e in mine if e.finished]
        assert len(finals) == (0 if out.finish_reason == "abort" else 1), (rid, out, finals)
        assert [e.token_id for e in mine if e.token_id is not None] == out.token_ids
        assert (out.error is not None) == (out.finish_reason == "error")
        assert len(out.token_ids) <= params.max_tokens and out.prompt_token_ids == prompt
        if rid in streamed:  # what the stream's consumer took is a prefix of the output
            assert streamed[rid] == out.token_ids[:len(streamed[rid])]
    alone = make_engine()
    for rid, (prompt, params) in ids.items():
        out = engine.output(rid)
        if out.finish_reason in ("stop", "length"):
            want = alone.generate([prompt], params)[0]
            assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason), (rid, prompt, params)
    counts = {r: sum(v == r for v in reasons.values()) for r in ("stop", "length", "abort", "error")}
    assert all(counts.values()), counts  # the soak reached every ending
    assert engine.blocks is None or engine.scheduler.num_preemptions > 0  # (SSM rows alone only limit admission)


def budget(name: str, device: str, blocks: int, block_size: int, state_rows: int) -> int:
    """Cache bytes for ``blocks`` blocks next to ``state_rows`` SSM state rows of zoo model ``name``."""
    from runtime.engine.cache import discover_layers
    from runtime.hf import cache_kwarg
    model = zoo.build(name, device=device)
    specs = discover_layers(model, cache_kwarg(model))
    return (blocks * block_size * sum(s.bytes_per_token(model.dtype) for s in specs)
            + state_rows * sum(s.bytes_per_state_row() for s in specs))


@pytest.mark.parametrize("name, num_requests", [("llama", 200), ("bamba", 50)])
def test_soak_cpu(name, num_requests):
    """llama: paged blocks only; bamba: blocks and SSM state rows, prompts prefilled in chunks (and those of one
    length together: a cache of fewer blocks, so that its fewer steps still preempt)."""
    cache = budget(name, "cpu", 48 if name == "llama" else 36, 4, 8)

    def make_engine():
        return Engine(zoo.build(name), compile=None, block_size=4, cache_memory=cache, max_num_seqs=8,
                      max_prefill_tokens=16)
    soak(make_engine, num_requests, seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", ["llama", "mamba2", "jamba", "deepseek_v2"])
def test_soak_gpu_cuda_graphs(name):
    """The engine's GPU default, compile="hybrid-cudagraphs" (passes, Inductor, recorded decode steps), fp32: paged
    attention, SSM state rows with chunked prefill (Mamba2), with whole prefills next to attention and MoE (Jamba),
    paged MLA decode (DeepSeek-V2)."""
    cache = budget(name, "cuda", 48, 4, 8)
    engines = []

    def make_engine():  # each engine compiles afresh (dynamo's recompile limit counts every engine's graphs)
        torch._dynamo.reset()
        engines.append(Engine(zoo.build(name, device="cuda"), compile="hybrid-cudagraphs", block_size=4,
                              cache_memory=cache, max_num_seqs=8, max_prefill_tokens=16))
        return engines[-1]
    try:
        soak(make_engine, 200, seed=1)
        assert all(e.runner.graphs_enabled for e in engines)  # decode steps ran as recorded graphs throughout
    finally:
        torch._dynamo.reset()
