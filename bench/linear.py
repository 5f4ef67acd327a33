"""Decode-time linear layers: hybrid's one-row Triton kernels vs cuBLAS (torch.nn.functional.linear).

    python bench/linear.py --out bench/results/linear.json        # GPU: every Linear shape of the three -shape models
    python bench/linear.py --sweep                                # also sweep launch configs (M = 1 and 8)
    python bench/linear.py --smoke                                # CPU, interpreter, two tiny shapes
    python bench/linear.py --gated --rows 1,2,8,16 [--sweep]      # Mamba2's gated norm + out_proj, fused vs not
    python bench/linear.py --conv                                 # Mamba2's in_proj + conv update, fused vs not
    python bench/linear.py --norm [--sweep]                       # RMSNorm as the gemv's prologue vs a norm kernel
    python bench/linear.py --glu [--sweep]                        # RMSNorm + gate/up + silu * up in one gemv launch

Shapes: every distinct nn.Linear (out, in) of the zoo's deepseek-v2-lite-shape, mamba2-2.7b-shape and
mixtral-8x7b-shape models (read from a meta-device build), at M decode rows; and the groups of linears that share
an input (q_proj + kv_a_proj, gate_proj + up_proj, q/k/v_proj), one launch for the group against one cuBLAS call
each. "ours" is what ``hybrid::linear`` runs (``pick_config``; "-" where it leaves the shape to cuBLAS). Timing models a decode step: the weights
are cold (a CUDA graph of R calls cycles through enough copies of the weight to cover 256 MB, 5x the L2), calls are
back to back in one graph, and the time per call is the replay time / R (median of 5 replays), launch gaps
included; ours also without programmatic dependent launch (HYBRID_PDL=0). Bytes = weight + x + y; % of 4.3 TB/s. Correctness: each result vs F.linear in fp32 before timing.
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
from hybrid_kernels.linear.triton_gemv import linear_triton, pick_config  # noqa: E402

MODELS = ["deepseek-v2-lite-shape", "mamba2-2.7b-shape", "mixtral-8x7b-shape"]


def tag(msg):
    log("linear", msg)


#: sibling linears that read the same input (what passes/linear.py groups)
GROUPS = [("q_proj", "kv_a_proj_with_mqa"), ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]


def model_shapes(names: list[str]) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(model, first layer name, (N,) or the group's (N_1, N_2, ...), K) for every distinct Linear shape / group."""
    import transformers

    from runtime import zoo
    out, seen = [], set()
    for name in names:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(zoo.make_config(name))
        for mod_name, mod in model.named_modules():
            short = mod_name.replace("model.layers.", "L")
            found = [(short, (mod.out_features,), mod.in_features)] if isinstance(mod, torch.nn.Linear) \
                and mod.out_features >= 64 else []
            for group in GROUPS:
                subs = [getattr(mod, g, None) for g in group]
                if all(isinstance(m, torch.nn.Linear) for m in subs):
                    found.append((f"{short}.{'+'.join(group)}", tuple(m.out_features for m in subs),
                                  subs[0].in_features))
            for layer, Ns, K in found:
                if (name, Ns, K) not in seen:
                    seen.add((name, Ns, K))
                    out.append((name, layer, Ns, K))
    return out


def sweep_configs(M: int, n_weights: int, dot: bool = True) -> list[dict]:
    cfgs = []
    if M == 1:
        for bn, bk, w, st in itertools.product([1, 2, 4, 8], [512, 1024], [4, 8], [3, 4]):
            cfgs.append(dict(kind="gemv", block_n=bn, block_k=bk, warps=w, stages=st))
    if n_weights > 1:
        return cfgs
    if not dot:
        return cfgs
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


def cold_weights(N: int, K: int, dev, dtype, seed: int) -> tuple[list[torch.Tensor], torch.Generator]:
    """Copies of a random [N, K] weight covering 256 MB on the GPU (a graph that cycles through them reads each
    cold, as a decode step does; one copy elsewhere), and the generator for the rest of the row's data."""
    copies = max(2, min(128, -(-(256 << 20) // (N * K * 2)))) if dev == "cuda" else 1
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(N, K, device=dev, dtype=dtype, generator=g) / K ** 0.5 for _ in range(copies)], g


def add_pct(r: dict, nbytes: int) -> None:
    """For every "<name>_us" timing of the row, "<name>_pct": nbytes at that time as % of 4.3 TB/s."""
    for k in [k for k in r if k.endswith("_us")]:
        r[k.replace("_us", "_pct")] = 100 * nbytes / (r[k] * 1e-6) / HBM_BPS


def row(model, layer, Ns, K, M, args, dev, dtype) -> dict:
    wbytes = sum(Ns) * K * 2
    copies = max(2, min(128, -(-(256 << 20) // wbytes))) if dev == "cuda" else 1
    g = torch.Generator(device=dev).manual_seed(sum(Ns) * 7 + K)
    ws = [[torch.randn(n, K, device=dev, dtype=dtype, generator=g) / K ** 0.5 for n in Ns] for _ in range(copies)]
    x = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
    picked = pick_config(M, list(Ns), K)
    check = picked or (dict(kind="dot", block_n=16, block_k=128, warps=4, stages=3) if len(Ns) == 1 else None)
    err = None
    if check is not None:
        got = linear_triton(x, ws[0], config=check)
        err = max(((y.float() - torch.nn.functional.linear(x.float(), w.float())).abs().max()
                   / torch.nn.functional.linear(x.float(), w.float()).abs().max()).item() for y, w in zip(got, ws[0]))
    r = dict(model=model, layer=layer, M=M, N=Ns, K=K, weight_mb=wbytes / 2**20, rel_err=err, picked=picked)
    if dev != "cuda":
        return r
    nbytes = wbytes + M * K * 2 + M * sum(Ns) * 2
    R = max(8, copies)
    r["cublas_us"] = per_call_us([lambda i=i: [torch.nn.functional.linear(x, w) for w in ws[i % copies]]
                                  for i in range(R)])
    if picked is not None:
        r["ours_us"] = per_call_us([lambda i=i: linear_triton(x, ws[i % copies], config=picked) for i in range(R)])
        os.environ["HYBRID_PDL"] = "0"  # the same kernels launched without programmatic dependent launch
        try:
            r["nopdl_us"] = per_call_us([lambda i=i: linear_triton(x, ws[i % copies], config=picked)
                                         for i in range(R)])
        finally:
            os.environ.pop("HYBRID_PDL")
    if args.sweep and M in (1, 8) and (len(Ns) == 1 or M == 1):
        best = None
        for cfg in sweep_configs(M, len(Ns)):
            try:
                t = per_call_us([lambda i=i: linear_triton(x, ws[i % copies], config=cfg) for i in range(R)])
            except Exception as e:  # noqa: BLE001  (a config that does not fit is skipped)
                tag(f"  {cfg}: {type(e).__name__}")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        r["best_us"], r["best"] = best
    add_pct(r, nbytes)
    tag(f"{model} {layer} M={M} N={Ns} K={K}: cuBLAS {r['cublas_us']:.2f} us, ours {r.get('ours_us', '-')} us"
        + (f", best {r['best_us']:.2f} us {r['best']}" if "best_us" in r else "") + f", err {err}")
    return r


def gated_row(N: int, K: int, M: int, args, dev, dtype) -> dict:
    """Mamba2's decode tail: gated RMSNorm then out_proj. ours: one launch (the norm as the prologue); before: the
    norm kernel then hybrid::linear (Triton at one row, cuBLAS at more); also the norm then cuBLAS."""
    from hybrid_kernels.ssm.triton_norm import gated_rms_norm_triton
    wbytes = N * K * 2
    ws, g = cold_weights(N, K, dev, dtype, N + K + M)
    copies = len(ws)
    y = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
    z = torch.randn(M, 2 * K, device=dev, dtype=dtype, generator=g)[:, K // 2:K // 2 + K]  # a slice, as the gate is
    nw = 1 + 0.1 * torch.randn(K, device=dev, dtype=dtype, generator=g)
    picked = pick_config(M, [N], K, gated=True)
    r = dict(model="mamba2 out_proj + gated norm", layer="out_proj", M=M, N=(N,), K=K, weight_mb=wbytes / 2**20,
             rel_err=None, picked=picked)
    if picked is not None:
        got = linear_triton(y, [ws[0]], config=picked, gate=(z, nw, 1e-5))[0].float()
        want = torch.nn.functional.linear(gated_rms_norm_triton(y, z, nw, 1e-5, K).float() if dev == "cuda" else
                                          _gated_ref(y, z, nw), ws[0].float())
        r["rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
    if dev != "cuda":
        return r
    import hybrid_kernels  # noqa: F401  (hybrid::linear)
    R = max(8, copies)
    nbytes = wbytes + 2 * M * K * 2 + M * N * 2
    r["cublas_us"] = per_call_us([lambda i=i: torch.nn.functional.linear(gated_rms_norm_triton(y, z, nw, 1e-5, K),
                                                                         ws[i % copies]) for i in range(R)])
    r["before_us"] = per_call_us([lambda i=i: torch.ops.hybrid.linear(gated_rms_norm_triton(y, z, nw, 1e-5, K),
                                                                      ws[i % copies], None) for i in range(R)])
    if picked is not None:
        r["ours_us"] = per_call_us([lambda i=i: linear_triton(y, [ws[i % copies]], config=picked,
                                                              gate=(z, nw, 1e-5)) for i in range(R)])
    if args.sweep and M == 1:
        best = None
        for cfg in sweep_configs(M, 1, dot=False):
            t = per_call_us([lambda i=i: linear_triton(y, [ws[i % copies]], config=cfg, gate=(z, nw, 1e-5))
                             for i in range(R)])
            best = min(best or (t, cfg), (t, cfg), key=lambda b: b[0])
        r["best_us"], r["best"] = best
    add_pct(r, nbytes)
    tag(f"gated out_proj M={M} N={N} K={K}: norm+cuBLAS {r['cublas_us']:.2f} us, before {r['before_us']:.2f} us, "
        f"ours {r.get('ours_us', '-')} us" + (f", best {r['best_us']:.2f} us {r['best']}" if "best_us" in r else ""))
    return r


def _gated_ref(y, z, nw):
    from hybrid_kernels.ssm.reference import gated_rms_norm_ref
    return gated_rms_norm_ref(y, z, nw, 1e-5, y.shape[-1]).float()


def _cells(r: dict):
    """A row's formatter of timing cells ("us (% of HBM)"), its error cell and its best swept config cell."""
    f = lambda k: f"{r[k]:.2f} ({r[k.replace('_us', '_pct')]:.0f}%)" if k in r else "-"  # noqa: E731
    err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
    best = r.get("best")
    bcfg = f"{best['kind']} n{best['block_n']} k{best['block_k']} w{best['warps']} s{best['stages']}" if best else "-"
    return f, err, bcfg


def gated_table(rows: list[dict]) -> str:
    lines = ["| M | N x K | norm + cuBLAS us (% of 4.3 TB/s) | before: norm + hybrid::linear us (%) | ours, fused us (%) "
             "| x before | best swept us | best config | rel err |", "|" + "---|" * 9]
    for r in rows:
        f, err, bcfg = _cells(r)
        ratio = f"{r['before_us'] / r['ours_us']:.2f}x" if "ours_us" in r else "-"
        lines.append(f"| {r['M']} | {r['N'][0]} x {r['K']} | {f('cublas_us')} | {f('before_us')} | {f('ours_us')} | "
                     f"{ratio} | {f('best_us')} | {bcfg} | {err} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| model | layer | M | N x K | MB | cuBLAS us (% of 4.3 TB/s) | ours us (%) | x cuBLAS | ours without PDL "
             "us (%) | best swept us | best config | rel err |", "|" + "---|" * 12]
    for r in rows:
        f, err, bcfg = _cells(r)
        ratio = f"{r['cublas_us'] / r['ours_us']:.2f}x" if "ours_us" in r else "-"
        n = "+".join(map(str, r["N"]))
        lines.append(f"| {r['model']} | {r['layer']} | {r['M']} | {n} x {r['K']} | {r['weight_mb']:.1f} | "
                     f"{f('cublas_us')} | {f('ours_us')} | {ratio} | {f('nopdl_us')} | {f('best_us')} | {bcfg} | {err} |")
    return "\n".join(lines)


def conv_row(N: int, K: int, C: int, c0: int, dev, dtype) -> dict:
    """Mamba2's decode in projection with the conv update as its epilogue (``linear_conv_triton``), against the
    projection alone (same kernel and config: the epilogue's cost) and the projection then the conv-update kernel.
    Each call has its own weight copy and conv state (cold, as in a decode step)."""
    from hybrid_kernels.linear.triton_gemv import conv_config, linear_conv_triton
    from hybrid_kernels.ssm.triton_conv import causal_conv1d_update_triton
    wbytes = N * K * 2
    ws, g = cold_weights(N, K, dev, dtype, N + K)
    copies = len(ws)
    states = [torch.randn(1, C, 4, device=dev, dtype=dtype, generator=g) for _ in range(copies)]
    x = torch.randn(1, K, device=dev, dtype=dtype, generator=g)
    cw, cb = torch.randn(C, 4, device=dev, dtype=dtype, generator=g), torch.randn(C, device=dev, dtype=dtype, generator=g)
    cfg = conv_config(1, N, K) if dev == "cuda" else dict(kind="dot", block_n=16, block_k=64, warps=4, stages=3)
    st0 = states[0].clone()
    y, c = linear_conv_triton(x, ws[0], None, states[0], cw, cb, c0, config=cfg)
    want_st = st0.clone()
    want_y = torch.nn.functional.linear(x.float(), ws[0].float()).to(dtype)
    want_c = causal_conv1d_update_triton(want_y[:, c0:c0 + C], want_st, cw, cb, "silu", None)
    states[0].copy_(st0)
    r = dict(model="mamba2 in_proj + conv update", layer=f"{N}x{K}, conv {C}", M=1, N=(N,), K=K,
             weight_mb=wbytes / 2**20, picked=cfg,
             rel_err=max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                         for a, b in ((y, want_y), (c, want_c))))
    if dev != "cuda":
        return r
    R = max(8, copies)
    r["alone_us"] = per_call_us([lambda i=i: linear_triton(x, [ws[i % copies]], config=cfg) for i in range(R)])
    r["two_us"] = per_call_us([lambda i=i: causal_conv1d_update_triton(
        linear_triton(x, [ws[i % copies]], config=cfg)[0][:, c0:c0 + C], states[i % copies], cw, cb, "silu", None)
        for i in range(R)])
    r["ours_us"] = per_call_us([lambda i=i: linear_conv_triton(x, ws[i % copies], None, states[i % copies], cw, cb, c0,
                                                               config=cfg) for i in range(R)])
    add_pct(r, wbytes + K * 2 + N * 2)
    tag(f"in_proj + conv N={N} K={K}: projection alone {r['alone_us']:.2f} us, projection then conv kernel "
        f"{r['two_us']:.2f} us, fused {r['ours_us']:.2f} us")
    return r


def conv_table(rows: list[dict]) -> str:
    lines = ["| N x K | conv channels | projection alone us | projection, then conv kernel us | fused us | "
             "fused - alone us | rel err |", "|" + "---|" * 7]
    for r in rows:
        f, err, _ = _cells(r)
        extra = f"{r['ours_us'] - r['alone_us']:.2f}" if "ours_us" in r else "-"
        lines.append(f"| {r['N'][0]} x {r['K']} | {r['layer'].split('conv ')[1]} | {f('alone_us')} | {f('two_us')} | "
                     f"{f('ours_us')} | {extra} | {err} |")
    return "\n".join(lines)


def norm_row(N: int, K: int, args, dev, dtype) -> dict:
    """RMSNorm as the gemv kernel's prologue (what ``hybrid::norm_linear`` runs at one row, config GEMV_NORM) against
    an Inductor norm kernel + what ``hybrid::linear`` runs; --sweep: every gemv config too."""
    from hybrid_kernels.linear.triton_gemv import GEMV_NORM
    wbytes = N * K * 2
    ws, g = cold_weights(N, K, dev, dtype, N + K)
    copies = len(ws)
    x = torch.randn(1, K, device=dev, dtype=dtype, generator=g)
    nw = 1 + 0.1 * torch.randn(K, device=dev, dtype=dtype, generator=g)
    norm = (nw, 1e-6, None, None, False)

    def torch_norm(t):
        tf = t.float()
        return nw * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype)
    got = linear_triton(x, [ws[0]], config=GEMV_NORM if dev == "cuda" else dict(GEMV_NORM, block_k=64),
                        norm=norm)[0].float()
    want = torch.nn.functional.linear(torch_norm(x).float(), ws[0].float())
    r = dict(model="rmsnorm + linear", layer=f"{N}x{K}", M=1, N=(N,), K=K, weight_mb=wbytes / 2**20,
             rel_err=((got - want).abs().max() / want.abs().max()).item(), picked=GEMV_NORM)
    if dev != "cuda":
        return r
    R = max(8, copies)
    nbytes = wbytes + K * 2 + N * 2
    norm_c = torch.compile(torch_norm)
    r["before_us"] = per_call_us([lambda i=i: linear_triton(norm_c(x), [ws[i % copies]]) for i in range(R)])
    r["alone_us"] = per_call_us([lambda i=i: linear_triton(x, [ws[i % copies]]) for i in range(R)])
    r["ours_us"] = per_call_us([lambda i=i: linear_triton(x, [ws[i % copies]], config=GEMV_NORM, norm=norm)
                                for i in range(R)])
    if args.sweep:
        best = None
        for cfg in sweep_configs(1, 2):
            t = per_call_us([lambda i=i: linear_triton(x, [ws[i % copies]], config=cfg, norm=norm) for i in range(R)])
            best = min(best or (t, cfg), (t, cfg), key=lambda b: b[0])
        r["best_us"], r["best"] = best
    add_pct(r, nbytes)
    tag(f"rms + linear N={N} K={K}: Inductor norm + linear {r['before_us']:.2f} us, linear alone {r['alone_us']:.2f},"
        f" gemv with the norm {r['ours_us']:.2f} us")
    return r


def glu_row(N: int, K: int, args, dev, dtype) -> dict:
    """A gated MLP's input: RMSNorm + gate and up + silu(gate) * up in one gemv launch (``hybrid::norm_linear`` with
    glu at one row, the config ``pick_config`` picks) against the same launch without the norm at GEMV's config;
    --sweep: every gemv config."""
    from hybrid_kernels.linear.triton_gemv import GEMV
    picked = pick_config(1, [N, N], K, norm=True, glu=True)
    wbytes = 2 * N * K * 2
    ws, g = cold_weights(2 * N, K, dev, dtype, N + K)
    pairs = [[w[:N], w[N:]] for w in ws]
    copies = len(pairs)
    x = torch.randn(1, K, device=dev, dtype=dtype, generator=g)
    nw = 1 + 0.1 * torch.randn(K, device=dev, dtype=dtype, generator=g)
    norm = (nw, 1e-6, None, None, False)
    small = {} if dev == "cuda" else dict(block_k=64)
    got = linear_triton(x, pairs[0], config=dict(picked, **small), norm=norm, glu=True)[0].float()
    h = nw * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    gate, up = (torch.nn.functional.linear(h, w).float() for w in pairs[0])
    want = torch.nn.functional.silu(gate) * up
    r = dict(model="rmsnorm + gated MLP input", layer=f"2x{N}x{K}", M=1, N=(N, N), K=K, weight_mb=wbytes / 2**20,
             rel_err=((got - want).abs().max() / want.abs().max()).item(), picked=picked)
    if dev != "cuda":
        return r
    R = max(8, copies)
    r["alone_us"] = per_call_us([lambda i=i: linear_triton(x, pairs[i % copies], config=GEMV, glu=True)
                                 for i in range(R)])
    r["ours_us"] = per_call_us([lambda i=i: linear_triton(x, pairs[i % copies], config=picked, norm=norm, glu=True)
                                for i in range(R)])
    if args.sweep:
        best = None
        for cfg in sweep_configs(1, 2):
            t = per_call_us([lambda i=i: linear_triton(x, pairs[i % copies], config=cfg, norm=norm, glu=True)
                             for i in range(R)])
            tag(f"  glu N={N} K={K} {cfg}: {t:.2f} us")
            best = min(best or (t, cfg), (t, cfg), key=lambda b: b[0])
        r["best_us"], r["best"] = best
    add_pct(r, wbytes + K * 2 + N * 2)
    tag(f"norm + glu N={N} K={K}: without the norm {r['alone_us']:.2f} us, with it {r['ours_us']:.2f} us")
    return r


def glu_table(rows: list[dict]) -> str:
    lines = ["| gate + up N x K | GLU gemv without the norm us (% of 4.3 TB/s) | with the norm (picked config) us | "
             "best swept us | best config | rel err |", "|" + "---|" * 6]
    for r in rows:
        f, err, bcfg = _cells(r)
        lines.append(f"| {r['layer']} | {f('alone_us')} | {f('ours_us')} | {f('best_us')} | {bcfg} | {err} |")
    return "\n".join(lines)


def norm_table(rows: list[dict]) -> str:
    lines = ["| N x K | Inductor norm + hybrid::linear us (% of 4.3 TB/s) | the linear alone us | norm as the gemv's "
             "prologue us | x before | best swept us | best config | rel err |", "|" + "---|" * 8]
    for r in rows:
        f, err, bcfg = _cells(r)
        ratio = f"{r['before_us'] / r['ours_us']:.2f}x" if "ours_us" in r else "-"
        lines.append(f"| {r['N'][0]} x {r['K']} | {f('before_us')} | {f('alone_us')} | {f('ours_us')} | {ratio} | "
                     f"{f('best_us')} | {bcfg} | {err} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rows", default="1,8", help="decode rows M")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of launch configs at M = 1 and 8")
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, two small shapes")
    ap.add_argument("--gated", action="store_true", help="Mamba2's gated norm + out_proj, fused vs not")
    ap.add_argument("--conv", action="store_true", help="Mamba2's in_proj with its conv-update epilogue vs without")
    ap.add_argument("--norm", action="store_true", help="RMSNorm as the gemv kernel's prologue vs a norm kernel first")
    ap.add_argument("--glu", action="store_true", help="RMSNorm + a gated MLP's gate/up/activation in one gemv launch")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.norm:  # Mamba2's in_proj and lm_head, an out_proj-sized weight, DeepSeek's q_proj + kv_a_proj
        shapes = [(10576, 2560), (2560, 5120), (3072 + 576, 2048), (50288, 2560)] if cuda else [(40, 130)]
        rows = [norm_row(N, K, args, dev, dtype) for N, K in shapes]
        write(args.out, "linear_norm", rows, norm_table(rows))
        print(norm_table(rows))
        return 0
    if args.glu:  # DeepSeek-V2-Lite's dense MLP and its shared experts
        shapes = [(10944, 2048), (2816, 2048)] if cuda else [(40, 130)]
        rows = [glu_row(N, K, args, dev, dtype) for N, K in shapes]
        write(args.out, "linear_glu", rows, glu_table(rows))
        print(glu_table(rows))
        return 0
    if args.conv:  # mamba2-2.7b: in_proj [2 * 5120 + 2 * 128 + 80, 2560], conv channels 5120 + 2 * 128 from 5120
        rows = [conv_row(10576, 2560, 5376, 5120, dev, dtype) if cuda else conv_row(70, 48, 40, 9, dev, dtype)]
        write(args.out, "linear_conv", rows, conv_table(rows))
        print(conv_table(rows))
        return 0
    if args.gated:
        N, K = (2560, 5120) if cuda else (40, 130)  # mamba2-2.7b: out_proj [hidden, d_inner]
        rows = [gated_row(N, K, int(m), args, dev, dtype) for m in args.rows.split(",")]
        write(args.out, "linear_gated", rows, gated_table(rows))
        print(gated_table(rows))
        return 0
    shapes = ([("smoke", "a", (72,), 40), ("smoke", "b", (33,), 130), ("smoke", "c", (24, 9, 40), 72)] if args.smoke
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
