"""The ``hybrid`` command line.

    hybrid demo [--model deepseek_v3]      compile a zoo model, show the explain table, compare with eager
    hybrid explain MODEL [--json]          every MLA / SSM / MoE region and what the passes did with it
    hybrid generate MODEL --prompt-ids 5,6,7 [--prompt "text"] [--json]   continuous-batching engine
    hybrid serve MODEL [--host 127.0.0.1 --port 8000]     OpenAI-compatible HTTP server over the engine
    hybrid export MODEL OUT_DIR [--device cpu] [--dtype fp32]   engine files: load and run without compiling
    hybrid zoo list | hybrid zoo save NAME DIR [--force]

Every error is one line on stderr, ``hybrid: error: ...``: exit code 2 for bad input (flags, model files, devices),
1 for a failure of the run itself; nothing is printed on stdout then. ``--debug`` (or ``HYBRID_DEBUG=1``) adds the
traceback and transformers' own messages.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
#: errors that mean the input was wrong (exit 2); any other exception is a failure of the run (exit 1)
EXPECTED = (ValueError, KeyError, OSError)
#: the pass names ``--disable`` takes (passes.PASS_NAMES, written out so that parsing flags imports no kernels;
#: tests/test_cli_errors.py checks the two agree)
PASSES = ("mla", "mla_step", "ssm", "delta", "moe", "complex", "linear", "norm", "glu")
#: the flags that set SamplingParams fields (their checks are SamplingParams')
SAMPLING_FLAGS = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
                  "top_p": "--top-p", "seed": "--seed"}


def _say(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # under --tensor-parallel, rank 0 speaks for all
        print(msg, file=sys.stderr, flush=True)


def _debug(args) -> bool:
    return getattr(args, "debug", False) or os.environ.get("HYBRID_DEBUG", "") not in ("", "0")


def _setup(debug: bool) -> None:
    if debug:  # the engine's messages with tracebacks (a failed step's), transformers as it is
        logger = logging.getLogger("runtime")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(logging.StreamHandler())
        return
    from .hf import quiet_transformers
    quiet_transformers()
    warnings.filterwarnings("ignore", message=".*lru_cache.*")
    warnings.showwarning = lambda message, *a, **k: _say(f"hybrid: warning: {' '.join(str(message).split())}")
    logging.getLogger("runtime.engine").setLevel(logging.ERROR)  # failed requests are reported by the command


def _dtype(name: str):
    import torch
    return getattr(torch, DTYPES[name])


def _load(args, dtype: str, device: str):
    from . import zoo
    _say(f"loading {args.model} ({dtype}, {device}) ...")
    return zoo.load(args.model, dtype=_dtype(dtype), device=device,
                    allow_missing_weights=getattr(args, "allow_missing_weights", False),
                    trust_remote_code=getattr(args, "trust_remote_code", False))


def _check_length(model, tokens: int, more: int, flags: str) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and tokens + more > limit:
        raise ValueError(f"{flags} ({tokens} + {more} tokens) exceed the model's maximum length of {limit} tokens")


def _prompt(model, batch: int, tokens: int, device: str, seed: int = 0):
    import torch
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return torch.randint(3, vocab, (batch, tokens), generator=g).to(device)


def cmd_explain(args) -> int:
    from compiler.explain import explain
    model = _load(args, args.dtype, args.device)
    _check_length(model, args.tokens, args.generate, "--tokens + --generate")
    ids = _prompt(model, args.batch, args.tokens, args.device)
    _say(f"tracing prefill ({args.batch}x{args.tokens} tokens)"
         + (f" and {args.generate} decode steps" if args.generate else "") + " with the hybrid backend ...")
    report = explain(model, ids, generate_tokens=args.generate, options=_options(args))
    print(report.to_json() if args.json else report.table())
    return 0


def _options(args) -> dict:
    opts = {}
    for name in args.disable or []:
        opts[name] = False
    if getattr(args, "verify", False):
        opts["verify"] = True
    return opts


def cmd_demo(args) -> int:
    import torch

    from compiler.explain import explain
    from hybrid_kernels.numerics import rel_err
    model = _load(args, "float32", "cpu")
    _check_length(model, args.tokens, args.new_tokens, "--tokens + --new-tokens")
    ids = _prompt(model, 1, args.tokens, "cpu")
    out = io.StringIO()  # printed when every step has run: no partial result on a failure
    _say("step 1/4: explain (prefill + decode graphs)")
    print(explain(model, ids, generate_tokens=2, options=_options(args)).table(), file=out)

    _say("step 2/4: eager reference (logits and greedy generate)")
    with torch.no_grad():
        ref_logits = model(ids).logits
        t0 = time.perf_counter()
        ref_tokens = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        eager_s = time.perf_counter() - t0

    _say("step 3/4: torch.compile(backend='hybrid') -> Inductor (the first call compiles; about a minute)")
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="hybrid", options=_options(args))
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(ids).logits
        _say(f"  prefill graph compiled in {time.perf_counter() - t0:.1f}s")
        model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)  # compiles decode graphs
        _say("step 4/4: timing compiled generate")
        t0 = time.perf_counter()
        tokens = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        comp_s = time.perf_counter() - t0
    err = rel_err(logits, ref_logits)
    same = torch.equal(tokens, ref_tokens)
    print(f"\nlogits relative error vs eager: {err:.2e}  ({'ok' if err < 1e-5 else 'TOO LARGE'}, limit 1e-5)", file=out)
    print(f"greedy generate ({args.new_tokens} tokens) identical to eager: {same}", file=out)
    print(f"generate time: eager {eager_s:.2f}s, hybrid {comp_s:.2f}s (CPU, reference ops; speed is a GPU matter)",
          file=out)
    print(out.getvalue(), end="")
    return 0 if (err < 1e-5 and same) else 1


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated integers, e.g. 5,6,7, got {text!r}") from None
    return ids


#: where a rank started by ``_launch_ranks`` writes its one-line error, for the launcher to say when rank 0 cannot
RANK_ERROR_ENV = "HYBRID_RANK_ERROR_FILE"


def _launch_ranks(tp: int, argv: list[str]) -> int:
    """``hybrid generate ... --tensor-parallel N`` outside torchrun: the same command on N ranks of this host (the
    environment torchrun --standalone gives: RANK, LOCAL_RANK, WORLD_SIZE, a free local port). When a rank fails the
    others are ended, the command exits with that rank's code, and its one-line error is said once (by rank 0, or
    here for another rank), with no launcher traceback."""
    import socket
    import subprocess
    import tempfile
    import time
    _say(f"starting {tp} ranks on this host ...")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="hybrid-ranks-") as tmp:
        files = [os.path.join(tmp, f"rank{r}.err") for r in range(tp)]
        procs = [subprocess.Popen([sys.executable, "-m", "runtime.cli", *argv],
                                  env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(tp),
                                       "LOCAL_WORLD_SIZE": str(tp), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port), RANK_ERROR_ENV: files[r]})
                 for r in range(tp)]
        failed: tuple[int | None, int] = (None, 0)
        try:
            while failed == (None, 0):
                codes = [p.poll() for p in procs]
                failed = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), failed)
                if all(c == 0 for c in codes):
                    return 0
                time.sleep(0.05)
        except KeyboardInterrupt:  # the ranks, in this process group, got the interrupt too
            failed = (0, 130)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        rank, code = failed
        said = [Path(f).read_text().strip() if Path(f).is_file() else "" for f in files]
        if rank and not said[0]:  # rank 0 says its own errors; another rank's is said here
            _say(f"hybrid: error: rank {rank}: " + (said[rank] or f"exited with code {code}"))
        return code


def _join_ranks(tp: int, device: str | None) -> str | None:
    """This process's rank of a torchrun launch: its process group (NCCL on CUDA, gloo on the CPU) and its device."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise ValueError(f"--tensor-parallel {tp} under torchrun with {world} processes: give --nproc-per-node {tp}")
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    return f"cuda:{local}" if cuda else "cpu"


def _check_expert_flags(args) -> None:
    if args.expert_parallel and args.tensor_parallel == 1:
        raise ValueError("--expert-parallel splits experts over the tensor-parallel ranks: add --tensor-parallel N "
                         "(N > 1)")
    if (args.expert_placement or args.save_expert_placement) and not args.expert_parallel:
        raise ValueError("--expert-placement and --save-expert-placement place experts over ranks: add "
                         "--expert-parallel (and --tensor-parallel N)")
    if args.redundant_experts and not args.save_expert_placement:
        raise ValueError(f"--redundant-experts {args.redundant_experts} sizes the placement --save-expert-placement "
                         "writes: add --save-expert-placement FILE (and --expert-parallel), or leave it out")
    if args.redundant_experts % args.tensor_parallel:
        raise ValueError(f"--redundant-experts {args.redundant_experts}: give a multiple of --tensor-parallel "
                         f"{args.tensor_parallel} (every rank gets as many slots)")
    if args.expert_placement:
        from runtime.distributed import balance
        balance.load(args.expert_placement)  # a bad file is one line before any rank starts


def _save_placement(engine, path: str, tp: int, redundant: int) -> None:
    """Rank 0 writes a placement for the loads this run measured and says how even the ranks were and would be."""
    from runtime.distributed import balance
    measured = engine.expert_balance()  # every rank takes part (it gathers)
    if os.environ.get("RANK", "0") != "0":
        return
    loads = engine.expert_loads()
    plan = {block: balance.plan_placement(counts, tp, redundant) for block, counts in loads.items()}
    balance.save(path, plan)
    worst = max((m["imbalance"] for m in measured.values()), default=1.0)
    planned = max((balance.imbalance(balance.rank_loads(loads[b], plan[b])) for b in plan), default=1.0)
    _say(f"expert placement for {len(plan)} MoE blocks written to {path}: ranks' load max / mean {worst:.2f} "
         f"measured, {planned:.2f} for these loads placed (--expert-placement {path})")


def cmd_generate(args) -> int:
    import torch

    from runtime.engine import Engine, SamplingParams
    prompts: list = list(args.prompts or [])
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)  # each flag was checked by its type (_sampling)
    tp = args.tensor_parallel
    _check_expert_flags(args)
    if tp > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_ranks(tp, args.argv)
    device = _join_ranks(tp, args.device) if tp > 1 else args.device
    _say(f"loading {args.model} ...")
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    engine = Engine.from_pretrained(args.model, device=device, dtype=dtype, compile=args.compile, tensor_parallel=tp,
                                    expert_parallel=args.expert_parallel, expert_placement=args.expert_placement,
                                    cache_memory=args.cache_mb << 20 if args.cache_mb else None,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    packed_steps=False if args.no_packed_steps else None,
                                    allow_missing_weights=args.allow_missing_weights,
                                    trust_remote_code=args.trust_remote_code)
    live = sys.stderr.isatty() and not args.json and os.environ.get("RANK", "0") == "0"
    if os.environ.get("RANK", "0") != "0":  # every rank computes the same outputs: rank 0 prints them
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (for the rest of this process)

    def progress(n, seconds):
        if live:
            print(f"\r{n} tokens, {n / max(seconds, 1e-9):.1f} tokens/s", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        outs = engine.generate(prompts, params, progress=progress)
    finally:
        if live:
            print(file=sys.stderr)
    seconds = time.perf_counter() - t0
    if args.save_expert_placement:
        _save_placement(engine, args.save_expert_placement, tp, args.redundant_experts)
    failed: dict[str, list[int]] = {}
    for i, o in enumerate(outs):
        if o.finish_reason == "error":
            failed.setdefault(o.error, []).append(i)
    for error, ids in failed.items():  # no partial result: the others' outputs are not printed
        _say(f"hybrid: error: request{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))} failed: {error}")
    if failed:
        return 1
    total = sum(len(o.token_ids) for o in outs)
    if args.json:
        print(json.dumps({"outputs": [{"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
                                       "prompt_token_ids": o.prompt_token_ids} for o in outs],
                          "tokens": total, "seconds": round(seconds, 3),
                          "tokens_per_s": round(total / max(seconds, 1e-9), 2),
                          "preemptions": engine.scheduler.num_preemptions}, indent=2))
    else:
        for i, o in enumerate(outs):
            print(f"[{i}] {o.text if o.text is not None else o.token_ids}  ({o.finish_reason})")
        _say(f"{total} tokens in {seconds:.2f}s ({total / max(seconds, 1e-9):.1f} tokens/s)")
    return 0


def cmd_serve(args) -> int:
    import importlib.util

    import torch
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"hybrid serve needs starlette and uvicorn ({', '.join(missing)} missing): pip install "
                         "'hybrid[serve]'")

    _check_listen(args.host, args.port)  # before the model loads: a bad address costs no minutes
    from runtime.engine import Engine
    from runtime.serve import serve
    _say(f"loading {args.model} ...")
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=dtype, compile=args.compile,
                                    cache_memory=args.cache_mb << 20 if args.cache_mb else None,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    packed_steps=False if args.no_packed_steps else None,
                                    max_num_seqs=args.max_num_seqs, allow_missing_weights=args.allow_missing_weights,
                                    trust_remote_code=args.trust_remote_code)
    if not args.no_warmup:
        t0 = time.perf_counter()
        engine.warmup(args.warmup_context, progress=lambda msg: _say(f"[{time.perf_counter() - t0:6.1f}s] {msg}"))
    name = args.served_model_name or args.model
    host = f"[{args.host}]" if ":" in args.host else args.host
    serve(engine, name, args.host, args.port, log_level="debug" if _debug(args) else args.log_level,
          announce=lambda port: _say(f"serving {name} on http://{host}:{port}/v1 (completions, chat/completions, "
                                     "models; /health)"))
    return 0


def cmd_export(args) -> int:
    import torch

    from runtime.aot import export_engine
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    t0 = time.perf_counter()
    out = export_engine(args.model, args.out_dir, device=args.device or "cpu", dtype=dtype, max_batch=args.max_batch,
                        max_seq_len=args.max_seq_len, force=args.force, aot=args.aot,
                        progress=lambda msg: _say(f"[{time.perf_counter() - t0:6.1f}s] {msg}"))
    limit = json.loads((out / "manifest.json").read_text())["engine"]["max_seq_len"]
    _say(f"run it with: hybrid generate {args.out_dir} --prompt-ids 5,6,7 --max-new-tokens {min(16, limit - 3)}")
    return 0


def cmd_zoo(args) -> int:
    from . import zoo
    if args.zoo_cmd == "list":
        wn = max(len(e.name) for e in zoo.ZOO.values())
        wt = max(len(e.model_type) for e in zoo.ZOO.values())
        for e in zoo.ZOO.values():
            print(f"{e.name:{wn}s}  {e.model_type:{wt}s}  {'realistic ' if e.realistic else ''}{e.note}")
        return 0
    _say(f"building {args.name} ...")
    path = zoo.save(args.name, args.dir, dtype=_dtype(args.dtype), force=args.force)
    print(f"wrote {path} (config.json + model.safetensors + a character tokenizer); try: hybrid explain {path}")
    return 0


# -- flag types: a bad value is argparse's one-line error naming the flag ------------------------------------
def _check_listen(host: str, port: int) -> None:
    """The server can listen on ``host``:``port`` (the address resolves, the port is free)."""
    import socket
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a port is 0-65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} does not resolve ({e}): give an address of this machine, e.g. "
                         "127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}): choose another --port or "
                             "--host") from None


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {value}")
        return value
    return parse


def _sampling(name: str, kind):
    """A SamplingParams field from its flag, checked by SamplingParams itself (the message names both)."""
    def parse(text: str):
        from runtime.engine import SamplingParams
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, got "
                                             f"{text!r}") from None
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    return parse


def _device(text: str) -> str:
    from . import zoo
    try:
        zoo.check_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block (argparse's default prints both)
        _say(f"hybrid: error: {' '.join(message.split())} (see `{self.prog} --help`)")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hybrid", description=(
        "Compile Hugging Face MLA / Mamba / MoE models with fused kernels: "
        "torch.compile(model, backend='hybrid')."))
    p.add_argument("--debug", action="store_true", help="show tracebacks and transformers' messages (HYBRID_DEBUG=1)")
    sub = p.add_subparsers(dest="cmd", required=True)
    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="as hybrid --debug")
    loading = _Parser(add_help=False)
    loading.add_argument("--allow-missing-weights", action="store_true",
                         help="load a model directory whose weight files lack some of the model's weights (or hold "
                              "others): those weights are random")
    loading.add_argument("--trust-remote-code", action="store_true",
                         help="run the Python code of a model directory that needs it (auto_map in its config)")

    d = sub.add_parser("demo", parents=[debug], help="compile a zoo model, show what was rewritten, compare with eager")
    d.add_argument("--model", default="deepseek_v3", help="zoo model (see `hybrid zoo list`)")
    d.add_argument("--tokens", type=_int_at_least(1), default=12, help="prompt length")
    d.add_argument("--new-tokens", type=_int_at_least(1), default=8, help="tokens to generate")
    d.add_argument("--disable", action="append", choices=PASSES, metavar="PASS",
                   help=f"turn a pass off ({', '.join(PASSES)}); repeatable")
    d.set_defaults(fn=cmd_demo)

    e = sub.add_parser("explain", parents=[debug, loading],
                       help="report every MLA / SSM / MoE region and what the passes did")
    e.add_argument("model", help="zoo name or path to an HF model directory")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e.add_argument("--tokens", type=_int_at_least(1), default=8, help="prompt length used for tracing")
    e.add_argument("--batch", type=_int_at_least(1), default=1)
    e.add_argument("--generate", type=_int_at_least(0), default=2, help="decode steps to trace too (0: prefill only)")
    e.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    e.add_argument("--device", type=_device, default="cpu")
    e.add_argument("--disable", action="append", choices=PASSES, metavar="PASS",
                   help=f"turn a pass off ({', '.join(PASSES)}); repeatable")
    e.add_argument("--verify", action="store_true", help="check each rewrite against eager on the example inputs")
    e.set_defaults(fn=cmd_explain)

    engine_flags = _Parser(add_help=False)
    engine_flags.add_argument("--device", type=_device, default=None, help="default: cuda when available, else cpu")
    engine_flags.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                              help="default: bfloat16 on cuda, float32 on cpu")
    engine_flags.add_argument("--compile", default="auto",
                              choices=["auto", "hybrid-cudagraphs", "hybrid", "hybrid-eager", "none"],
                              help="auto: hybrid-cudagraphs on cuda (decode steps as CUDA graphs), hybrid-eager on cpu")
    engine_flags.add_argument("--cache-mb", type=_int_at_least(1),
                              help="cache memory budget in MiB (default: 90%% of free GPU memory / 256)")
    engine_flags.add_argument("--max-num-batched-tokens", type=_int_at_least(1),
                              help="tokens of one step that prefills (default 8192)")
    engine_flags.add_argument("--no-packed-steps", action="store_true",
                              help="prefill in padded steps without the decodes, not in packed steps beside them")

    g = sub.add_parser("generate", parents=[debug, loading, engine_flags],
                       help="generate with the continuous-batching engine (paged caches, SSM slots)")
    g.add_argument("model", help="zoo name or path to an HF model directory (its tokenizer is used for --prompt)")
    # one list for both flags: the outputs come in the order the prompts were given
    g.add_argument("--prompt", action="append", dest="prompts", help="text prompt (needs a tokenizer); repeatable")
    g.add_argument("--prompt-ids", action="append", dest="prompts", type=_prompt_ids,
                   help="comma-separated token ids, e.g. 5,6,7; repeatable")
    g.add_argument("--max-new-tokens", type=_sampling("max_tokens", int), default=16,
                   help="tokens to generate per prompt (default: 16)")
    g.add_argument("--temperature", type=_sampling("temperature", float), default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=_sampling("top_k", int), default=0)
    g.add_argument("--top-p", type=_sampling("top_p", float), default=1.0)
    g.add_argument("--seed", type=_sampling("seed", int),
                   help="sampling seed of every prompt (each prompt's sampler starts from it, as a request's seed does)")
    g.add_argument("--json", action="store_true", help='print {"outputs": [{"token_ids": [...], "text": ...}], ...}')
    g.add_argument("--tensor-parallel", type=_int_at_least(1), default=1, metavar="N",
                   help="split the model over N processes (torch.distributed; started on this host, or run it "
                        "under torchrun)")
    g.add_argument("--expert-parallel", action="store_true",
                   help="with --tensor-parallel: split MoE experts over the ranks by expert, not by width")
    g.add_argument("--expert-placement", metavar="FILE",
                   help="with --expert-parallel: place experts (and replicas of hot ones) as FILE says "
                   "(written by --save-expert-placement)")
    g.add_argument("--save-expert-placement", metavar="FILE",
                   help="with --expert-parallel: after generating, write a placement balanced for the experts' measured "
                   "loads to FILE, and print the ranks' load imbalance (max / mean)")
    g.add_argument("--redundant-experts", type=_int_at_least(0), default=0, metavar="R",
                   help="extra expert slots per MoE block for --save-expert-placement (a multiple of N): replicas of the "
                   "hottest experts")
    g.set_defaults(fn=cmd_generate)

    sv = sub.add_parser("serve", parents=[debug, loading, engine_flags],
                        help="serve the model over HTTP, OpenAI-compatible (/v1/completions, /v1/chat/completions)")
    sv.add_argument("model", help="zoo name or path to an HF model directory (with its tokenizer and chat template)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--port", type=_int_at_least(0), default=8000, help="0-65535 (default 8000)")
    sv.add_argument("--served-model-name", help="the model name clients give (default: MODEL as given)")
    sv.add_argument("--max-num-seqs", type=_int_at_least(1), default=None,
                    help="requests decoded together (default 32, or an engine directory's --max-batch where lower)")
    sv.add_argument("--no-warmup", action="store_true",
                    help="skip the warm-up before listening (then the first requests of each shape compile and "
                    "record CUDA graphs while they are served)")
    sv.add_argument("--warmup-context", type=_int_at_least(1), default=None, metavar="TOKENS",
                    help="longest context whose decode CUDA graphs the warm-up records (default: the model's limit, "
                    "the cache's capacity or 8192, whichever is least; longer ones record on first use)")
    sv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="the HTTP server's log (info: one line per request)")
    sv.set_defaults(fn=cmd_serve)

    x = sub.add_parser("export", parents=[debug],
                       help="export a model as an engine directory: loaded and run later without compiling",
                       description="Write an engine directory: the engine's model calls (prefill, decode) exported "
                       "after hybrid's passes as torch.export programs, the weights, config and tokenizer files, and "
                       "manifest.json (versions, device, cache layouts, graphs, sha256 of every file). `hybrid "
                       "generate OUT_DIR` and Engine.from_engine(OUT_DIR) run it without tracing or compiling and "
                       "without the model's Python code. It is tied to this torch and triton and to the device kind "
                       "(and GPU architecture) it was exported on.")
    x.add_argument("model", help="zoo name or path to an HF model directory")
    x.add_argument("out_dir", help="the engine directory to write (new or empty)")
    x.add_argument("--device", type=_device, default=None, help="device the engine will run on (default: cpu)")
    x.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    x.add_argument("--max-batch", type=_int_at_least(1), default=32, help="most sequences decoded together")
    x.add_argument("--max-seq-len", type=_int_at_least(1), default=None,
                   help="longest sequence, prompt + output (at least 16; default: the model's maximum)")
    x.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR (its engine files replaced)")
    x.add_argument("--aot", choices=("inductor", "none"), default=None,
                   help="inductor: also compile every graph into an AOTInductor package, which loads fused (needs a "
                   "C++ compiler that links libstdc++ dynamically: $CXX, g++ or /usr/bin/g++); none: the exported "
                   "graphs alone, run unfused (the default)")
    x.set_defaults(fn=cmd_export)

    z = sub.add_parser("zoo", parents=[debug], help="list the model zoo or save a zoo model as an HF directory")
    zsub = z.add_subparsers(dest="zoo_cmd", required=True)
    zsub.add_parser("list", parents=[debug], help="list zoo models")
    zs = zsub.add_parser("save", parents=[debug],
                         help="write NAME as an HF model directory (config.json + safetensors)")
    zs.add_argument("name")
    zs.add_argument("dir")
    zs.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    zs.add_argument("--force", action="store_true",
                    help="write where DIR is a file (replaced) or a non-empty directory (its model files replaced)")
    z.set_defaults(fn=cmd_zoo)
    return p


def _message(e: BaseException) -> str:
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(str(msg).split()) or type(e).__name__


def _attach_values(argv: list[str]) -> list[str]:
    """``--prompt-ids -1,5`` as ``--prompt-ids=-1,5``: argparse reads a value that starts with a dash and is not one
    number as a flag, and would say the flag has no argument instead of what is wrong with the ids."""
    out = []
    for a in argv:
        if out and out[-1] == "--prompt-ids" and re.match(r"-\d", a):
            out[-1] = f"--prompt-ids={a}"
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        argv = _attach_values(list(sys.argv[1:] if argv is None else argv))
        args = build_parser().parse_args(argv)
        args.argv = argv  # what --tensor-parallel relaunches on each rank
    except SystemExit as e:  # --help (0), or a bad flag, already said in one line (2)
        return e.code if isinstance(e.code, int) else 2
    debug = _debug(args)
    _setup(debug)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        _say("hybrid: interrupted")
        return 130
    except Exception as e:  # noqa: BLE001  (one line; the traceback with --debug)
        if debug:
            traceback.print_exc()
        if isinstance(e, EXPECTED):
            return _error(_message(e), 2)
        return _error(f"{type(e).__name__}: {_message(e)} (a failure of the run: --debug or HYBRID_DEBUG=1 shows the "
                      "traceback)", 1)


def _error(msg: str, code: int) -> int:
    """Say ``msg`` as the command's one-line error (a rank of ``_launch_ranks`` also leaves it for the launcher)."""
    if os.environ.get(RANK_ERROR_ENV):
        with open(os.environ[RANK_ERROR_ENV], "w") as f:
            f.write(msg)
    _say(f"hybrid: error: {msg}")
    return code


if __name__ == "__main__":
    sys.exit(main())
