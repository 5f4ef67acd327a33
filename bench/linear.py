"""Decode-size linears: our skinny Triton kernel vs cuBLAS (F.linear), bf16, on the H200.

    python bench/linear.py --out linear.json            # table at M = 1, 8, 16 for the zoo models' decode linears
    python bench/linear.py --sweep                      # also try launch configs per shape at M = 8

Bytes = W + x + y; % of 4.3 TB/s. Timing: triton.testing.do_bench median (L2 flushed between calls: a decode step
streams more weights than L2 holds). Each row is checked against F.linear first.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from bench.common import HBM_BPS, environment, log  # noqa: E402
from runtime.ops.linear.kernels import skinny_linear_triton  # noqa: E402

SHAPES = {  # name: (N, K)
    "mamba2 in_proj": (10576, 2560), "mamba2 out_proj": (2560, 5120), "mamba2 lm_head": (50280, 2560),
    "dsv2 q_proj": (3072, 2048), "dsv2 kv_a_proj": (576, 2048), "dsv2 o_proj": (2048, 2048),
    "dsv2 shared gate": (2816, 2048), "dsv2 shared down": (2048, 2816),
    "mixtral q_proj": (4096, 4096), "mixtral kv_proj": (1024, 4096),
}
SWEEP = [dict(block_n=n, block_k=k, num_warps=w, num_stages=s)
         for n, k, w, s in itertools.product((16, 32, 64), (128, 256), (4,), (3, 4, 6))]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows, best = [], {}
    if args.sweep:
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
            times = [(bench(lambda c=c: skinny_linear_triton(x, w, config=c)), c) for c in SWEEP]
            t, c = min(times, key=lambda tc: tc[0])
            best[name] = c
            log("linear", f"sweep {name}: best {t * 1e3:.1f} us {c}; worst {max(times, key=lambda tc: tc[0])[0] * 1e3:.1f} us")
    print("| linear | N | K | M | cuBLAS us | % HBM | ours us | % HBM | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (1, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours = skinny_linear_triton(x, w, config=best.get(name))
            torch.testing.assert_close(ours.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
            t_ref = bench(lambda: F.linear(x, w))
            t_ours = bench(lambda: skinny_linear_triton(x, w, config=best.get(name)))
            nbytes = (n * k + m * k + m * n) * 2
            row = dict(linear=name, N=n, K=k, M=m, cublas_us=t_ref * 1e3, ours_us=t_ours * 1e3,
                       cublas_hbm=nbytes / (t_ref * 1e-3) / HBM_BPS, ours_hbm=nbytes / (t_ours * 1e-3) / HBM_BPS,
                       config=best.get(name))
            rows.append(row)
            print(f"| {name} | {n} | {k} | {m} | {row['cublas_us']:.1f} | {row['cublas_hbm']:.0%} | "
                  f"{row['ours_us']:.1f} | {row['ours_hbm']:.0%} | {t_ref / t_ours:.2f}x |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(env=environment(), rows=rows, sweep=best), indent=1))


if __name__ == "__main__":
    main()
