"""Tensor parallelism on the CPU: two processes over gloo, each an Engine over its shard (runtime/distributed). Greedy
tokens equal the single-process engine's for dense, MoE (Mixtral; gpt_oss: sinks, biases, interleaved gate-up), MLA +
MoE (DeepSeek-V3, through hybrid's passes) and Mamba2 + attention (Bamba: mixers replicated) families, and with
experts split by index (expert parallelism) where the experts allow it; both ranks
produce the same tokens, sampled ones included; a block whose shards do not sum to it stays whole."""
import json
import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from runtime import zoo
from runtime.engine import Engine, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 29)), [40, 41, 42]]
#: (zoo name, compile mode): hybrid-eager runs hybrid's passes over the sharded modules
FAMILIES = [("llama", None), ("mixtral", "hybrid-eager"), ("gpt_oss", None), ("deepseek_v3", "hybrid-eager"),
            ("bamba", None)]
#: expert parallelism: experts split by index (qwen3_moe, deepseek_v3, gpt_oss: biases go with their experts); mixtral's
#: 5 experts do not split over 2 ranks and fall back to the width split, saying why
EP_FAMILIES = [("qwen3_moe", None), ("deepseek_v3", "hybrid-eager"), ("mixtral", None), ("gpt_oss", None)]


def _params():
    return [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6),
            SamplingParams(max_tokens=6, temperature=0.9, top_k=20)]  # unseeded: rank 0's samples are everyone's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broken(torch.nn.Module):
    """gate/up/down projections whose output is normalised after down_proj: shards do not sum to it."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(8, 16, bias=False)
        self.down_proj = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        y = self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return y / y.norm(dim=-1, keepdim=True)


def _worker(rank: int, port: int, out_dir: str):
    sys.path.insert(0, ROOT)
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from runtime.distributed import tensor_parallel as tp
    result = {}
    torch.manual_seed(rank)  # the ranks' RNGs differ: sampled tokens must still agree
    from compiler.report import collect
    for name, compile in FAMILIES:
        with collect() as report:
            engine = Engine(zoo.build(name), compile=compile, tensor_parallel=2)
            outs = engine.generate(PROMPTS, _params())
        result[name] = {"tokens": [o.token_ids for o in outs], "split": engine.shard_report.split,
                        "replicated": engine.shard_report.replicated,
                        "rewritten": sorted({r.kind for r in report.results if r.status == "rewritten"})}
        torch._dynamo.reset()
    for name, compile in EP_FAMILIES:
        engine = Engine(zoo.build(name), compile=compile, tensor_parallel=2, expert_parallel=True)
        outs = engine.generate(PROMPTS, _params())
        result["ep:" + name] = {"tokens": [o.token_ids for o in outs], "split": engine.shard_report.split}
        torch._dynamo.reset()
    torch.manual_seed(0)
    block = Broken()
    wrapped, why = tp._try_block(block, lambda b: tp._shard_mlp(b, rank, 2), dist.group.WORLD, torch.randn(1, 3, 8),
                                 1e-4)
    result["broken"] = [wrapped is None, why]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("name,compile", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_two_ranks_give_the_single_process_tokens(ranks, name, compile):
    engine = Engine(zoo.build(name), compile=compile)
    want = [o.token_ids for o in engine.generate(PROMPTS[:2], SamplingParams(max_tokens=6))]
    torch._dynamo.reset()
    r0, r1 = ranks[0][name], ranks[1][name]
    assert r0["tokens"][:2] == want
    assert r0["tokens"] == r1["tokens"] and len(r0["tokens"][2]) == 6  # the sampled request too
    assert any(": attention," in s for s in r0["split"]), r0
    if name == "bamba":
        assert any("ssm mixer kept whole" in s for s in r0["replicated"]), r0
    if name in ("mixtral", "gpt_oss", "deepseek_v3"):
        assert any(": MoE," in s for s in r0["split"]), r0
    if compile is not None:  # hybrid's region passes rewrite the sharded blocks (proven on their partial sums)
        assert r0["rewritten"] == {"mixtral": ["moe"], "deepseek_v3": ["mla", "moe"]}[name], r0
    if name == "gpt_oss":
        assert any("interleaved gate-up" in s for s in r0["split"]), r0


@pytest.mark.parametrize("name,compile", EP_FAMILIES, ids=[f[0] for f in EP_FAMILIES])
def test_expert_parallel_gives_the_single_process_tokens(ranks, name, compile):
    engine = Engine(zoo.build(name), compile=compile)
    want = [o.token_ids for o in engine.generate(PROMPTS[:2], SamplingParams(max_tokens=6))]
    torch._dynamo.reset()
    r0, r1 = ranks[0]["ep:" + name], ranks[1]["ep:" + name]
    assert r0["tokens"][:2] == want and r0["tokens"] == r1["tokens"]
    moe = [s for s in r0["split"] if ": MoE," in s]
    assert moe, r0
    if name != "mixtral":
        assert all("experts 0-" in s and "on this rank" in s for s in moe), moe
        assert all("experts 0-" not in s for s in r1["split"]), r1  # rank 1 holds the upper half
    else:
        assert all("experts by index failed" in s for s in moe), moe


def test_a_block_whose_shards_do_not_sum_stays_whole(ranks):
    for r in ranks:
        kept, why = r["broken"]
        assert kept and "differs from the block" in why


def test_expert_parallel_needs_tensor_parallel():
    with pytest.raises(ValueError, match="expert_parallel=True splits experts over the tensor_parallel ranks"):
        Engine(zoo.build("qwen3_moe"), compile=None, expert_parallel=True)


def test_tensor_parallel_needs_a_process_group():
    with pytest.raises(ValueError, match=r"tensor_parallel=2 needs torch.distributed initialised: run the script "
                                         r"under `torchrun --nproc-per-node 2`"):
        Engine(zoo.build("llama"), compile=None, tensor_parallel=2)


def test_cli_starts_its_ranks_and_prints_once():
    """``hybrid generate --tensor-parallel 2`` outside torchrun relaunches itself on two ranks (torchrun, gloo);
    rank 0 prints the outputs, which equal one process's."""
    import subprocess
    cmd = [sys.executable, "-m", "runtime.cli", "generate", "llama", "--prompt-ids", "5,6,7,8", "--prompt-ids",
           "9,10,11", "--max-new-tokens", "5", "--compile", "none", "--json"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    one = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    two = subprocess.run(cmd + ["--tensor-parallel", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    tokens = lambda out: [o["token_ids"] for o in json.loads(out)["outputs"]]  # noqa: E731
    assert tokens(two.stdout) == tokens(one.stdout)
    assert two.stderr.count("loading llama") == 1


def _dying_worker(rank: int, port: int, out_dir: str):
    """Rank 1 exits in the middle of generating (at its third model launch); rank 0 records what its generate
    raised, how long it took, and what a second call raises."""
    import time
    sys.path.insert(0, ROOT)
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from runtime.distributed import RankFailure
    engine = Engine(zoo.build("llama"), compile=None, tensor_parallel=2)
    if rank == 1:
        launch, calls = engine.runner.launch, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                os._exit(7)
            return launch(*args, **kwargs)
        engine.runner.launch = dying
    result, t0 = {}, time.perf_counter()
    for attempt in ("first", "second"):
        try:
            engine.generate(PROMPTS, SamplingParams(max_tokens=20))
            result[attempt] = "returned"
        except RankFailure as e:
            result[attempt] = str(e)
        result[attempt + "_s"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"dying{rank}.json"), "w") as f:
        json.dump(result, f)


def test_a_rank_that_dies_stops_the_others_with_a_clear_error(tmp_path):
    """Two independent processes (no launcher to end the survivor): when rank 1 exits mid-generate, rank 0's
    generate raises RankFailure naming the failed step and what to do, within seconds, and the engine stays stopped
    (the next call raises at once) instead of running steps the other rank never joins."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_dying_worker, args=(r, port, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    alive = [p.is_alive() for p in procs]
    for p in procs:
        p.kill() if p.is_alive() else None
    assert alive == [False, False], "a rank hung"
    assert procs[1].exitcode == 7 and procs[0].exitcode == 0
    got = json.loads((tmp_path / "dying0.json").read_text())
    assert got["first"].startswith("Engine: a step failed on rank 0 of 2 (") and "start every rank again" in got["first"]
    assert got["second"] == got["first"] and got["second_s"] - got["first_s"] < 1.0
    assert got["first_s"] < 60
