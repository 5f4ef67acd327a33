"""Generation throughput: hybrid's engine vs HF ``generate`` (eager, and static cache + stock torch.compile).

    python bench/engine.py --out bench/results/engine.json                 # GPU, bf16, the three -shape models
    python bench/engine.py --models deepseek-v2-lite-shape --batches 1,64
    python bench/engine.py --smoke                                         # tiny zoo models, CPU

Workload (the runtime issue's): B requests of ``--prompt`` random tokens, ``--output`` new tokens each,
greedy, EOS ignored. Per variant: time to first token (until every one of the B requests has its first token,
whatever the steps: HF's batched prefill, the engine's padded prefills with decode steps between them, or packed
steps mixing the first requests' decodes with later prompts' chunks), then time per output token (TPOT: wall time
of the steps after that / their number) and decode throughput (B / TPOT). HF eager is measured on
``--eager-output`` new tokens (it is slow; per-token cost barely moves over that range), the others on
``--output``. Compiled variants are warmed up first (compilation and CUDA-graph recording are not timed).

Prefill roofline: the FLOPs of prefilling the B prompts at 790 TFLOP/s: two per weight a token meets (experts:
k of E; not the input embedding; the output head only at each prompt's last token) per prompt token, plus causal
attention's QK^T and PV over prompt * (prompt + 1) / 2 pairs per head and attention layer (at the expanded widths for
MLA); SSM / delta-rule scans are not counted. TTFT's share of it is "% prefill roofline".

Step roofline: the bytes one decode step must move at 4.3 TB/s: every weight the step touches (experts:
the expected number of distinct experts hit by B tokens under uniform routing, E(1 - (1 - k/E)^B); the
input embedding: B rows), the cache read at the mean decode context (prompt + output/2), SSM states read
and written once. Correctness: the engine's greedy tokens are compared with HF eager's (bf16 can flip
near-ties late in a sequence, so the mean agreeing prefix is reported).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import HBM_BPS, PEAK_FLOPS, log, write  # noqa: E402
import compiler  # noqa: E402
from runtime import zoo  # noqa: E402
from runtime.hf import quiet_transformers  # noqa: E402
from runtime.engine import Engine, SamplingParams  # noqa: E402

MODELS = ["deepseek-v2-lite-shape", "mamba2-2.7b-shape", "mixtral-8x7b-shape"]
VARIANTS = ["hf-eager", "hf-static-compile", "hybrid-engine"]
# hybrid-engine-tp1: the tensor-parallel code path on a one-rank process group (NCCL on the GPU, gloo on the CPU):
# a copy of the model sharded by runtime.distributed.shard_model (every split block wrapped in its all-reduce),
# so its TPOT against hybrid-engine in the same run is what the distributed path costs.
# hybrid-engine-padded: the engine with packed steps off (prefills as left-padded rows, decodes between them)
EXTRA_VARIANTS = ["hybrid-engine-tp1", "hybrid-engine-padded"]


def tag(msg):
    log("engine", msg)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- the step roofline --------------------------------------------------------------------------------
def num_experts(config) -> tuple[int, int]:
    e = next((getattr(config, k) for k in ("n_routed_experts", "num_local_experts", "num_experts")
              if getattr(config, k, None)), 0)
    return e, getattr(config, "num_experts_per_tok", 0) or 0


def weight_bytes_touched(model, batch: int) -> float:
    e, k = num_experts(model.config)
    hit = e * (1 - (1 - k / e) ** batch) if e else 0
    embed = model.get_input_embeddings().weight
    tied = embed is getattr(model.get_output_embeddings(), "weight", None)
    total = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if p is embed and not tied:
            nbytes = batch * p.shape[1] * p.element_size()
        elif e and ".experts." in name and p.dim() == 3 and p.shape[0] == e:
            nbytes *= hit / e
        total += nbytes
    return total


def step_roofline_ms(model, engine: Engine, batch: int, context: float) -> tuple[float, dict]:
    cache_per_token = sum(l.buf[0].numel() * l.buf.element_size() for l in engine.cache.attention)
    state_per_seq = sum(b[0].numel() * b.element_size() for l in engine.cache.states for b in l.buffers)
    parts = dict(weights=weight_bytes_touched(model, batch), cache=batch * context * cache_per_token,
                 states=2 * batch * state_per_seq)
    return sum(parts.values()) / HBM_BPS * 1e3, parts


def prefill_roofline_ms(model, engine: Engine, batch: int, prompt: int) -> float:
    """The module docstring's prefill roofline (ms) of ``batch`` prompts of ``prompt`` tokens."""
    cfg = model.config.get_text_config()
    e, k = num_experts(cfg)
    embed = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)
    per_token = 0.0
    for name, p in model.named_parameters():
        if p is embed or p is head or p.dim() < 2:
            continue
        fused = e and ".experts." in name and p.dim() == 3 and p.shape[0] == e
        listed = e and re.search(r"\.experts\.\d+\.", name)
        per_token += p.numel() * (k / e if fused or listed else 1)
    flops = 2 * per_token * batch * prompt + (2 * batch * head.numel() if head is not None else 0)
    if engine.cache.attention:
        heads = cfg.num_attention_heads
        qk = getattr(cfg, "qk_head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        v = getattr(cfg, "v_head_dim", None) or qk
        flops += len(engine.cache.attention) * batch * prompt * (prompt + 1) / 2 * 2 * heads * (qk + v)
    return flops / PEAK_FLOPS * 1e3


# -- variants -------------------------------------------------------------------------------------------
def hf_generate(model, prompts: torch.Tensor, new_tokens: int, static: bool) -> tuple[float, float, list]:
    """(ttft s, total s, generated ids) of one HF generate call."""
    cfg = copy.deepcopy(model.generation_config)
    # Never stop, like the engine's ignore_eos: an empty list of end tokens (None is filled back in from the model's
    # generation config by generate). min_new_tokens would mask the end token's logit instead, and the engine, which
    # does not, would then differ from HF wherever that token is the argmax.
    cfg.eos_token_id = []
    kw = dict(generation_config=cfg, do_sample=False, attention_mask=torch.ones_like(prompts), pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"

    def run(n):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompts, max_new_tokens=n, **kw)
        sync()
        return time.perf_counter() - t0, out

    run(2)  # first-call costs (kernel loading, cuBLAS handles) out of the timed calls
    ttft, _ = run(1)
    total, out = run(new_tokens)
    return ttft, total, out[:, prompts.shape[1]:].tolist()


def engine_generate(engine: Engine, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float, int, list, float]:
    """(seconds until every request has its first token, seconds after that, steps after that, generated ids,
    seconds of those steps the host was busy, i.e. not waiting for the device). The first figure is HF generate's
    TTFT of a batch whatever the engine's steps were (padded prefills with decode steps between them, or packed
    steps that mix the first requests' decodes with later prompts' chunks); every step is timed (a step ends on the
    host)."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts.tolist()]
    first = None  # seconds until the last request's first token
    after = wait = 0.0
    steps = 0
    start = time.perf_counter()
    pending = set(ids)  # requests without a token yet (from the step's events: no output objects built per step)
    while engine.has_unfinished():
        waited = engine.runner.wait_s
        t0 = time.perf_counter()
        events = engine.step()
        t1 = time.perf_counter()
        if first is not None:
            after += t1 - t0
            wait += engine.runner.wait_s - waited
            steps += 1
        else:
            pending.difference_update(e.request_id for e in events if e.token_id is not None)
            if not pending:
                first = t1 - start
    outs = [engine.output(i).token_ids for i in ids]
    return first, after, max(steps, 1), outs, after - wait


def kernel_table(events, steps: int, limit: int | None = None) -> None:
    """Device kernels of a profile by time, per step of ``steps`` (1: the whole profiled span)."""
    kernels = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
    print(f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  kernel (all {sum(e.count for e in kernels) / steps:.0f} "
          f"device ops per step)")
    for e in kernels[:limit]:
        print(f"{e.self_device_time_total / steps:9.1f} {e.count / steps:10.1f} "
              f"{e.self_device_time_total / e.count:8.2f}  {e.key[:100]}")


def profile_decode(engine: Engine, prompts: torch.Tensor, steps: int = 20, shapes: bool = False) -> None:
    """Where a decode step's wall time goes: host-side (Python, launches) vs GPU kernel time. ``shapes``: the steps
    run without CUDA graphs (the kernels are the ones the graphs hold: cuBLAS and Triton pick them per call), and
    the ops' device time is listed per input shape, so two engines' tables show which call of which op differs."""
    from torch.profiler import ProfilerActivity, profile
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for p in prompts.tolist():
        engine.add_request(p, params)
    while engine.stats["decode_steps"] == 0 or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    graphs, engine.runner.graphs_enabled = engine.runner.graphs_enabled, engine.runner.graphs_enabled and not shapes
    t0 = time.perf_counter()
    with profile(activities=acts, record_shapes=shapes) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - t0) / steps * 1e3
    engine.runner.graphs_enabled = graphs
    while engine.has_unfinished():
        engine.step()
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / steps / 1e3
    tag(f"profile B={prompts.shape[0]}: wall {wall:.3f} ms/step (profiled), GPU kernels {gpu:.3f} ms/step")
    print(events.table(sort_by="cpu_time_total", row_limit=30))
    kernel_table(events, steps)
    if shapes:
        ops = [e for e in prof.key_averages(group_by_input_shape=True)
               if e.device_time_total > 0 and e.key.startswith(("aten::", "hybrid::"))]
        print(f"{'us/step':>8} {'calls/step':>10} {'us/call':>8}  op and input shapes (without CUDA graphs)")
        for e in sorted(ops, key=lambda e: -e.device_time_total)[:40]:
            print(f"{e.device_time_total / steps:8.1f} {e.count / steps:10.1f} {e.device_time_total / e.count:8.2f}  "
                  f"{e.key} {str(e.input_shapes)[:160]}")


def profile_prefill(engine: Engine, prompts: torch.Tensor) -> None:
    """Where the time to first token goes: the steps until every one of the B prompts has its first token, profiled
    (host ops by self CPU time, device kernels by time), after the timed run compiled them."""
    from torch.profiler import ProfilerActivity, profile
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # first unprofiled: each step's wall time as the host sees it, its kind and tokens, and the time to its end on
    # the device (a sync after the step: the host's lead over the device shows as the difference)
    sync()
    ids = [engine.add_request(p, params) for p in prompts.tolist()]
    rows, start, pending = [], time.perf_counter(), set(ids)
    while pending:
        t0 = time.perf_counter()
        pending.difference_update(e.request_id for e in engine.step() if e.token_id is not None)
        t1 = time.perf_counter()
        sync()
        kind = engine.scheduler._last_kind
        rows.append(f"{kind} {(t1 - t0) * 1e3:.2f} ms host, +{(time.perf_counter() - t1) * 1e3:.2f} ms to the device's end")
    while engine.has_unfinished():
        engine.step()
    tag(f"prefill steps unprofiled (a sync after each): {len(rows)} steps, {(time.perf_counter() - start) * 1e3:.1f} "
        f"ms: " + "; ".join(rows))
    sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        pending = {engine.add_request(p, params) for p in prompts.tolist()}
        steps = 0
        while pending:
            pending.difference_update(e.request_id for e in engine.step() if e.token_id is not None)
            steps += 1
        sync()
    wall = (time.perf_counter() - t0) * 1e3
    while engine.has_unfinished():
        engine.step()
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e3
    tag(f"prefill profile B={prompts.shape[0]}: {steps} steps, wall {wall:.2f} ms (profiled), device kernels "
        f"{gpu:.2f} ms")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    if os.environ.get("HYBRID_TRACE_DIR"):  # the profile's timeline (chrome://tracing, Perfetto)
        path = Path(os.environ["HYBRID_TRACE_DIR"]) / f"prefill_B{prompts.shape[0]}.json"
        prof.export_chrome_trace(str(path))
        tag(f"trace: {path}")
    kernel_table(events, 1, limit=40)


def one_rank_group():
    """The default process group with this process as its only rank (started once)."""
    import os
    import socket
    import torch.distributed as dist
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    return dist.group.WORLD


def sharded_copy(model):
    """A copy of ``model`` sharded over the one-rank group (the tensor-parallel path at TP = 1)."""
    from runtime.distributed import shard_model
    twin = copy.deepcopy(model)
    report = shard_model(twin, one_rank_group())
    tag(f"tp1: {report.summary()}")
    return twin


def agreeing_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    n = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        n.append(k)
    return sum(n) / len(n)


def run_model(name: str, args, device: str, dtype) -> list[dict]:
    if not args.explain:
        return _run_model(name, args, device, dtype)
    with compiler.collect() as report:
        rows = _run_model(name, args, device, dtype)
    tag(f"{name}: explain report of every graph the engines compiled\n{report.table()}")
    for r in report.regions():
        if len(set(r["graphs"].values())) > 1:  # a region rewritten in some graphs and not in others
            tag(f"{r['module']}: {r['graphs']}")
    return rows


def _run_model(name: str, args, device: str, dtype) -> list[dict]:
    tag(f"building {name} on {device} ({dtype})")
    model = zoo.build(name, dtype=dtype, device=device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows, eager_ids = [], {}
    engine = None
    engines = {}  # one engine per engine variant, kept over the batch sizes
    batch_prompts = {b: torch.randint(3, vocab, (b, args.prompt), generator=g).to(device) for b in args.batches}
    for variant in args.variants:
        for b, prompts in batch_prompts.items():
            new = args.eager_output if variant == "hf-eager" else args.output
            row = dict(model=name, variant=variant, batch=b, prompt=args.prompt, new_tokens=new)
            try:
                if variant.startswith("hf"):
                    static = variant == "hf-static-compile"
                    if static:
                        tag(f"{name} {variant} B={b}: warm-up (compiles)")
                        hf_generate(model, prompts, args.output, static)
                    tag(f"{name} {variant} B={b}: {new} tokens")
                    ttft, total, out = hf_generate(model, prompts, new, static)
                    row.update(ttft_ms=ttft * 1e3, tpot_ms=(total - ttft) / (new - 1) * 1e3)
                    if variant == "hf-eager":
                        eager_ids[b] = out
                else:
                    engine = engines.get(variant)
                    if engine is None:
                        tag(f"{name}: {variant} ({args.compile}), cache {args.cache_mb} MB")
                        runs = sharded_copy(model) if variant == "hybrid-engine-tp1" else model
                        engine = engines[variant] = Engine(runs, cache_memory=args.cache_mb << 20, max_num_seqs=max(args.batches),
                                        max_prefill_tokens=max(args.prompt, 512), compile=args.compile,
                                        max_num_batched_tokens=args.max_num_batched_tokens,
                                        freeze_weights=args.freeze_weights,
                                        packed_steps=False if variant == "hybrid-engine-padded" else None,
                                        compile_options=parse_options(args.compile_options))
                    tag(f"{name} {variant} B={b}: warm-up (compiles, records graphs)")
                    engine_generate(engine, prompts, 8)
                    tag(f"{name} {variant} B={b}: {new} tokens")
                    pre, dec, steps, out, busy = engine_generate(engine, prompts, new)
                    row.update(ttft_ms=pre * 1e3, tpot_ms=dec / steps * 1e3, host_busy_ms=busy / steps * 1e3)
                    if args.profile_prefill:
                        profile_prefill(engine, prompts)
                    if args.profile or args.profile_shapes:
                        profile_decode(engine, prompts, shapes=args.profile_shapes)
                    if b in eager_ids:
                        row["agreeing_prefix"] = agreeing_prefix(out, eager_ids[b])
                    roof, parts = step_roofline_ms(model, engine, b, args.prompt + args.output / 2)
                    row["prefill_roofline_ms"] = prefill_roofline_ms(model, engine, b, args.prompt)
                    row.update(roofline_ms=roof, roofline_parts_mb={k: v / 2**20 for k, v in parts.items()},
                               cache_bytes_per_token_per_layer=[l.buf[0].numel() * l.buf.element_size()
                                                                for l in engine.cache.attention][:1],
                               state_bytes_per_seq_per_layer=[sum(b[0].numel() * b.element_size()
                                                                  for b in l.buffers)
                                                              for l in engine.cache.states][:1])
                row["tok_s"] = b / row["tpot_ms"] * 1e3
            except Exception as e:  # noqa: BLE001  (a crash is a result: record it)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                tag(f"{name} {variant} B={b}: FAILED {row['error']}")
                traceback.print_exc(limit=4)
            tag(f"{name} {variant} B={b}: { {k: v for k, v in row.items() if k != 'roofline_parts_mb'} }")
            rows.append(row)
        engines.pop(variant, None)
        engine = None
        torch._dynamo.reset()
    for r in rows:  # the rooflines are the same bytes and FLOPs whoever runs the step
        ref = next((x for x in rows if x["batch"] == r["batch"] and "roofline_ms" in x), None)
        if ref and "tpot_ms" in r:
            r["roofline_ms"] = ref["roofline_ms"]
            r["pct_roofline"] = 100 * ref["roofline_ms"] / r["tpot_ms"]
            r["prefill_roofline_ms"] = ref["prefill_roofline_ms"]
            r["pct_prefill_roofline"] = 100 * ref["prefill_roofline_ms"] / r["ttft_ms"]
    del model, engine
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def parse_options(text: str) -> dict:
    """``complex=0,verify=1,inductor.combo_kernels=1`` -> {"complex": False, "verify": True,
    "inductor_config": {"combo_kernels": True}}."""
    opts = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or value not in ("0", "1"):
            raise SystemExit(f"--compile-options: expected key=0 or key=1, got {item!r}")
        if key.startswith("inductor."):
            opts.setdefault("inductor_config", {})[key.removeprefix("inductor.")] = value == "1"
        else:
            opts[key] = value == "1"
    return opts


def table(rows: list[dict]) -> str:
    lines = ["| model | variant | B | new tokens | TTFT ms | TPOT ms | host busy ms/step | decode tok/s | x HF eager "
             "| % step roofline | roofline ms | % prefill roofline | agreeing prefix vs eager | note |", "|" + "---|" * 14]
    eager = {(r["model"], r["batch"]): r for r in rows if r["variant"] == "hf-eager" and "tok_s" in r}
    plain = {(r["model"], r["batch"]): r for r in rows if r["variant"] == "hybrid-engine" and "tpot_ms" in r}
    for r in rows:
        e = eager.get((r["model"], r["batch"]))
        p = plain.get((r["model"], r["batch"]))
        if r["variant"] == "hybrid-engine-tp1" and p and "tpot_ms" in r:
            r.setdefault("note", f"TPOT {r['tpot_ms'] / p['tpot_ms']:.3f}x hybrid-engine's")
        ratio = f"{r['tok_s'] / e['tok_s']:.1f}x" if e and "tok_s" in r else "-"
        f = lambda k, fmt: format(r[k], fmt) if k in r else "-"  # noqa: E731
        lines.append(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['new_tokens']} | {f('ttft_ms', '.1f')} | "
                     f"{f('tpot_ms', '.3f')} | {f('host_busy_ms', '.3f')} | {f('tok_s', '.0f')} | {ratio} | {f('pct_roofline', '.0f')} | "
                     f"{f('roofline_ms', '.3f')} | {f('pct_prefill_roofline', '.0f')} | {f('agreeing_prefix', '.1f')} | {r.get('error', r.get('note', ''))} |")
    return "\n".join(lines)


def _set_varlen_config(spec: str) -> None:
    """Replace the varlen attention kernel's launch rule with one config (JSON, or the fastest prefill row of a
    bench/varlen.py result file)."""
    from hybrid_kernels.attention import triton_varlen
    if spec.lstrip().startswith("{"):
        cfg = json.loads(spec)
    else:
        rows = [r for r in json.loads(Path(spec).read_text())["rows"] if r["case"].startswith("prefill")]
        cfg = min(rows, key=lambda r: r["ms"])["config"]
    log("engine", f"varlen attention launch: {cfg}")
    triton_varlen.launch_config = lambda *a: dict(cfg)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--eager-output", type=int, default=32)
    ap.add_argument("--cache-mb", type=int, default=4096)
    ap.add_argument("--compile", default="hybrid-cudagraphs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="padded tokens of a prefill step of several prompts (the engine's default: 8192)")
    ap.add_argument("--profile", action="store_true", help="profile 20 engine decode steps per batch size")
    ap.add_argument("--profile-shapes", action="store_true",
                    help="--profile without CUDA graphs, with each op's device time per input shape")
    ap.add_argument("--explain", action="store_true",
                    help="print the explain report of the graphs the engines compile (which regions were rewritten)")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="profile the engine's steps to the batch's first tokens (host ops, device kernels)")
    ap.add_argument("--freeze-weights", action="store_true", help="Engine(freeze_weights=True): weights as constants")
    ap.add_argument("--compile-options", default="",
                    help="backend options for the engine, e.g. complex=0,moe=1 (pass switches; 0/1 values); "
                    "inductor.KEY=0/1: an Inductor config patch (inductor.combo_kernels=1)")
    ap.add_argument("--varlen-config", help="hybrid::varlen_attention's launch for every call, as JSON (rows, block_n, "
                    "num_warps, num_stages), or a bench/varlen.py result file: its fastest config on the prefill case")
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="tiny zoo models on the CPU")
    args = ap.parse_args()
    if args.varlen_config:
        _set_varlen_config(args.varlen_config)
    quiet_transformers()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.smoke:
        args.models, args.batches, args.prompt, args.output, args.eager_output, args.cache_mb = (
            "deepseek_v2,mamba2,mixtral", "1,3", 20, 8, 8, 64)
        if args.variants == ",".join(VARIANTS):
            args.variants = "hf-eager,hybrid-engine"
        args.compile = "hybrid-eager"
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS + EXTRA_VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {VARIANTS + EXTRA_VARIANTS}")
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, args, device, dtype)
        text = table(rows)  # written after every model: a time limit keeps what was measured
        write(args.out, "engine", rows, text, extra=dict(args={k: v for k, v in vars(args).items() if k != "out"}))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
