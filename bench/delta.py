"""Gated delta-rule kernels (hybrid_kernels/delta) against flash-linear-attention and HF's torch paths, on one GPU.

  python bench/delta.py --out bench/results/DATE_delta_h200.json   # H200, a few minutes
  python bench/delta.py --smoke                                     # tiny shapes (CPU interpreter or GPU)

Shapes: Qwen3-Next-80B-A3B's Gated DeltaNet (16 key / 32 value heads x 128, decay per head) and
Kimi-Linear-48B-A3B's KDA (32 heads x 128, decay per key channel), bf16 q/k/v, fp32 states, qk L2-norm in the
kernel. Prefill B = 1 at T = 4K-32K: hybrid's chunked kernels vs fla's ``chunk_gated_delta_rule`` / ``chunk_kda``
(same run, same inputs) and HF's torch chunked path (at 4K; it is a python loop over chunks). Decode: one token
per row from a state table, in place, B = 1 / 64 / 256, against fla's fused recurrent kernels and the state's copy
bandwidth (a same-size device copy, measured in the run). Every row is checked against fla (or the reference)
before it is timed; failures are recorded in the row.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import HBM_BPS, log, write  # noqa: E402

SHAPES = {"qwen3-next": dict(HK=16, HV=32, K=128, V=128, per_channel=False),
          "kimi-linear": dict(HK=32, HV=32, K=128, V=128, per_channel=True)}


def cuda_ms(fn, rep: int = 20) -> float:
    """Median of CUDA-event timings in ms."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def inputs(B, T, HK, HV, K, V, per_channel, dev, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
    q, k, v = r(B, T, HK, K), r(B, T, HK, K), r(B, T, HV, V)
    # decays as the models' gates give them: -exp(A_log) * softplus(x + dt_bias), A in [1, 16]
    a = torch.randn(*((B, T, HV, K) if per_channel else (B, T, HV)), generator=g) - 4.0
    A = torch.empty(HV).uniform_(1, 16, generator=g)
    A = A.view(1, 1, HV, 1) if per_channel else A.view(1, 1, HV)
    gl = (-A * torch.nn.functional.softplus(a)).to(dev, torch.float32)
    beta = torch.rand(B, T, HV, generator=g).to(dev, dtype)
    return q, k, v, gl, beta


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def fla_fns():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001
        log("delta", f"flash-linear-attention not importable: {type(e).__name__}: {e}")
        return None
    return dict(chunk=(chunk_gated_delta_rule, chunk_kda), step=(fused_recurrent_gated_delta_rule, fused_recurrent_kda))


def fla_call(fn, q, k, v, g, beta, state):
    """fla on the same inputs, q/k with their own head count (fla maps value head h to key head h // (HV / HK), as
    HF's repeat_interleave does). By keyword: fla's fused recurrent gated delta rule takes gk and gv between g and
    beta."""
    return fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


def prefill_rows(lengths, fla, dev, save=lambda rows: None):
    from passes.prepare import hub_function
    from hybrid_kernels.delta.triton_chunk import delta_rule_chunk_triton
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    rows = []
    for name, s in SHAPES.items():
        hf_fn = chunk_kimi_delta_attention if s["per_channel"] else torch_chunk_gated_delta_rule
        # HF's torch path itself: its hub wrapper (transformers >= 5.25) or decorator dispatches to fla when installed
        hf_fn = hub_function(hf_fn) or hf_fn
        hf_fn = getattr(hf_fn, "__wrapped__", hf_fn)
        for T in lengths:
            row = dict(section="prefill", shape=name, T=T)
            try:
                q, k, v, g, beta = inputs(1, T, s["HK"], s["HV"], s["K"], s["V"], s["per_channel"], dev)
                h0 = torch.randn(1, s["HV"], s["K"], s["V"], device=dev) * 0.1
                ours = lambda: delta_rule_chunk_triton(q, k, v, g, beta, s["K"] ** -0.5, h0)  # noqa: E731
                o, st = ours()
                if fla:
                    fn = fla["chunk"][1 if s["per_channel"] else 0]
                    fo, fs = fla_call(fn, q, k, v, g, beta, h0)
                    torch.cuda.synchronize()
                    row.update(err_o_vs_fla=rel(o, fo), err_state_vs_fla=rel(st, fs))
                    row["fla_ms"] = cuda_ms(lambda: fla_call(fn, q, k, v, g, beta, h0))
                    row["fla_kernels_ms"] = kernel_times(lambda: fla_call(fn, q, k, v, g, beta, h0))
                row["hybrid_ms"] = cuda_ms(ours)
                row["kernels_ms"] = kernel_times(ours)
                if T <= 4096:
                    hf = lambda: hf_fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,  # noqa: E731
                                       use_qk_l2norm_in_kernel=True)
                    ho, hs = hf()
                    row.update(err_o_vs_hf=rel(o, ho), err_state_vs_hf=rel(st, hs), hf_ms=cuda_ms(hf, rep=3))
                if "fla_ms" in row:
                    row["vs_fla"] = row["fla_ms"] / row["hybrid_ms"]
                if "hf_ms" in row:
                    row["vs_hf"] = row["hf_ms"] / row["hybrid_ms"]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            log("prefill", row)
            rows.append(row)
            save(rows)  # a run cut short keeps the rows it measured
            torch.cuda.empty_cache()
    return rows


def kernel_times(fn) -> dict:
    """GPU time per kernel name of one call (torch.profiler), in ms: where a call's time goes."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            out[e.key[:40]] = round(t / 1e3, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:6])


def decode_sweep(dev) -> list[dict]:
    """The step kernel's value block and warps at B = 64, both shapes (bench/TUNING.md)."""
    from hybrid_kernels.delta.triton_config import CONFIG
    from hybrid_kernels.delta.triton_step import delta_rule_step_triton
    rows, saved = [], dict(CONFIG["step"])
    for name, s in SHAPES.items():
        B = 64
        table = torch.randn(B * 4, s["HV"], s["K"], s["V"], device=dev) * 0.1
        idx = torch.randperm(B * 4, device=dev)[:B].to(torch.int32)
        q, k, v, g, beta = inputs(B, 1, s["HK"], s["HV"], s["K"], s["V"], s["per_channel"], dev)
        for bv in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                CONFIG["step"].update(BV=bv, warps=warps)
                try:
                    ms = cuda_ms(lambda: delta_rule_step_triton(q, k, v, g, beta, 0.1, table, table, idx), rep=30)
                    gbps = 2 * B * s["HV"] * s["K"] * s["V"] * 4 / ms / 1e6
                    rows.append(dict(section="decode_sweep", shape=name, B=B, BV=bv, warps=warps, ms=ms, GBps=gbps))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(section="decode_sweep", shape=name, BV=bv, warps=warps, error=str(e)[:200]))
                log("sweep", rows[-1])
    CONFIG["step"].clear()
    CONFIG["step"].update(saved)
    return rows


#: launch-parameter variants the prefill sweep times, each over CONFIG["chunk"]'s defaults
SWEEP = ({}, {"split": True}, {"dot16": True}, {"split": True, "dot16": True}, {"pair_prec": "tf32"},
         {"pair_prec": "16"}, {"split": True, "dot16": True, "pair_prec": "16"}, {"split": True, "prepare_warps": 8},
         {"C": 32, "dot16": True}, {"state16": True}, {"split": True, "dot16": True, "state16": True})


def prefill_sweep(dev, T: int = 4096, save=lambda rows: None) -> list[dict]:
    """The prefill kernels' launch parameters (``SWEEP``) at one length, every shape: GPU time per kernel and the
    output's and final state's relative error against the first variant's (bench/TUNING.md)."""
    from hybrid_kernels.delta import triton_chunk
    from hybrid_kernels.delta.triton_config import CONFIG
    rows, saved = [], dict(CONFIG["chunk"])
    for name, s in SHAPES.items():
        q, k, v, g, beta = inputs(1, T, s["HK"], s["HV"], s["K"], s["V"], s["per_channel"], dev)
        first = None
        for variant in SWEEP:
            CONFIG["chunk"].clear()
            CONFIG["chunk"].update(saved, **variant)
            triton_chunk._CHUNK_FITS.clear()
            row = dict(section="prefill_sweep", shape=name, T=T, variant=variant)
            try:
                fn = lambda: triton_chunk.delta_rule_chunk_triton(q, k, v, g, beta, s["K"] ** -0.5)  # noqa: E731
                o, st = fn()
                if first is None:
                    first = (o, st)
                row.update(err_o=rel(o, first[0]), err_state=rel(st, first[1]))
                row.update(ms=cuda_ms(fn), kernels_ms=kernel_times(fn), C_run=triton_chunk._CHUNK_FITS.get(
                    (s["K"], s["V"], s["per_channel"], v.dtype, v.device)))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            log("sweep", row)
            rows.append(row)
            save(rows)
    CONFIG["chunk"].clear()
    CONFIG["chunk"].update(saved)
    triton_chunk._CHUNK_FITS.clear()
    return rows


def decode_rows(batches, fla, dev):
    from hybrid_kernels.delta.triton_step import delta_rule_step_triton
    rows = []
    for name, s in SHAPES.items():
        for B in batches:
            row = dict(section="decode", shape=name, B=B)
            try:
                S = max(B, 8) * 4  # a state table larger than the batch, rows spread over it
                table = torch.randn(S, s["HV"], s["K"], s["V"], device=dev) * 0.1
                idx = torch.randperm(S, device=dev)[:B].to(torch.int32)
                q, k, v, g, beta = inputs(B, 1, s["HK"], s["HV"], s["K"], s["V"], s["per_channel"], dev)
                ref_table = table.clone()
                o = delta_rule_step_triton(q, k, v, g, beta, s["K"] ** -0.5, table, table, idx)
                if fla:
                    fn = fla["step"][1 if s["per_channel"] else 0]
                    torch.cuda.synchronize()
                    st = ref_table[idx.long()].contiguous()
                    fo, fs = fla_call(fn, q, k, v, g, beta, st)
                    torch.cuda.synchronize()
                    row.update(err_o_vs_fla=rel(o, fo), err_state_vs_fla=rel(table[idx.long()], fs))
                    row["fla_ms"] = cuda_ms(lambda: fla_call(fn, q, k, v, g, beta, st), rep=50)
                row["hybrid_ms"] = cuda_ms(lambda: delta_rule_step_triton(q, k, v, g, beta, s["K"] ** -0.5, table,
                                                                          table, idx), rep=50)
                state_bytes = B * s["HV"] * s["K"] * s["V"] * 4
                src = torch.empty(state_bytes // 4, device=dev)
                dst = torch.empty_like(src)
                row["copy_ms"] = cuda_ms(lambda: dst.copy_(src), rep=50)
                row["hybrid_GBps"] = 2 * state_bytes / row["hybrid_ms"] / 1e6
                row["copy_GBps"] = 2 * state_bytes / row["copy_ms"] / 1e6
                row["of_copy_bw"] = row["copy_ms"] / row["hybrid_ms"]
                row["of_peak_bw"] = row["hybrid_GBps"] * 1e9 / HBM_BPS
                if "fla_ms" in row:
                    row["vs_fla"] = row["fla_ms"] / row["hybrid_ms"]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            log("decode", row)
            rows.append(row)
    return rows


def table_md(rows) -> str:
    out = ["| section | shape | T / B | hybrid ms | fla ms | vs fla | HF torch ms | vs HF | of copy bw | err vs fla |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    f = lambda x, p=3: "" if x is None else (f"{x:.{p}f}" if isinstance(x, float) else str(x))  # noqa: E731
    for r in rows:
        if r["section"] not in ("prefill", "decode"):
            continue
        out.append(f"| {r['section']} | {r['shape']} | {r.get('T', r.get('B'))} | {f(r.get('hybrid_ms'))} | "
                   f"{f(r.get('fla_ms'))} | {f(r.get('vs_fla'), 2)} | {f(r.get('hf_ms'))} | {f(r.get('vs_hf'), 1)} | "
                   f"{f(r.get('of_copy_bw'), 2)} | {f(r.get('err_o_vs_fla'), 4)} {r.get('error', '')} |")
    kernels = [f"- {r['shape']} T={r['T']}: {r['kernels_ms']}" + (f"; fla: {r['fla_kernels_ms']}" if r.get(
        "fla_kernels_ms") else "") for r in rows if r.get("kernels_ms")]
    return "\n".join(out + ["", "GPU time per kernel of one prefill call (ms):", *kernels])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sections", default="prefill,decode,decode_sweep",
                    help="comma-separated: prefill, decode, prefill_sweep, decode_sweep")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--no-fla", action="store_true", help="leave out the fla baseline (its first calls autotune)")
    ap.add_argument("--lengths", help="comma-separated prefill lengths (default 4096,16384,32768)")
    ap.add_argument("--sweep-length", type=int, default=4096, help="the prefill sweep's T")
    ap.add_argument("--chunk-config", help='JSON over hybrid_kernels/delta CONFIG["chunk"], e.g. \'{"state_stages": 2}\'')
    args = ap.parse_args()
    if args.chunk_config:
        import json

        from hybrid_kernels.delta.triton_config import CONFIG
        CONFIG["chunk"].update(json.loads(args.chunk_config))
    sections = set(args.sections.split(","))
    for name in set(SHAPES) - set(args.shapes.split(",")):
        SHAPES.pop(name)
    dev = "cuda"
    fla = None if args.no_fla else fla_fns()
    lengths, batches = ([256], [2]) if args.smoke else ([4096, 16384, 32768], [1, 64, 256])
    if args.lengths:
        lengths = [int(t) for t in args.lengths.split(",")]
    rows = []
    if "prefill" in sections:
        rows += prefill_rows(lengths, fla, dev, lambda done: write(args.out, "delta", done, table_md(done)))
    if "decode" in sections:
        rows += decode_rows(batches, fla, dev)
    write(args.out, "delta", rows, table_md(rows))
    sweep = (prefill_sweep(dev, args.sweep_length, lambda done: write(args.out, "delta", rows + done, table_md(rows)))
             if "prefill_sweep" in sections else []) + \
        (decode_sweep(dev) if "decode_sweep" in sections else [])
    md = table_md(rows) + "\n\n" + "\n".join(f"- {r}" for r in sweep)
    rows += sweep
    print(md)
    write(args.out, "delta", rows, md)


if __name__ == "__main__":
    main()
