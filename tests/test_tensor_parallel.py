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
#: one xdist worker takes the whole module (pytest -n 2 --dist loadgroup), so the ranks' fixture (two processes that
#: run every family, about two minutes) runs once, not once per worker
pytestmark = pytest.mark.xdist_group("tensor_parallel")
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 29)), [40, 41, 42]]
#: (zoo name, compile mode): hybrid-eager runs hybrid's passes over the sharded modules
#: Mamba2 mixers split by head: bamba's one head group (B / C replicated, the norm's sum of squares all-reduced),
#: mamba2's two groups (B / C and the norm by group); Qwen3-Next's Gated DeltaNet by key head
FAMILIES = [("llama", None), ("mixtral", "hybrid-eager"), ("gpt_oss", None), ("deepseek_v3", "hybrid-eager"),
            ("bamba", None), ("mamba2", "hybrid-eager"), ("qwen3_next", None)]
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


def _skewed_gpt_oss():
    """gpt_oss whose router bias sends every token to experts 0 and 1 (both on rank 0 when split in halves)."""
    model = zoo.build("gpt_oss")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.bias[:2] += 10.0
    return model


def _eplb_phase() -> dict:
    """Expert load balancing: serve with contiguous experts, count, plan two redundant slots, serve again placed."""
    from runtime.distributed import balance
    first = Engine(_skewed_gpt_oss(), compile=None, tensor_parallel=2, expert_parallel=True)
    tokens = [[o.token_ids for o in first.generate(PROMPTS[:2], SamplingParams(max_tokens=6))]]
    loads, before = first.expert_loads(), first.expert_balance()
    plan = {block: balance.plan_placement(counts, 2, redundant=2) for block, counts in loads.items()}
    placed = Engine(_skewed_gpt_oss(), compile=None, tensor_parallel=2, expert_parallel=True, expert_placement=plan)
    tokens.append([o.token_ids for o in placed.generate(PROMPTS[:2], SamplingParams(max_tokens=6))])
    return dict(tokens=tokens, loads=loads, before=before, after=placed.expert_balance(),
                split=[s for s in placed.shard_report.split if ": MoE," in s])


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
    result["eplb"] = _eplb_phase()
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
    if name == "bamba":
        assert any("SSM mixer, 2 of 4 heads per rank, B / C replicated" in s and "all-reduced" in s
                   for s in r0["split"]), r0
    if name == "mamba2":
        assert any("SSM mixer, 4 of 8 heads per rank, B / C by group" in s for s in r0["split"]), r0
    if name == "qwen3_next":
        assert any("delta mixer, 1 of 2 key heads (2 of 4 value heads)" in s for s in r0["split"]), r0
    if name in ("mixtral", "gpt_oss", "deepseek_v3"):
        assert any(": MoE," in s for s in r0["split"]), r0
    if name != "mamba2":
        assert any(": attention," in s for s in r0["split"]), r0
    if compile is not None:  # hybrid's region passes rewrite the sharded blocks (proven on their partial sums)
        assert r0["rewritten"] == {"mixtral": ["moe"], "deepseek_v3": ["mla", "moe"], "mamba2": ["ssm"]}[name], r0
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


def test_expert_load_balancing_evens_the_ranks_and_keeps_the_tokens(ranks):
    """Every token routed to experts 0 and 1: with contiguous experts rank 0 computes every route (imbalance 2.0);
    placed by balance.plan_placement from the counted loads, with two redundant slots (replicas of 0 and 1 on both
    ranks), the ranks' measured loads are within 10% and the tokens are the single-process engine's."""
    engine = Engine(_skewed_gpt_oss(), compile=None)
    want = [o.token_ids for o in engine.generate(PROMPTS[:2], SamplingParams(max_tokens=6))]
    r0, r1 = ranks[0]["eplb"], ranks[1]["eplb"]
    assert r0["tokens"] == [want, want] == r1["tokens"]
    assert r0["loads"] == r1["loads"] and len(r0["loads"]) == 2  # the router is replicated: the same counts
    for block, counts in r0["loads"].items():
        assert counts[2:] == [0, 0] and counts[0] == counts[1] > 0
        assert r0["before"][block]["imbalance"] == 2.0 and r0["before"][block]["computed"][1] == 0
        assert r0["after"][block]["imbalance"] <= 1.1, r0["after"]
    assert all("2 of them replicas" in s for s in r0["split"] + r1["split"]), r0["split"]


def test_placement_plans_and_checks():
    from runtime.distributed import balance
    counts = [100, 90, 10, 10, 5, 5, 3, 1]
    plain = balance.contiguous(8, 2)
    plan = balance.plan_placement(counts, 2, redundant=2)
    balance.check_placement(plan, 8, 2)
    assert balance.imbalance(balance.rank_loads(counts, plain)) > 1.6
    assert balance.imbalance(balance.rank_loads(counts, plan)) < 1.05
    assert sorted(e for own in plan for e, _, n in own if n > 1) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="repeat"):
        balance.check_placement([[(0, 0, 2), (1, 0, 1)], [(0, 0, 2), (2, 0, 1)]], 3, 2)
    with pytest.raises(ValueError, match="not fully placed"):
        balance.check_placement([[(0, 0, 2)], [(1, 0, 1)]], 2, 2)
    with pytest.raises(ValueError, match="multiple of the 2 ranks"):
        balance.plan_placement(counts, 2, redundant=1)
    with pytest.raises(ValueError, match="needs expert_parallel=True"):
        Engine(zoo.build("gpt_oss"), compile=None, expert_placement={})


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


def _one_rank_worker(rank: int, port: int, out_dir: str):
    """The tensor-parallel path over a one-rank group: every block is sharded and wrapped as at N ranks, but no
    collective runs (each is the identity at one rank), and the tokens are the plain engine's."""
    sys.path.insert(0, ROOT)
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from runtime.distributed import shard_model

    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran over a one-rank group")
    for name in ("all_reduce", "all_gather_tensor", "all_gather_single"):
        if hasattr(funcol, name):
            setattr(funcol, name, refuse)
    result = {}
    for name, compile in (("deepseek_v3", "hybrid-eager"), ("mixtral", None)):
        plain = Engine(zoo.build(name), compile=compile).generate(PROMPTS[:2], SamplingParams(max_tokens=6))
        torch._dynamo.reset()
        model = zoo.build(name)
        report = shard_model(model, dist.group.WORLD)
        sharded = Engine(model, compile=compile).generate(PROMPTS[:2], SamplingParams(max_tokens=6))
        torch._dynamo.reset()
        result[name] = dict(plain=[o.token_ids for o in plain], sharded=[o.token_ids for o in sharded],
                            split=report.split, errors=[o.error for o in sharded])
    with open(os.path.join(out_dir, "one.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_one_rank_runs_no_collective_and_gives_the_plain_tokens(tmp_path):
    mp.spawn(_one_rank_worker, args=(_free_port(), str(tmp_path)), nprocs=1)
    result = json.loads((tmp_path / "one.json").read_text())
    for name, r in result.items():
        assert r["split"], f"{name}: nothing was sharded"
        assert r["errors"] == [None, None]
        assert r["sharded"] == r["plain"], name


def test_cli_starts_its_ranks_and_prints_once():
    """``hybrid generate --tensor-parallel 2`` outside torchrun relaunches itself on two ranks (gloo);
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


def test_cli_rank_errors_are_one_line():
    """A bad request under ``--tensor-parallel 2``: every rank refuses it, the command says so once in one line and
    exits 2, as one process does (no launcher traceback)."""
    import subprocess
    cmd = [sys.executable, "-m", "runtime.cli", "generate", "llama", "--prompt-ids", "5,99999", "--compile", "none",
           "--tensor-parallel", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.count("hybrid: error:") == 1 and "outside the vocabulary" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]


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


def test_cli_saves_a_placement_and_starts_with_it(tmp_path):
    """``--save-expert-placement`` writes a placement balanced for the measured loads and says the imbalance;
    ``--expert-placement`` starts with it: same tokens, the ranks' measured loads more even."""
    import re
    import subprocess
    plan, again = tmp_path / "plan.json", tmp_path / "again.json"
    cmd = [sys.executable, "-m", "runtime.cli", "generate", "gpt_oss", "--prompt-ids", "5,6,7,8,9,10,11,12",
           "--prompt-ids", "20,21,22", "--max-new-tokens", "5", "--compile", "none", "--json", "--tensor-parallel", "2",
           "--expert-parallel"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    first = subprocess.run(cmd + ["--save-expert-placement", str(plan), "--redundant-experts", "2"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    second = subprocess.run(cmd + ["--expert-placement", str(plan), "--save-expert-placement", str(again)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    tokens = lambda out: [o["token_ids"] for o in json.loads(out)["outputs"]]  # noqa: E731
    assert tokens(first.stdout) == tokens(second.stdout)
    measured = [float(re.search(r"max / mean ([\d.]+) measured", r.stderr).group(1)) for r in (first, second)]
    assert measured[1] < measured[0], measured
    bad = subprocess.run(cmd[:-1] + ["--expert-placement", str(plan)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert bad.returncode == 2 and "add --expert-parallel" in bad.stderr
