"""Sweep SSD chunked-scan launch configs at one shape (GPU): prints M tokens/s per config.

    python bench/ssd_sweep.py --heads 128 --tokens 8192,32768
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.ops.ssm import kernels  # noqa: E402
from runtime.ops.ssm import reference  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time at the shipped CONFIG, no sweep")
    args = ap.parse_args()
    import triton
    H, P, N, G = args.heads, 64, 128, 1
    base = copy.deepcopy(kernels.CONFIG["ssd"])
    grid = [dict(CHUNK=c, BLOCK_M=m, BLOCK_K=k, num_warps=w, num_stages=s, CB=cb)
            for c, m, k, w, s, cb in itertools.product((256, 128), (64, 128), (64,), (4, 8), (2, 3), (True,))
            if m <= c]
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(1, T, H, P, device="cuda", dtype=torch.bfloat16, generator=g)
        dt = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, generator=g) - 2
        A = -torch.rand(H, device="cuda", generator=g) - 0.5
        Bm = torch.randn(1, T, G, N, device="cuda", dtype=torch.bfloat16, generator=g)
        Cm = torch.randn(1, T, G, N, device="cuda", dtype=torch.bfloat16, generator=g)
        D = torch.randn(H, device="cuda")
        dtb = torch.randn(H, device="cuda")
        ref = None
        if args.profile:
            profile(lambda: kernels.ssd_scan_triton(x, dt, A, Bm, Cm, 256, D, None, dtb, True, 0.0, float("inf"), None),
                    T, H)
            continue
        for cfg in grid:
            kernels.CONFIG["ssd"] = {**base, **cfg}
            try:
                fn = lambda: kernels.ssd_scan_triton(x, dt, A, Bm, Cm, 256, D, None, dtb, True, 0.0, float("inf"), None)
                y, _ = fn()
                if ref is None:
                    ref = y.float()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                row = dict(T=T, **cfg, ms=round(ms, 4), Mtok_s=round(T / ms / 1e3, 2), err_vs_first=err)
            except Exception as e:  # noqa: BLE001
                row = dict(T=T, **cfg, error=str(e)[:120])
            rows.append(row)
            print(json.dumps(row), flush=True)
    best = {}
    for r in rows:
        if "Mtok_s" in r and (r["T"] not in best or r["Mtok_s"] > best[r["T"]]["Mtok_s"]):
            best[r["T"]] = r
    print("BEST", json.dumps(best))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows=rows, best=best), indent=1))
    return 0


def profile(fn, T: int, H: int) -> None:
    """Per-kernel GPU time of one call (median over 20 profiled calls), to see where the scan's time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        ms = ev.device_time_total / 20 / 1e3
        if ms > 0:
            total += ms
            print(f"  T={T} H={H} {ev.key[:60]:60s} {ms:8.4f} ms/call ({ev.count // 20} launches)", flush=True)
    print(f"  T={T} H={H} total {total:.4f} ms/call = {T / total / 1e3:.2f} M tok/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
