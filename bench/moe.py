"""Per-layer routed-MoE time: our Triton kernels vs Hugging Face's experts implementations, same run, same routing.

    python bench/moe.py --out bench/results/moe.json          # GPU (one H200): full table, < 5 minutes
    python bench/moe.py --smoke                                # tiny shapes, CPU (interpreter) or GPU, seconds
    python bench/moe.py --sweep --shapes mixtral --tokens 1,4096   # try a few configs per T bucket (tuning)
    python bench/moe.py --compile-check                        # no GPU: compile for sm_90, smem/pipelining/spills

Shapes: Mixtral-8x7B (E=8, top-2, H=4096, I=14336) and DeepSeek-V2-Lite (E=64, top-6, H=2048, I=1408; its 2 shared
experts are a plain dense MLP outside the routed op and are not timed). bf16, random weights, uniform-ish random
routing. "ours" = align + gate/up GEMM + down GEMM + combine given the routing (what HF's experts modules do);
routing (our route kernel on precomputed logits) and alignment are also timed alone; "full" = router GEMM + route +
experts. Roofline = max(bytes / 4.3e12, flops / 790e12), bytes = touched experts * 3*H*I*2 + x + out,
flops = 2*T*k*3*H*I. Timing: triton.testing.do_bench median (L2 flushed between calls), replaying a CUDA graph of
the call when it can be captured (HF eager cannot: it syncs on nonzero()).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available() and "--compile-check" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit module is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import transformers  # noqa: E402

from bench.common import environment  # noqa: E402
from hybrid_kernels.moe import reference
from hybrid_kernels.moe import triton_common as common, triton_experts as experts, triton_routing as routing  # noqa: E402

HBM_BPS, PEAK_FLOPS = 4.3e12, 790e12
BATCHED_MM_MAX_BYTES = 12e9  # batched_mm gathers one weight copy per (token, slot): skip beyond this
EAGER_MAX_T = 4096

SHAPES = {
    "mixtral": dict(E=8, k=2, H=4096, I=14336, method="softmax_topk", renormalize=True, scale=1.0,
                    label="Mixtral-8x7B"),
    "dsv2lite": dict(E=64, k=6, H=2048, I=1408, method="softmax_topk", renormalize=False, scale=1.0,
                     label="DeepSeek-V2-Lite (routed only; 2 shared experts excluded)"),
}
SMOKE_SHAPES = {
    "mixtral": dict(SHAPES["mixtral"], H=64, I=48, E=6, label="tiny Mixtral-like"),
    "dsv2lite": dict(SHAPES["dsv2lite"], H=48, I=32, E=10, k=3, label="tiny DeepSeek-like"),
}
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
SMOKE_TOKENS = [1, 33]


def log(msg: str) -> None:
    print(f"[moe-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ timing
def _graph(fn):
    """Capture fn in a CUDA graph (after a warm-up call on a side stream); None if it cannot be captured."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g
    except Exception:  # noqa: BLE001 - any capture failure means "time it without a graph"
        torch.cuda.synchronize()
        return None


def time_ms(fn, *, graph: bool = True, rep: int = 100, warmup: int = 25) -> tuple[float, bool]:
    """Median ms of fn; (ms, graphed)."""
    if not torch.cuda.is_available():  # smoke mode on the CPU: one warm-up, one timed call
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, False
    g = _graph(fn) if graph else None
    target = g.replay if g is not None else fn
    ms = triton.testing.do_bench(target, warmup=warmup, rep=rep, return_mode="median")
    del g
    return ms, graph and target is not fn


# ------------------------------------------------------------------------------------------------ HF experts
def hf_experts_module(shape: dict, w13: torch.Tensor, w2: torch.Tensor):
    """The real HF experts module of the family, holding our weights (no copy)."""
    common = dict(num_attention_heads=8, num_key_value_heads=8)
    if shape["E"] == 64 or "DeepSeek" in shape["label"]:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Experts as cls
        cfg = transformers.DeepseekV2Config(hidden_size=shape["H"], moe_intermediate_size=shape["I"],
                                            n_routed_experts=shape["E"], num_experts_per_tok=shape["k"],
                                            n_shared_experts=2, **common)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls
        cfg = transformers.MixtralConfig(hidden_size=shape["H"], intermediate_size=shape["I"],
                                         num_local_experts=shape["E"], num_experts_per_tok=shape["k"], **common)
    with torch.device("meta"):
        mod = cls(cfg)
    mod.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return mod, cfg


def hf_call(mod, cfg, impl: str, x, ids, weights):
    cfg._experts_implementation = impl
    return mod(x, ids, weights)


# ------------------------------------------------------------------------------------------------ one row
def roofline(shape: dict, T: int, touched: float, elem: int = 2) -> tuple[float, float, float]:
    H, I, k = shape["H"], shape["I"], shape["k"]
    nbytes = touched * 3 * H * I * elem + 2 * T * H * elem
    flops = 2 * T * k * 3 * H * I
    return max(nbytes / HBM_BPS, flops / PEAK_FLOPS) * 1e3, nbytes, flops


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def bench_row(name: str, shape: dict, T: int, w13, w2, router_w, dtype, dev, impls, args) -> dict:
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["k"]
    route_kw = dict(method=shape["method"], top_k=k, renormalize=shape["renormalize"], scale=shape["scale"],
                    n_group=1, topk_group=1)
    x = torch.randn(T, H, device=dev, dtype=dtype)
    logits = reference.router_logits(x, router_w, False)
    weights, ids32 = routing.route_triton(logits, None, **route_kw)
    ids = ids32.long()  # HF routers hand int64 ids
    touched = int(torch.unique(ids).numel())
    expected = E * (1 - (1 - k / E) ** T)
    floor_ms, nbytes, flops = roofline(shape, T, touched)
    row = dict(shape=name, T=T, E=E, k=k, H=H, I=I, touched=touched, touched_expected=round(expected, 2),
               roofline_ms=floor_ms, bytes=nbytes, flops=flops, hf={}, hf_graphed={}, skipped={})

    def ours():
        return experts.experts_triton(x, w13, w2, weights, ids, gated=True, interleaved=False, activation="silu")

    # correctness first: ours vs every HF implementation that runs
    out = ours()
    try:
        mod, cfg = hf_experts_module(shape, w13, w2)
    except Exception as exc:  # noqa: BLE001 - an older transformers without these classes: no HF columns
        log(f"  cannot build the HF experts module ({type(exc).__name__}: {exc}); HF columns skipped")
        mod = cfg = None
    for impl in impls:
        why = "no HF module" if mod is None else skip_reason(impl, shape, T, dtype)
        if why:
            row["skipped"][impl] = why
            continue
        try:
            with torch.no_grad():
                hf_out = hf_call(mod, cfg, impl, x, ids, weights)
        except Exception as exc:  # noqa: BLE001 - a failing HF impl is reported, not fatal
            row["skipped"][impl] = f"error: {type(exc).__name__}: {str(exc)[:80]}"
            continue
        err = rel_err(out, hf_out)
        row.setdefault("rel_err", {})[impl] = err
        if err > args.tol:
            log(f"  !! {name} T={T}: ours vs HF {impl}: relative error {err:.3e} > {args.tol}")
            row["mismatch"] = True
    ok = "mismatch" not in row
    log(f"  {name} T={T}: touched {touched} experts (expected {expected:.1f}); correctness "
        + ", ".join(f"{i} {e:.1e}" for i, e in row.get("rel_err", {}).items()) + ("" if ok else "  MISMATCH"))

    # timings
    row["route_ms"], _ = time_ms(lambda: routing.route_triton(logits, None, **route_kw), graph=not args.no_graph)
    row["align_ms"], _ = time_ms(lambda: routing.align_triton(ids, E, common.config_for(T, E, H, I, k)["BM"]),
                                 graph=not args.no_graph)
    row["route_align_ms"], _ = time_ms(lambda: routing.route_align_triton(
        logits, None, **route_kw, block_m=common.config_for(T, E, H, I, k)["BM"]), graph=not args.no_graph)
    row["ours_ms"], row["ours_graphed"] = time_ms(ours, graph=not args.no_graph)
    row["full_ms"], _ = time_ms(lambda: experts.moe_triton(
        x, router_w, None, w13, w2, **route_kw, gated=True, interleaved=False, activation="silu", router_fp32=False),
        graph=not args.no_graph)
    for impl in impls:
        if impl in row["skipped"]:
            continue
        rep = 40 if impl == "eager" else 100
        with torch.no_grad():
            ms, graphed = time_ms(lambda impl=impl: hf_call(mod, cfg, impl, x, ids, weights),
                                  graph=not args.no_graph and impl != "eager", rep=rep, warmup=10)
        row["hf"][impl], row["hf_graphed"][impl] = ms, graphed
    if row["hf"]:
        best = min(row["hf"], key=row["hf"].get)
        row["best_hf"], row["best_hf_ms"] = best, row["hf"][best]
        row["speedup"] = row["best_hf_ms"] / row["ours_ms"]
    row["pct_roofline"] = 100 * floor_ms / row["ours_ms"]
    row["tflops"] = flops / row["ours_ms"] / 1e9
    row["tbps"] = nbytes / row["ours_ms"] / 1e9
    hf_txt = ", ".join(f"{i} {ms:.3f}" for i, ms in row["hf"].items())
    log(f"  {name} T={T}: ours {row['ours_ms']:.3f} ms ({row['pct_roofline']:.0f}% of roofline {floor_ms:.3f}), "
        f"route {row['route_ms']:.4f}, align {row['align_ms']:.4f}, route+align {row['route_align_ms']:.4f}, "
        f"full {row['full_ms']:.3f}; HF: {hf_txt}")
    del mod
    return row


def skip_reason(impl: str, shape: dict, T: int, dtype) -> str | None:
    per_call = T * shape["k"] * 3 * shape["H"] * shape["I"] * torch.finfo(dtype).bits // 8
    if impl == "batched_mm" and per_call > BATCHED_MM_MAX_BYTES:
        return f"gathers {per_call / 1e9:.0f} GB of weights per call"
    if impl == "eager" and T > EAGER_MAX_T:
        return "too slow"
    return None


# ------------------------------------------------------------------------------------------------ table
def fmt(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(rows: list[dict], impls: list[str]) -> str:
    head = ["shape", "T", "touched (exp.)", "route ms", "align ms", "ours ms", "full ms"]
    head += [f"HF {i} ms" for i in impls]
    head += ["speedup vs best HF", "roofline ms", "% roofline", "TFLOP/s", "TB/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        hf = []
        for i in impls:
            if i in r["hf"]:
                hf.append(fmt(r["hf"][i]) + ("" if r["hf_graphed"].get(i) else "*"))
            else:
                hf.append("skip: " + r["skipped"].get(i, "?"))
        cells = [r["shape"], str(r["T"]), f"{r['touched']} ({r['touched_expected']:.1f})", fmt(r["route_ms"], 4),
                 fmt(r["align_ms"], 4), fmt(r["ours_ms"]) + ("" if r["ours_graphed"] else "*"), fmt(r["full_ms"])]
        cells += hf
        cells += [fmt(r.get("speedup"), 2) + "x" + (" MISMATCH" if r.get("mismatch") else ""), fmt(r["roofline_ms"]),
                  f"{r['pct_roofline']:.0f}%", f"{r['tflops']:.0f}", f"{r['tbps']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("`*` = timed without a CUDA graph. DeepSeek-V2-Lite rows time the routed experts only: its 2 shared "
                 "experts are a plain dense MLP outside the op. Roofline = max(bytes/4.3e12, flops/790e12) with the "
                 "actual number of touched experts.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ sweep
def sweep_candidates(T: int) -> list[dict]:
    small = T <= 64
    out = []
    if small:  # the gate/up kernel's variants with the default down, then the down kernel's with the default up
        base = common.small_config()
        for bn, bk, warps, stages in [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (16, 256, 4, 4),
                                      (64, 64, 4, 5), (32, 128, 8, 5), (64, 128, 8, 3), (16, 128, 4, 6),
                                      (32, 64, 4, 6)]:
            out.append(dict(BM=16, up=dict(BN=bn, BK=bk, GROUP_M=1, warps=warps, stages=stages),
                            down=dict(base["down"])))
        for bn, bk, split, warps, stages in [(32, 128, None, 4, 4), (128, 128, None, 4, 4), (64, 128, 1, 4, 4),
                                             (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (32, 128, 2, 4, 4),
                                             (32, 128, 4, 4, 4), (64, 64, 2, 4, 6), (64, 256, 1, 4, 3),
                                             (128, 64, 2, 4, 5), (64, 128, 2, 8, 4), (32, 64, 4, 4, 6)]:
            out.append(dict(BM=16, up=dict(base["up"]),
                            down=dict(BN=bn, BK=bk, GROUP_M=1, warps=warps, stages=stages, SPLIT_K=split)))
    else:
        for bm, bn, bk, warps, stages in [(64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 8, 4),
                                          (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (64, 128, 128, 8, 3)]:
            out.append(dict(BM=bm, up=dict(BN=bn, BK=bk, GROUP_M=8, warps=warps, stages=stages),
                            down=dict(BN=min(2 * bn, 256), BK=bk, GROUP_M=8, warps=warps, stages=stages,
                                      SPLIT_K=1)))
    return out


def sweep(shape_name, shape, T, w13, w2, router_w, dtype, dev, args) -> list[dict]:
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["k"]
    x = torch.randn(T, H, device=dev, dtype=dtype)
    logits = reference.router_logits(x, router_w, False)
    weights, ids = routing.route_triton(logits, None, method=shape["method"], top_k=k,
                                        renormalize=shape["renormalize"], scale=1.0)
    base = experts.experts_triton(x, w13, w2, weights, ids, gated=True, interleaved=False, activation="silu")
    touched = int(torch.unique(ids).numel())
    floor_ms = roofline(shape, T, touched)[0]
    res = []
    for cfg in [common.config_for(T, E, H, I, k)] + sweep_candidates(T):
        fn = lambda cfg=cfg: experts.experts_triton(x, w13, w2, weights, ids, gated=True, interleaved=False,  # noqa
                                                    activation="silu", config=cfg)
        try:
            err = rel_err(fn(), base)
            ms, _ = time_ms(fn, graph=not args.no_graph)
        except Exception as exc:  # noqa: BLE001
            log(f"  sweep {shape_name} T={T} {cfg}: failed {type(exc).__name__}: {str(exc)[:100]}")
            continue
        log(f"  sweep {shape_name} T={T}: {ms:.4f} ms ({100 * floor_ms / ms:.0f}% roofline) err {err:.1e} {cfg}")
        res.append(dict(shape=shape_name, T=T, ms=ms, pct_roofline=100 * floor_ms / ms, config=cfg, err=err))
    if res:
        best = min(res, key=lambda r: r["ms"])
        log(f"best {shape_name} T={T}: {best['ms']:.4f} ms ({best['pct_roofline']:.0f}% roofline) {best['config']}")
    return res


# ------------------------------------------------------------------------------------------------ offline compile
def record_launches(fn) -> list[tuple]:
    """Run a launcher with every kernel launch recorded instead of run: [(kernel, grid, args, kwargs)]. Our
    launchers depend on shapes only, so meta tensors suffice."""
    launches = []

    class _Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((self.kernel, grid, a, kw))

    saved = common.launch
    common.launch = _Recorder
    try:
        fn()
    finally:
        common.launch = saved
    return launches


def compile_offline(kernel, args, kwargs, cap: int = 90) -> dict:
    """Compile one recorded launch for sm_{cap} on this machine (no GPU needed), specialised the way the JIT
    specialises at run time (ints equal to 1 become constants, multiples of 16 and tensors get divisibility 16).
    Reports shared memory, whether the K loop is software-pipelined, and ptxas registers / spills."""
    import re
    import subprocess
    import tempfile

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    opts = {n: kwargs[n] for n in ("num_warps", "num_stages") if n in kwargs}
    values = dict(zip(kernel.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in opts})
    sig, consts, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        v = values[name]
        if param.is_constexpr:
            sig[name], consts[name] = "constexpr", v
            continue
        ty, desc = native_specialize_impl(BaseBackend, v, False, True, True)
        if ty == "constexpr":
            sig[name], consts[name] = "constexpr", desc
            continue
        sig[name] = ty
        if desc and "D" in desc:
            attrs[(i,)] = [["tt.divisibility", 16]]
    t0 = time.time()
    k = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", cap, 32), options=opts)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    rep = dict(kernel=kernel.__name__, shared=k.metadata.shared, compile_s=round(time.time() - t0, 1),
               pipelined=("async_copy" in ttgir) or ("async_tma" in ttgir) or ("cp.async" in ptx),
               wgmma="wgmma" in ptx, **{n: kwargs.get(n) for n in ("num_warps", "num_stages")})
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            out = subprocess.run([get_ptxas(cap).path, "-v", f"--gpu-name=sm_{cap}a", f.name, "-o", "/dev/null"],
                                 capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", out)
        spill = re.search(r"(\d+) bytes spill stores", out)
        rep.update(regs=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None)
    except Exception as exc:  # noqa: BLE001 - ptxas missing: report without registers
        rep.update(regs=None, spill_bytes=None, ptxas_error=str(exc)[:80])
    return rep


def compile_check(shapes: dict, tokens: list[int], cap: int = 90) -> list[dict]:
    """Compile every kernel moe_triton launches for these shapes and T values, for sm_{cap}, offline."""
    dtype = torch.bfloat16
    reports, seen = [], set()
    for name, shape in shapes.items():
        E, H, I, k = shape["E"], shape["H"], shape["I"], shape["k"]
        w13 = torch.empty(E, 2 * I, H, device="meta", dtype=dtype)
        w2 = torch.empty(E, H, I, device="meta", dtype=dtype)
        rw = torch.empty(E, H, device="meta", dtype=dtype)
        for T in tokens:
            x = torch.empty(T, H, device="meta", dtype=dtype)
            launches = record_launches(lambda: experts.moe_triton(
                x, rw, None, w13, w2, method=shape["method"], top_k=k, renormalize=shape["renormalize"],
                scale=shape["scale"], n_group=1, topk_group=1, gated=True, interleaved=False, activation="silu",
                router_fp32=False))
            for kernel, grid, a, kw in launches:
                key = (kernel.__name__, tuple(sorted((n, v) for n, v in kw.items() if not hasattr(v, "shape"))))
                rep = dict(shape=name, T=T, grid=str(grid))
                if key in seen:
                    continue
                seen.add(key)
                rep.update(compile_offline(kernel, a, kw, cap))
                log(f"  compile {name} T={T} {rep['kernel']}: grid {rep['grid']}, smem {rep['shared']} B, "
                    f"pipelined {rep['pipelined']}, wgmma {rep['wgmma']}, regs {rep['regs']}, "
                    f"spills {rep['spill_bytes']} B ({rep['compile_s']} s)")
                reports.append(rep)
    return reports


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter or GPU), a few seconds")
    ap.add_argument("--shapes", default="mixtral,dsv2lite")
    ap.add_argument("--tokens", default=None, help="comma-separated T values (default 1,4,16,64,256,1024,4096)")
    ap.add_argument("--impls", default="grouped_mm,batched_mm,eager", help="HF experts implementations")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--no-graph", action="store_true", help="never capture CUDA graphs")
    ap.add_argument("--sweep", action="store_true", help="time candidate configs of our kernels instead")
    ap.add_argument("--tol", type=float, default=2e-2, help="max relative L2 error vs HF (bf16)")
    ap.add_argument("--compile-check", action="store_true",
                    help="no GPU needed: compile every kernel for sm_90 and report smem / pipelining / spills")
    args = ap.parse_args(argv)
    if args.compile_check:
        shapes = {n: (SMOKE_SHAPES if args.smoke else SHAPES)[n] for n in args.shapes.split(",")}
        tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else TOKENS
        reps = compile_check(shapes, tokens)
        if args.out:
            Path(args.out).write_text(json.dumps(reps, indent=1))
        bad = [r for r in reps if r.get("spill_bytes")]
        log(f"compiled {len(reps)} kernels; {len(bad)} spill registers")
        return 0

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's bf16 is broken
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (SMOKE_TOKENS if args.smoke else TOKENS)
    impls = [i for i in args.impls.split(",") if i]
    if not cuda and not args.smoke:
        log("no CUDA device: use --smoke on the CPU")
        return 2
    log(f"device {torch.cuda.get_device_name() if cuda else 'cpu (Triton interpreter)'}, torch {torch.__version__}, "
        f"triton {triton.__version__}, transformers {transformers.__version__}, dtype {dtype}")
    t_start = time.time()
    rows, sweeps, failures = [], [], []
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        shape = shapes[name]
        E, H, I = shape["E"], shape["H"], shape["I"]
        log(f"{shape['label']}: E={E} top-{shape['k']} H={H} I={I}: allocating "
            f"{E * 3 * H * I * torch.finfo(dtype).bits / 8 / 1e9:.2f} GB of expert weights")
        w13 = (torch.randn(E, 2 * I, H, device=dev) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, device=dev) * I ** -0.5).to(dtype)
        router_w = (torch.randn(E, H, device=dev) * H ** -0.5).to(dtype)
        for T in tokens:
            t0 = time.time()
            try:
                if args.sweep:
                    sweeps += sweep(name, shape, T, w13, w2, router_w, dtype, dev, args)
                else:
                    rows.append(bench_row(name, shape, T, w13, w2, router_w, dtype, dev, impls, args))
            except Exception as exc:  # noqa: BLE001 - keep going: one failing row must not cost the whole run
                import traceback
                traceback.print_exc()
                log(f"  !! {name} T={T} failed: {type(exc).__name__}: {str(exc)[:200]}")
                failures.append(dict(shape=name, T=T, error=f"{type(exc).__name__}: {str(exc)[:500]}"))
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            log(f"  ({time.time() - t0:.1f} s for T={T}; {time.time() - t_start:.0f} s so far)")
        del w13, w2, router_w
        if cuda:
            torch.cuda.empty_cache()
    if rows:
        print()
        print(markdown(rows, impls), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        meta = dict(environment(), dtype=str(dtype), configs={str(k): v for k, v in common.MOE_CONFIGS.items()})
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows, sweeps=sweeps, failures=failures), indent=1,
                                             default=str))
        log(f"wrote {args.out}")
    for f in failures:
        log(f"FAILED {f['shape']} T={f['T']}: {f['error']}")
    log(f"done in {time.time() - t_start:.0f} s")
    return 1 if failures or any(r.get("mismatch") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
