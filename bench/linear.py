"""Decode-time linear layers: hybrid's skinny Triton GEMMs vs cuBLAS (torch.nn.functional.linear).

    python bench/linear.py --out bench/results/linear.json        # GPU: every Linear shape of the three -shape models
    python bench/linear.py --sweep                                # also sweep launch configs (M = 1 and 8)
    python bench/linear.py --smoke                                # CPU, interpreter, two tiny shapes

Shapes: every distinct nn.Linear (out, in) of the zoo's deepseek-v2-lite-shape, mamba2-2.7b-shape and
mixtral-8x7b-shape models (read from a meta-device build), at M decode rows. Timing models a decode step: the weights
are cold (a CUDA graph of R calls cycles through enough copies of the weight to cover 256 MB, 5x the L2), calls are
back to back in one graph, and the time per call is the replay time / R (median of 5 replays), launch gaps
included. Bytes = weight + x + y; % of 4.3 TB/s. Correctness: each result vs F.linear in fp32 before timing.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit module is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import HBM_BPS, log, write  # noqa: E402
from runtime.ops.linear import pick_config, skinny_linear_triton  # noqa: E402

MODELS = ["deepseek-v2-lite-shape", "mamba2-2.7b-shape", "mixtral-8x7b-shape"]


def tag(msg):
    log("linear", msg)


def model_shapes(names: list[str]) -> list[tuple[str, str, int, int]]:
    """(model, first layer name, N, K) for every distinct Linear shape."""
    import transformers

    from compiler import zoo
    out, seen = [], set()
    for name in names:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(zoo.make_config(name))
        for mod_name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and mod.out_features >= 64:
                key = (name, mod.out_features, mod.in_features)
                if key not in seen:
                    seen.add(key)
                    out.append((name, mod_name.replace("model.layers.", "L"), mod.out_features, mod.in_features))
    return out


def sweep_configs(M: int) -> list[dict]:
    cfgs = []
    if M == 1:
        for bn, bk, w, st in itertools.product([4, 8, 16, 32], [256, 512], [4, 8], [3, 4]):
            cfgs.append(dict(kind="gemv", block_n=bn, block_k=bk, warps=w, stages=st))
    for bn, bk, st in itertools.product([16, 32, 64], [64, 128, 256], [3, 4, 5]):
        cfgs.append(dict(kind="dot", block_n=bn, block_k=bk, warps=4, stages=st))
    return cfgs


def per_call_us(calls) -> float:
    """calls: list of R thunks; one CUDA graph runs them back to back; us per call (median of 5 replays)."""
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()  # warm-up: compiles outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def row(model, layer, N, K, M, args, dev, dtype) -> dict:
    wbytes = N * K * 2
    copies = max(2, min(128, -(-(256 << 20) // wbytes))) if dev == "cuda" else 1
    g = torch.Generator(device=dev).manual_seed(N * 7 + K)
    ws = [torch.randn(N, K, device=dev, dtype=dtype, generator=g) / K ** 0.5 for _ in range(copies)]
    x = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
    ref = torch.nn.functional.linear(x.float(), ws[0].float())
    picked = pick_config(M, N, K)
    got = skinny_linear_triton(x, ws[0], config=picked).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    r = dict(model=model, layer=layer, M=M, N=N, K=K, weight_mb=wbytes / 2**20, rel_err=err, picked=picked)
    if dev != "cuda":
        return r
    nbytes = wbytes + M * K * 2 + M * N * 2
    R = max(8, copies)
    r["cublas_us"] = per_call_us([lambda i=i: torch.nn.functional.linear(x, ws[i % copies]) for i in range(R)])
    r["ours_us"] = per_call_us([lambda i=i: skinny_linear_triton(x, ws[i % copies], config=picked) for i in range(R)])
    if args.sweep and M in (1, 8):
        best = None
        for cfg in sweep_configs(M):
            try:
                t = per_call_us([lambda i=i: skinny_linear_triton(x, ws[i % copies], config=cfg) for i in range(R)])
            except Exception as e:  # noqa: BLE001  (a config that does not fit is skipped)
                tag(f"  {cfg}: {type(e).__name__}")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        r["best_us"], r["best"] = best
    for k in ("cublas_us", "ours_us", "best_us"):
        if k in r:
            r[k.replace("_us", "_pct")] = 100 * nbytes / (r[k] * 1e-6) / HBM_BPS
    tag(f"{model} {layer} M={M} N={N} K={K}: cuBLAS {r['cublas_us']:.2f} us, ours {r['ours_us']:.2f} us"
        + (f", best {r['best_us']:.2f} us {r['best']}" if "best_us" in r else "") + f", err {err:.1e}")
    return r


def table(rows: list[dict]) -> str:
    lines = ["| model | layer | M | N x K | MB | cuBLAS us (% of 4.3 TB/s) | ours us (%) | x cuBLAS | best swept us | "
             "best config | rel err |", "|" + "---|" * 11]
    for r in rows:
        f = lambda k: f"{r[k]:.2f} ({r[k.replace('_us', '_pct')]:.0f}%)" if k in r else "-"  # noqa: E731
        ratio = f"{r['cublas_us'] / r['ours_us']:.2f}x" if "ours_us" in r else "-"
        best = r.get("best")
        bcfg = f"{best['kind']} n{best['block_n']} k{best['block_k']} w{best['warps']} s{best['stages']}" if best else "-"
        lines.append(f"| {r['model']} | {r['layer']} | {r['M']} | {r['N']} x {r['K']} | {r['weight_mb']:.1f} | "
                     f"{f('cublas_us')} | {f('ours_us')} | {ratio} | {f('best_us')} | {bcfg} | {r['rel_err']:.1e} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rows", default="1,2,4,8,16", help="decode rows M")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of launch configs at M = 1 and 8")
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, two small shapes")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = ([("smoke", "a", 72, 40), ("smoke", "b", 33, 130)] if args.smoke
              else model_shapes(args.models.split(",")))
    rows = []
    for model, layer, N, K in shapes:
        for M in [int(m) for m in args.rows.split(",")]:
            rows.append(row(model, layer, N, K, M, args, dev, dtype))
        write(args.out, "linear", rows, table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
