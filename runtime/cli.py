"""The ``hybrid`` command line.

    hybrid demo [--model deepseek_v3]      compile a zoo model, show the explain table, compare with eager
    hybrid explain MODEL [--json]          every MLA / SSM / MoE region and what the passes did with it
    hybrid generate MODEL --prompt-ids 5,6,7 [--prompt "text"] [--json]   continuous-batching engine
    hybrid zoo list | hybrid zoo save NAME DIR
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _setup() -> None:
    from .hf import quiet_transformers
    quiet_transformers()
    warnings.filterwarnings("ignore", message=".*lru_cache.*")


def _dtype(name: str):
    import torch
    return getattr(torch, DTYPES[name])


def _load(model: str, dtype: str, device: str):
    from . import zoo
    _say(f"loading {model} ({dtype}, {device}) ...")
    return zoo.load(model, dtype=_dtype(dtype), device=device)


def _prompt(model, batch: int, tokens: int, device: str, seed: int = 0):
    import torch
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return torch.randint(3, vocab, (batch, tokens), generator=g).to(device)


def cmd_explain(args) -> int:
    from compiler.explain import explain
    model = _load(args.model, args.dtype, args.device)
    ids = _prompt(model, args.batch, args.tokens, args.device)
    _say(f"tracing prefill ({args.batch}x{args.tokens} tokens)"
         + (f" and {args.generate} decode steps" if args.generate else "") + " with the hybrid backend ...")
    report = explain(model, ids, generate_tokens=args.generate, options=_options(args))
    if args.json:
        print(report.to_json())
    else:
        print(report.table())
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
    from kernels.numerics import rel_err
    model = _load(args.model, "float32", "cpu")
    ids = _prompt(model, 1, args.tokens, "cpu")
    _say("step 1/4: explain (prefill + decode graphs)")
    print(explain(model, ids, generate_tokens=2).table())

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
    print(f"\nlogits relative error vs eager: {err:.2e}  ({'ok' if err < 1e-5 else 'TOO LARGE'}, limit 1e-5)")
    print(f"greedy generate ({args.new_tokens} tokens) identical to eager: {same}")
    print(f"generate time: eager {eager_s:.2f}s, hybrid {comp_s:.2f}s (CPU, reference ops; speed is a GPU matter)")
    return 0 if (err < 1e-5 and same) else 1


def cmd_generate(args) -> int:
    import torch

    from runtime.engine import Engine, SamplingParams
    prompts: list = list(args.prompt or [])
    for ids in args.prompt_ids or []:
        try:
            prompts.append([int(t) for t in ids.replace(" ", "").split(",") if t])
        except ValueError:
            raise ValueError(f"--prompt-ids takes comma-separated integers, got {ids!r}") from None
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    _say(f"loading {args.model} ...")
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=dtype, compile=args.compile,
                                    cache_memory=args.cache_mb << 20 if args.cache_mb else None)
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    live = sys.stderr.isatty() and not args.json

    def progress(n, seconds):
        if live:
            print(f"\r{n} tokens, {n / max(seconds, 1e-9):.1f} tokens/s", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, progress=progress)
    seconds = time.perf_counter() - t0
    if live:
        print(file=sys.stderr)
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


def cmd_zoo(args) -> int:
    from . import zoo
    if args.zoo_cmd == "list":
        for e in zoo.ZOO.values():
            print(f"{e.name:24s} {e.model_type:12s} {'realistic ' if e.realistic else ''}{e.note}")
        return 0
    _say(f"building {args.name} ...")
    path = zoo.save(args.name, args.dir, dtype=_dtype(args.dtype))
    print(f"wrote {path} (config.json + model.safetensors); try: hybrid explain {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybrid", description=(
        "Compile Hugging Face MLA / Mamba / MoE models with fused kernels: "
        "torch.compile(model, backend='hybrid')."))
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="compile a zoo model, show what was rewritten, compare with eager")
    d.add_argument("--model", default="deepseek_v3", help="zoo model (see `hybrid zoo list`)")
    d.add_argument("--tokens", type=int, default=12, help="prompt length")
    d.add_argument("--new-tokens", type=int, default=8, help="tokens to generate")
    d.add_argument("--disable", action="append", help="turn a pass off (mla, mla_step, ssm, moe, complex, linear, norm, glu); repeatable")
    d.set_defaults(fn=cmd_demo)

    e = sub.add_parser("explain", help="report every MLA / SSM / MoE region and what the passes did")
    e.add_argument("model", help="zoo name or path to an HF model directory")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e.add_argument("--tokens", type=int, default=8, help="prompt length used for tracing")
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--generate", type=int, default=2, help="decode steps to trace too (0: prefill only)")
    e.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    e.add_argument("--device", default="cpu")
    e.add_argument("--disable", action="append", help="turn a pass off (mla, mla_step, ssm, moe, complex, linear, norm, glu); repeatable")
    e.add_argument("--verify", action="store_true", help="check each rewrite against eager on the example inputs")
    e.set_defaults(fn=cmd_explain)

    g = sub.add_parser("generate", help="generate with the continuous-batching engine (paged caches, SSM slots)")
    g.add_argument("model", help="zoo name or path to an HF model directory (its tokenizer is used for --prompt)")
    g.add_argument("--prompt", action="append", help="text prompt (needs a tokenizer); repeatable")
    g.add_argument("--prompt-ids", action="append", help="comma-separated token ids, e.g. 5,6,7; repeatable")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--json", action="store_true", help='print {"outputs": [{"token_ids": [...], "text": ...}], ...}')
    g.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    g.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--compile", default="auto",
                   choices=["auto", "hybrid-cudagraphs", "hybrid", "hybrid-eager", "none"],
                   help="auto: hybrid-cudagraphs on cuda (decode steps as CUDA graphs), hybrid-eager on cpu")
    g.add_argument("--cache-mb", type=int, help="cache memory budget in MiB (default: 90%% of free GPU memory / 256)")
    g.set_defaults(fn=cmd_generate)

    z = sub.add_parser("zoo", help="list the model zoo or save a zoo model as an HF directory")
    zsub = z.add_subparsers(dest="zoo_cmd", required=True)
    zsub.add_parser("list", help="list zoo models")
    zs = zsub.add_parser("save", help="write NAME as an HF model directory (config.json + safetensors)")
    zs.add_argument("name")
    zs.add_argument("dir")
    zs.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    z.set_defaults(fn=cmd_zoo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup()
    try:
        return args.fn(args)
    except (FileNotFoundError, KeyError, ValueError) as e:  # bad input: say what to do, no traceback
        msg = e.args[0] if e.args else str(e)
        _say(f"hybrid: error: {msg}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
