"""Whole models at realistic widths: HF eager vs stock torch.compile vs torch.compile(backend="hybrid").

    python bench/models.py --out bench/results/models.json                      # GPU, bf16
    python bench/models.py --models mixtral-8x7b-shape --variants eager,hybrid
    python bench/models.py --smoke                                              # tiny zoo models, CPU, seconds

Rows: prefill B=1 T=2048 (``logits_to_keep=1``, as generate's prefill) and one decode step at B=8 with a
512-token cache (a StaticCache filled by an eager prefill, with room for the ~25 timed steps, which HF
appends one by one: shapes stay fixed, so each variant compiles one decode graph). Every compiled variant is first checked against eager
on the prefill logits and on the decode logits. A variant that fails to compile or run is recorded with
its error, not hidden.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log, time_ms, write  # noqa: E402
from runtime import zoo  # noqa: E402
from runtime.hf import cache_kwarg, quiet_transformers  # noqa: E402
from hybrid_kernels.numerics import rel_err  # noqa: E402

MODELS = ["deepseek-v2-lite-shape", "mamba2-2.7b-shape", "mixtral-8x7b-shape"]
VARIANTS = ["eager", "inductor", "hybrid", "inductor-cg", "hybrid-cg"]


def tag(msg):
    log("models", msg)


def make_forward(model, variant: str):
    if variant == "eager":
        return model.forward
    torch._dynamo.reset()
    backend = "hybrid" if variant.startswith("hybrid") else "inductor"
    mode = "reduce-overhead" if variant.endswith("-cg") else None  # CUDA graphs
    return torch.compile(model.forward, backend=backend, mode=mode)


def run_model(name: str, variants: list[str], device: str, dtype, prefill_t: int, decode_b: int, cache_t: int,
              hybrid_explain: bool) -> list[dict]:
    tag(f"building {name} on {device} ({dtype})")
    model = zoo.build(name, dtype=dtype, device=device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefill_ids = torch.randint(3, vocab, (1, prefill_t), generator=g).to(device)
    decode_prompt = torch.randint(3, vocab, (decode_b, cache_t), generator=g).to(device)
    step_ids = torch.randint(3, vocab, (decode_b, 1), generator=g).to(device)
    kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    key = cache_kwarg(model)
    rows, ref, decode_ref = [], None, None
    for variant in variants:
        row = dict(model=name, variant=variant)
        try:
            fwd = make_forward(model, variant)
            with torch.no_grad():
                tag(f"{name} {variant}: prefill 1x{prefill_t} (first call compiles)")
                logits = fwd(prefill_ids, use_cache=False, **kw).logits
                if ref is None:
                    ref = logits.float()
                else:
                    row["prefill_rel_err_vs_eager"] = rel_err(logits.float(), ref)
                row["prefill_ms"] = time_ms(lambda: fwd(prefill_ids, use_cache=False, **kw))
                tag(f"{name} {variant}: decode step B={decode_b} after {cache_t} cached tokens")
                cache = transformers.StaticCache(config=model.config, max_cache_len=cache_t + 64)
                model.forward(decode_prompt, use_cache=True, cache_position=torch.arange(cache_t, device=device),
                              **{key: cache}, **kw)  # eager fill: only the decode step is compiled and timed
                pos = torch.tensor([cache_t], device=device)

                def step():
                    return fwd(step_ids, use_cache=True, cache_position=pos, **{key: cache}, **kw).logits
                step_logits = step().float()
                if decode_ref is None:
                    decode_ref = step_logits
                else:
                    row["decode_rel_err_vs_eager"] = rel_err(step_logits, decode_ref)
                row["decode_ms"] = time_ms(step, warmup=4, rep=20)
                row["decode_tok_s"] = decode_b / row["decode_ms"] * 1e3
        except Exception as e:  # noqa: BLE001  (a crash is a result: record it)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            tag(f"{name} {variant}: FAILED {row['error']}")
            traceback.print_exc(limit=3)
        if variant == "hybrid" and hybrid_explain and "error" not in row:
            from compiler import explain
            rep = explain(model, prefill_ids[:, :64])
            row["regions"] = rep.counts()
        rows.append(row)
        tag(f"{name} {variant}: {row}")
        torch._dynamo.reset()
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def table(rows: list[dict], cache_tokens: int) -> str:
    lines = [f"| model | variant | prefill ms (B1 T2048) | x eager | decode step ms (B8, {cache_tokens} cached) | x eager | "
             "decode tok/s | rel err vs eager (prefill / decode) | note |", "|" + "---|" * 9]
    eager = {(r["model"]): r for r in rows if r["variant"] == "eager"}
    for r in rows:
        e = eager.get(r["model"], {})

        def ratio(key):
            return f"{e[key] / r[key]:.2f}x" if key in r and key in e else "-"
        lines.append(f"| {r['model']} | {r['variant']} | {r.get('prefill_ms', float('nan')):.2f} | {ratio('prefill_ms')} | "
                     f"{r.get('decode_ms', float('nan')):.2f} | {ratio('decode_ms')} | {r.get('decode_tok_s', 0):.0f} | "
                     f"{r.get('prefill_rel_err_vs_eager', 0):.1e} / {r.get('decode_rel_err_vs_eager', 0):.1e} | "
                     f"{r.get('error', '')} {r.get('regions', '')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="-cg: mode='reduce-overhead' (CUDA graphs)")
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="tiny zoo models on the CPU")
    ap.add_argument("--cache-tokens", type=int, default=512, help="cached tokens before the timed decode step")
    args = ap.parse_args()
    quiet_transformers()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    models = ["deepseek_v2", "mamba2", "mixtral"] if args.smoke else args.models.split(",")
    variants = [v for v in args.variants.split(",") if cuda or not v.endswith("-cg")]
    sizes = (32, 2, 16) if args.smoke else (2048, 8, args.cache_tokens)
    rows = []
    for name in models:
        rows += run_model(name, variants, device, dtype, *sizes, hybrid_explain=True)
    text = table(rows, sizes[2])
    print(text)
    write(args.out, "models", rows, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
