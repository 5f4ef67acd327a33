"""hybrid::varlen_attention's Triton kernel (the engine's packed steps) over a sweep of launch configs, on the step
shapes that matter: a prefill of 16 fresh 512-token prompts (Mixtral / Llama-8B heads: 32 query, 8 kv, 128 wide),
against SDPA over the same prompts as dense padded rows (what the engine's padded steps run); a mixed step (64
decodes at 1K keys + 2 chunks of 2K continuing 2K cached); decodes alone; MLA's expanded form (16 heads, keys 192 /
values 128 wide). Each config's output is checked against the default config (and SDPA for the prefill).

    python bench/varlen.py [--out bench/results/DATE_varlen_h200.json] [--quick]
    python bench/varlen.py --compile-check     # no GPU: compile each config for sm_90, print regs / spills / smem
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import PEAK_FLOPS, log, write  # noqa: E402
from hybrid_kernels.attention.triton_varlen import launch_config, varlen_attention_triton  # noqa: E402
from hybrid_kernels.numerics import rel_err  # noqa: E402

BS = 16


def case(queries, contexts, hq, hkv, dk, dv, dtype=torch.bfloat16):
    """Packed queries and a paged buffer holding each sequence's keys in shuffled blocks."""
    g = torch.Generator().manual_seed(0)
    per = [-(-c // BS) for c in contexts]
    perm = (torch.randperm(sum(per), generator=g) + 1).tolist()
    table = torch.zeros(len(contexts), max(per), dtype=torch.int32)
    for s, n in enumerate(per):
        table[s, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    buf = torch.randn((sum(per) + 1) * BS, hkv, dv + dk, generator=g).to("cuda", dtype)
    q = torch.randn(sum(queries), hq, dk, generator=g).to("cuda", dtype)
    cu = torch.tensor([0] + list(itertools.accumulate(queries)), dtype=torch.int32, device="cuda")
    return q, buf, table.cuda(), cu, torch.tensor(contexts, dtype=torch.int32, device="cuda"), dv


def flops(queries, contexts, hq, dk, dv) -> float:
    """Score and value dots over the keys each query sees (causal)."""
    seen = sum(sum(c - n + i + 1 for i in range(n)) for n, c in zip(queries, contexts))
    return 2.0 * seen * hq * (dk + dv)


def bench_ms(fn, rep: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def sdpa_prefill(q, buf, table, cu, ctx, dv, n_seqs, n):
    """The padded steps' attention: dense [B, H, T, D] rows through SDPA (causal, GQA), keys gathered from the pages
    beforehand (not timed)."""
    hq, hkv, dk = q.shape[1], buf.shape[1], q.shape[2]
    j = torch.arange(n, device="cuda")
    rows = (table[:, j // BS].long() * BS + j % BS)  # [B, T]
    kv = buf[rows]  # [B, T, Hkv, Dv + Dk]
    k = kv[..., dv:].transpose(1, 2).contiguous()
    v = kv[..., :dv].transpose(1, 2).contiguous()
    qd = q.view(n_seqs, n, hq, dk).transpose(1, 2).contiguous()
    return lambda: torch.nn.functional.scaled_dot_product_attention(qd, k, v, is_causal=True, enable_gqa=hkv != hq), \
        lambda out: out.transpose(1, 2).reshape(n_seqs * n, hq, dv)


GRID = [dict(rows=r, block_n=b, num_warps=w, num_stages=st) for r, b, w, st in itertools.product(
    (64, 128), (32, 64, 128), (4, 8), (2, 3))]


def compile_check(out: str | None) -> None:
    """Every config of the sweep compiled for sm_90 on this machine (bf16, Mixtral's heads; MLA's expanded widths; one
    with sinks and soft-capping): shared memory, wgmma, registers and spills, no GPU needed."""
    from bench.moe import compile_offline
    from hybrid_kernels.attention import triton_varlen
    real, rows, lines = triton_varlen._varlen_kernel, [], ["| heads | dk/dv | config | extras | smem B | wgmma | regs | "
                                                           "spills B |", "|---|---|---|---|---|---|---|---|"]
    shapes = [(32, 8, 128, 128, False), (16, 16, 192, 128, False), (64, 8, 64, 64, True)]
    for (hq, hkv, dk, dv, extras), cfg in itertools.product(shapes, GRID):
        launches = []

        class _Record:
            def __getitem__(self, grid):
                return lambda *a, **kw: launches.append((a, kw))

        meta = dict(device="meta", dtype=torch.bfloat16)
        q, buf = torch.empty(1024, hq, dk, **meta), torch.empty(4096, hkv, dv + dk, **meta)
        table = torch.empty(8, 64, device="meta", dtype=torch.int32)
        cu, ctx = torch.empty(9, device="meta", dtype=torch.int32), torch.empty(8, device="meta", dtype=torch.int32)
        triton_varlen._varlen_kernel = _Record()
        try:
            varlen_attention_triton(q, buf, table, cu, ctx, dv, BS, 0, 0.1, torch.empty(hq, device="meta") if extras
                                    else None, 30.0 if extras else 0.0, config=cfg)
        finally:
            triton_varlen._varlen_kernel = real
        a, kw = launches[0]
        rep = dict(heads=f"{hq}/{hkv}", dims=f"{dk}/{dv}", config=cfg, extras=extras,
                   **compile_offline(real, a, kw))
        rows.append(rep)
        c = f"{cfg['rows']}x{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']}"
        lines.append(f"| {hq}/{hkv} | {dk}/{dv} | {c} | {'sinks+cap' if extras else '-'} | {rep['shared']} | "
                     f"{rep['wgmma']} | {rep['regs']} | {rep['spill_bytes']} |")
        log("varlen", lines[-1])
    write(out, "varlen attention configs compiled for sm_90", rows, "\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="a few configs")
    ap.add_argument("--compile-check", action="store_true", help="no GPU: compile the configs for sm_90")
    args = ap.parse_args()
    if args.compile_check:
        return compile_check(args.out)
    cases = {
        "prefill 16x512 (32/8 heads, 128)": ([512] * 16, [512] * 16, 32, 8, 128, 128),
        "mixed 64 dec@1K + 2x2K chunks@4K": ([1] * 64 + [2048] * 2, [1024] * 64 + [4096] * 2, 32, 8, 128, 128),
        "decodes 64@2K": ([1] * 64, [2048] * 64, 32, 8, 128, 128),
        "MLA expanded 16x512 (16 heads, 192/128)": ([512] * 16, [512] * 16, 16, 16, 192, 128),
    }
    grid = GRID
    if args.quick:
        grid = [dict(rows=64, block_n=64, num_warps=4, num_stages=2), dict(rows=128, block_n=64, num_warps=8,
                                                                            num_stages=3)]
    rows, lines = [], ["| case | config | ms | TFLOP/s | % of peak | x default | x SDPA | rel err |", "|---|---|---|---|---|---|---|---|"]
    for name, (queries, contexts, hq, hkv, dk, dv) in cases.items():
        args_ = case(queries, contexts, hq, hkv, dk, dv)
        q, buf, table, cu, ctx, _ = args_
        scale = 1 / math.sqrt(dk)
        fl = flops(queries, contexts, hq, dk, dv)
        ref = varlen_attention_triton(q, buf, table, cu, ctx, dv, BS, 0, scale)
        base = bench_ms(lambda: varlen_attention_triton(q, buf, table, cu, ctx, dv, BS, 0, scale))
        sdpa_ms = None
        if name.startswith("prefill"):
            run, unpack = sdpa_prefill(q, buf, table, cu, ctx, dv, len(queries), queries[0])
            sdpa_ms = bench_ms(run)
            err = rel_err(ref, unpack(run()))
            log("varlen", f"{name}: SDPA {sdpa_ms:.3f} ms; default kernel vs SDPA rel err {err:.1e}")
            lines.append(f"| {name} | SDPA (padded steps) | {sdpa_ms:.3f} | {fl / sdpa_ms / 1e9:.0f} | "
                         f"{100 * fl / sdpa_ms / 1e9 / (PEAK_FLOPS / 1e12):.0f} | {base / sdpa_ms:.2f} | 1.00 | - |")
        results = []
        for cfg in grid:
            try:
                out = varlen_attention_triton(q, buf, table, cu, ctx, dv, BS, 0, scale, config=cfg)
                ms = bench_ms(lambda: varlen_attention_triton(q, buf, table, cu, ctx, dv, BS, 0, scale, config=cfg))
            except Exception as e:  # noqa: BLE001  (a config that does not fit shared memory)
                log("varlen", f"{name} {cfg}: {type(e).__name__}: {str(e)[:80]}")
                continue
            err = rel_err(out, ref)
            results.append((ms, cfg, err))
            rows.append(dict(case=name, config=cfg, ms=ms, default_ms=base, sdpa_ms=sdpa_ms, tflops=fl / ms / 1e9,
                             rel_err=err))
        results.sort(key=lambda r: r[0])
        default = launch_config(sum(queries), len(queries), triton.next_power_of_2(dk), triton.next_power_of_2(dv))
        for ms, cfg, err in results[:6] + [r for r in results if r[1] == default]:
            c = f"{cfg['rows']}x{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']}"
            lines.append(f"| {name} | {c} | {ms:.3f} | {fl / ms / 1e9:.0f} | {100 * fl / ms / 1e9 / (PEAK_FLOPS / 1e12):.0f}"
                         f" | {ms / base:.2f} | {'-' if sdpa_ms is None else f'{ms / sdpa_ms:.2f}'} | {err:.1e} |")
        log("varlen", f"{name}: default {base:.3f} ms, best {results[0][0]:.3f} ms {results[0][1]}")
    table_md = "\n".join(lines)
    print(table_md)
    write(args.out, "varlen attention configs", rows, table_md)


if __name__ == "__main__":
    main()
