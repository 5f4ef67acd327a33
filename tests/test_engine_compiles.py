"""After ``Engine.warmup()`` a stream of requests compiles nothing: no dynamo graph, and on the GPU no Triton kernel
variant.

Each new graph or kernel variant stalls a server for seconds (a graph) or up to a second (a kernel) at an arbitrary
time after its warm-up. Graphs: the packed steps' structure changes with what a step holds (decode rows beside prompt
chunks for state layers, MLA's absorbed and expanded forms together), dynamo compiles a size of 1 apart, and a guard
on sizes that merely happened to be equal splits a graph in two; the warm-up runs each such step (warmup.py) and
the engine compiles without duck shaping. Kernels: Triton specialises a plain integer on being 1 or divisible by 16,
so kernels mark the token, sequence and table counts ``do_not_specialize``. The stream has prompts of every length
class arriving while others decode, so its steps meet odd and even token counts, one and many sequences, short and
long block tables."""
import random

import pytest
import torch

from hybrid_kernels.library import compiled_kernels
from runtime import zoo
from runtime.engine import Engine, SamplingParams


def graphs_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def stream(engine: Engine, rng: random.Random, num_requests: int, max_prompt: int) -> int:
    """Requests arriving 0-3 per step while others run; returns the number of steps."""
    vocab, pending, steps = engine.vocab_size, num_requests, 0
    max_prompt = min(max_prompt, (engine.max_model_len or max_prompt + 12) - 12)
    while pending or engine.has_unfinished():
        for _ in range(min(pending, rng.choice([0, 0, 1, 1, 2, 3]))):
            n = rng.choice([1, 2, 3, rng.randint(4, 16), rng.randint(17, max_prompt)])
            engine.add_request([rng.randrange(3, vocab) for _ in range(n)],
                               SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True))
            pending -= 1
        engine.step()
        steps += 1
    return steps


def check_stream(engine: Engine, seed: int) -> None:
    engine.warmup(max_context=512)
    kernels, graphs = compiled_kernels(), graphs_compiled()
    steps = stream(engine, random.Random(seed), num_requests=60, max_prompt=300)
    new = {k: v - kernels.get(k, 0) for k, v in compiled_kernels().items() if v != kernels.get(k, 0)}
    new_graphs = graphs_compiled() - graphs
    torch._dynamo.reset()
    assert steps > 60
    assert not new_graphs, f"dynamo compiled {new_graphs} graphs after the warm-up ({steps} steps)"
    assert not new, f"Triton compiled kernel variants after the warm-up ({steps} steps): {new}"


@pytest.mark.parametrize("name", ["deepseek_v2", "bamba"])
def test_a_warmed_up_engine_compiles_no_graph_while_serving(name):
    """The CPU check (hybrid's passes and reference ops): MLA with MoE, and attention beside Mamba2."""
    engine = Engine(zoo.build(name), compile="hybrid-eager", max_num_seqs=8, max_prefill_tokens=64,
                    max_num_batched_tokens=128, cache_memory=64 << 20)
    check_stream(engine, seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles kernels on the GPU only")
@pytest.mark.parametrize("name", ["llama", "mixtral", "deepseek_v2", "bamba", "qwen3_next"])
def test_a_warmed_up_engine_compiles_nothing_while_serving_on_the_gpu(name):
    model = zoo.build(name, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, compile="hybrid-cudagraphs", max_num_seqs=8, max_prefill_tokens=64,
                    max_num_batched_tokens=128, cache_memory=256 << 20)
    check_stream(engine, seed=1)
