"""SSM kernels (hybrid_kernels/ssm) against Hugging Face's torch paths, on one GPU, bf16.

  python bench/ssm.py --out bench/results/ssm_h200.json   # H200: full run, a few minutes
  python bench/ssm.py --smoke                             # tiny shapes; CPU (Triton interpreter) or GPU
  python bench/ssm.py --compile-check                     # compile every kernel for sm_90 (no GPU needed)

Sections: SSD prefill (Mamba2-2.7B: 80 heads x 64, d_state 128, 1 group, chunk 256; plus the 128-head
target shape) vs HF ``mamba2_chunk_scan`` eager and torch.compile'd; Mamba1 prefill (Mamba-2.8B: D 5120,
d_state 16) vs HF ``mamba_selective_scan`` (python loop in eager, capped in T; associative scan when
compiled); decode state updates + conv-state updates (CUDA graphs, inputs rotated past L2) vs HF's torch
updates, in GB/s against 4.3 TB/s; conv1d prefill; gated RMSNorm. Every row is checked against HF
before it is timed; errors and crashes are recorded in the row, never hidden.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_BW = 4.3e12  # H200 device-to-device copy, bytes/s (read + write counted)
T0 = time.time()


def log(msg: str) -> None:
    print(f"[ssm-bench {time.time() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# compile check: every kernel through Triton's CUDA backend + ptxas for sm_90, launches captured on meta
# tensors (no GPU, no memory). Reports registers, spills and shared memory.


def compile_check(only: str = "") -> list[dict]:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run --compile-check without TRITON_INTERPRET=1"
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from types import SimpleNamespace

    from hybrid_kernels.ssm import triton_config
    from hybrid_kernels.ssm import triton_conv as conv
    from hybrid_kernels.ssm import triton_norm as norm
    from hybrid_kernels.ssm import triton_scan as scan
    from hybrid_kernels.ssm import triton_ssd as ssd
    kernels = SimpleNamespace(CONFIG=triton_config.CONFIG, **{n: getattr(m, n) for m in (conv, scan, ssd, norm)
                                                             for n in dir(m) if n.endswith("_triton")})

    captured = []

    class _Capture:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: captured.append((self.kernel, grid, a, kw))

    for mod in (conv, scan, ssd, norm):
        mod.wrap_triton = _Capture
    meta = dict(device="meta")
    bf, f32 = torch.bfloat16, torch.float32

    def r(*shape, dtype=bf):
        return torch.empty(*shape, dtype=dtype, **meta)

    cases = []

    def case(name, fn):
        cases.append((name, fn))

    # causal conv: Mamba2-2.7B conv_dim 5376, channel-last input (a split of in_proj's output)
    case("conv_fwd", lambda: kernels.causal_conv1d_triton(r(1, 2048, 10576)[..., :5376].transpose(1, 2),
                                                          r(5376, 4), r(5376), r(1, 5376, 4), "silu", 4))
    case("conv_update", lambda: kernels.causal_conv1d_update_triton(r(64, 5376), r(64, 5376, 4), r(5376, 4),
                                                                    r(5376), "silu", r(64, dtype=torch.int32)))
    # Mamba1 (Mamba-2.8B): D 5120, N 16
    case("selective_scan", lambda: kernels.selective_scan_triton(
        r(1, 5120, 2048), r(1, 5120, 2048), r(5120, 16, dtype=f32), r(1, 2048, 48)[..., 16:32].transpose(1, 2),
        r(1, 2048, 48)[..., 32:].transpose(1, 2), r(5120, dtype=f32), r(1, 2048, 10240)[..., 5120:].transpose(1, 2),
        r(5120, dtype=f32), True, r(1, 5120, 16, dtype=f32)))
    case("selective_state_update", lambda: kernels.selective_state_update_triton(
        r(64, 5120, 16, dtype=f32), r(64, 5120), r(64, 5120), r(5120, 16, dtype=f32), r(64, 16), r(64, 16),
        r(5120), r(64, 5120), r(5120, dtype=f32), True, r(64, dtype=torch.int32)))
    # SSD: 128 heads x 64, N 128, 1 group, chunk 256 (bf16), with and without the shared C.B^T, and fp32
    for cb in (True, False):
        def _ssd(cb=cb, dt=bf):
            kernels.CONFIG["ssd"]["CB"] = cb
            kernels.ssd_scan_triton(r(1, 4096, 128, 64, dtype=dt), r(1, 4096, 128, dtype=dt), r(128, dtype=f32),
                                    r(1, 4096, 1, 128, dtype=dt), r(1, 4096, 1, 128, dtype=dt), 256,
                                    r(128, dtype=dt), None, r(128, dtype=dt), True, 0.0, float("inf"),
                                    r(1, 128, 64, 128, dtype=f32))
        case(f"ssd_scan[cb={cb}]", _ssd)
    case("ssd_scan[fp32]", lambda: ssd_fp32())
    case("ssd_scan[N256,G8]", lambda: kernels.ssd_scan_triton(
        r(2, 1000, 64, 64), r(2, 1000, 64), r(64, dtype=f32), r(2, 1000, 8, 256), r(2, 1000, 8, 256), 256, r(64),
        r(2, 1000, 64, 64), r(64), True, 0.0, float("inf"), None))

    def ssd_fp32():
        kernels.CONFIG["ssd"]["CB"] = True
        kernels.ssd_scan_triton(r(2, 300, 6, 24, dtype=f32), r(2, 300, 6, dtype=f32), r(6, dtype=f32),
                                r(2, 300, 3, 16, dtype=f32), r(2, 300, 3, 16, dtype=f32), 64, r(6, dtype=f32),
                                r(2, 300, 6, 24, dtype=f32), r(6, dtype=f32), True, 0.0, 1e9, None)
    case("ssd_state_update", lambda: kernels.ssd_state_update_triton(
        r(64, 128, 64, 128, dtype=f32), r(64, 128, 64), r(64, 128), r(128, dtype=f32), r(64, 1, 128),
        r(64, 1, 128), r(128), None, r(128), True, 0.0, float("inf"), r(64, dtype=torch.int32)))
    case("gated_rms_norm[5120]", lambda: kernels.gated_rms_norm_triton(r(4096, 5120), r(4096, 5120), r(5120),
                                                                       1e-5, 5120))
    case("gated_rms_norm[640]", lambda: kernels.gated_rms_norm_triton(r(4096, 5120), r(4096, 5120), r(5120),
                                                                      1e-5, 640))

    # every optional input off (other constexpr branches), time-contiguous conv input, fp16
    case("minimal[conv]", lambda: (kernels.causal_conv1d_triton(r(2, 64, 300), r(64, 4), None, None, "none", 3),
                                   kernels.causal_conv1d_update_triton(r(2, 64), r(2, 64, 4), r(64, 4), None,
                                                                       "none", None)))
    case("minimal[scan]", lambda: (
        kernels.selective_scan_triton(r(2, 64, 300), r(2, 64, 300), r(64, 16, dtype=f32), r(2, 16, 300),
                                      r(2, 16, 300), None, None, None, False, None),
        kernels.selective_state_update_triton(r(2, 64, 16), r(2, 64), r(2, 64), r(64, 16, dtype=f32), r(2, 16),
                                              r(2, 16), None, None, None, False, None)))
    case("minimal[ssd]", lambda: (
        kernels.ssd_scan_triton(r(2, 300, 8, 64, dtype=torch.float16), r(2, 300, 8, dtype=torch.float16),
                                r(8, dtype=f32), r(2, 300, 2, 128, dtype=torch.float16),
                                r(2, 300, 2, 128, dtype=torch.float16), 64, None, r(2, 300, 8, 64, dtype=torch.float16),
                                None, False, 0.0, float("inf"), None),
        kernels.ssd_state_update_triton(r(2, 8, 64, 128), r(2, 8, 64), r(2, 8), r(8, dtype=f32), r(2, 2, 128),
                                        r(2, 2, 128), None, r(2, 8, 64), None, False, 0.0, float("inf"), None),
        kernels.gated_rms_norm_triton(r(300, 512), None, r(512), 1e-5, 128)))

    dtypes = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
              torch.int64: "i64", torch.bool: "i1"}
    try:  # the ptxas Triton itself uses for sm_90 (its name differs across Triton versions)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception:
        ptxas = triton.knobs.nvidia.ptxas.path
    results = []
    for name, fn in cases:
        if only and only not in name:
            continue
        captured.clear()
        try:
            fn()
        except Exception as e:  # a launcher bug, not a compile problem
            results.append({"case": name, "kernel": "-", "ok": False, "error": f"launcher: {e!r}"})
            continue
        for kernel, grid, args, kwargs in captured:
            names = kernel.arg_names
            bound = dict(zip(names, args))
            bound.update({k: v for k, v in kwargs.items() if k in names})
            options = {k: v for k, v in kwargs.items() if k not in names}
            sig, consts, attrs = {}, {}, {}
            for i, p in enumerate(kernel.params):
                v = bound[p.name]
                if p.is_constexpr:
                    sig[p.name], consts[p.name] = "constexpr", v
                elif isinstance(v, torch.Tensor):
                    sig[p.name] = "*" + dtypes[v.dtype]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif isinstance(v, bool):
                    sig[p.name] = "i1"
                elif isinstance(v, int):
                    if v == 1:
                        sig[p.name], consts[p.name] = "constexpr", 1  # what the JIT specialises
                    else:
                        sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
                        if v % 16 == 0:
                            attrs[(i,)] = [["tt.divisibility", 16]]
                elif isinstance(v, float):
                    sig[p.name] = "fp32"
                else:
                    raise TypeError(f"{name}: unsupported argument {p.name}={v!r}")
            row = {"case": name, "kernel": kernel.__name__, "grid": list(grid), **options}
            t = time.time()
            try:
                c = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                                   target=GPUTarget("cuda", 90, 32), options=options)
                with tempfile.TemporaryDirectory() as d:
                    ptx = Path(d) / "k.ptx"
                    ptx.write_text(c.asm["ptx"])
                    out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(d) / "k.o")],
                                         capture_output=True, text=True).stderr
                import re

                regs = re.search(r"Used (\d+) registers", out)
                spill = re.search(r"(\d+) bytes spill stores", out)
                row.update(ok=True, regs=int(regs.group(1)) if regs else None,
                           spill_bytes=int(spill.group(1)) if spill else None, smem=c.metadata.shared,
                           compile_s=round(time.time() - t, 2))
            except Exception as e:
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-2000:]}")
            results.append(row)
            log(f"compile {name:24s} {kernel.__name__:32s} " + (
                f"ok regs={row['regs']} spill={row['spill_bytes']}B smem={row['smem']}B" if row["ok"]
                else "FAILED: " + row["error"][-300:]))
    return results


# ---------------------------------------------------------------------------------------------------------
# benchmark helpers


class Bench:
    def __init__(self, smoke: bool, device: str, full: bool, budget_s: float):
        import torch

        self.torch = torch
        self.smoke = smoke
        self.device = device
        self.cuda = device == "cuda"
        self.full = full
        self.budget_s = budget_s
        self.dtype = torch.bfloat16 if self.cuda else torch.float32  # the interpreter runs fp32 only
        self.rows: list[dict] = []
        self.compile_spent: dict[str, float] = {}

    def compile_allowed(self, family: str) -> str | None:
        """Why a compiled baseline must be skipped (None: go). Each family gets half the budget, so a slow
        compiler in one section cannot starve the other; the whole run stays bounded."""
        if time.time() - T0 > 2 * self.budget_s:
            return "time budget (whole run)"
        if self.compile_spent.get(family, 0.0) > self.budget_s / 2:
            return f"time budget ({family} compiles took {self.compile_spent[family]:.0f}s)"
        return None

    def deadline(self, family: str):
        """Interrupt a compile that would overrun this family's share of the budget (SIGALRM, main thread)."""
        import contextlib
        import signal

        left = max(5, int(self.budget_s / 2 - self.compile_spent.get(family, 0.0)))

        class CompileTimeout(Exception):
            pass

        def handler(signum, frame):
            raise CompileTimeout(f"stock torch.compile did not finish within {left}s (interrupted)")

        @contextlib.contextmanager
        def cm():
            if not hasattr(signal, "SIGALRM"):
                yield
                return
            old = signal.signal(signal.SIGALRM, handler)
            signal.alarm(left)
            try:
                yield
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
        return cm()

    def spent(self, family: str, seconds: float) -> None:
        self.compile_spent[family] = self.compile_spent.get(family, 0.0) + seconds

    def time_ms(self, fn) -> float:
        if self.cuda:
            import triton

            return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def graph_ms(self, fn, n_calls: int) -> float:
        """Median time of one call when n_calls calls (each on its own inputs) replay in one CUDA graph."""
        torch = self.torch
        if not self.cuda:
            return self.time_ms(fn) / n_calls
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return self.time_ms(g.replay) / n_calls

    def run(self, row: dict, fn) -> dict:
        """fn() -> dict of measurements; exceptions are recorded in the row."""
        t = time.time()
        try:
            row.update(fn())
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            if os.environ.get("SSM_BENCH_TRACE"):
                traceback.print_exc()
        if self.cuda:
            self.torch.cuda.empty_cache()
        row["wall_s"] = round(time.time() - t, 2)
        self.rows.append(row)
        shown = {k: v for k, v in row.items() if k not in ("section",)}
        log(f"{row['section']}: {shown}")
        return row


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


# ---------------------------------------------------------------------------------------------------------
# sections


def bench_ssd(bx: Bench) -> None:
    import torch
    from transformers.models.mamba2 import modeling_mamba2 as hf2

    import hybrid_kernels.ssm  # noqa: F401  (registers torch.ops.hybrid)

    dev, dt_ = bx.device, bx.dtype
    if bx.smoke:
        shapes, lengths, chunk = [("smoke", 4, 16, 16, 1)], [64], 32
    else:
        shapes = [("mamba2-2.7b", 80, 64, 128, 1), ("target-128h", 128, 64, 128, 1)]
        lengths, chunk = [512, 2048, 8192, 32768], 256
    compiled = {}
    for shape_name, H, P, N, G in shapes:
        for T in lengths:
            g = torch.Generator(device=dev).manual_seed(T)
            x = torch.randn(1, T, H, P, device=dev, generator=g).to(dt_)
            dt = (0.5 * torch.randn(1, T, H, device=dev, generator=g)).to(dt_)
            A = -torch.arange(1, H + 1, device=dev, dtype=torch.float32)
            Bm = torch.randn(1, T, G, N, device=dev, generator=g).to(dt_)
            Cm = torch.randn(1, T, G, N, device=dev, generator=g).to(dt_)
            D = torch.randn(H, device=dev, generator=g).to(dt_)
            dtb = torch.log(torch.expm1(torch.empty(H, device=dev).uniform_(1e-3, 0.1, generator=g))).to(dt_)
            h0 = torch.randn(1, H, P, N, device=dev, generator=g)

            def ours():
                return torch.ops.hybrid.ssd_scan(x, dt, A, Bm, Cm, chunk, D, None, dtb, True, 0.0, float("inf"), h0)

            def hf():
                return hf2.mamba2_chunk_scan(x, dt, A, Bm, Cm, chunk, D=D, dt_bias=dtb, initial_states=h0,
                                             dt_softplus=True, dt_limit=(0.0, float("inf")), return_final_states=True)

            ref = {}

            def run_hf():
                ref["y"], ref["s"] = hf()
                ms = bx.time_ms(hf)
                return {"ms": round(ms, 4), "Mtok_s": round(T / ms / 1e3, 3)}

            def run_ours():
                y, s = ours()
                out = {}
                if "y" in ref:
                    out.update(err_y=rel_err(y, ref["y"]), err_state=rel_err(s, ref["s"]))
                ms = bx.time_ms(ours)
                return {**out, "ms": round(ms, 4), "Mtok_s": round(T / ms / 1e3, 3)}

            def run_compiled():
                if bx.smoke:
                    return {"skipped": "smoke"}
                why = bx.compile_allowed("ssd")
                if why:
                    return {"skipped": why}
                fn = compiled.setdefault("fn", torch.compile(hf2.mamba2_chunk_scan, dynamic=False))
                t = time.time()
                try:
                    y, s = fn(x, dt, A, Bm, Cm, chunk, D=D, dt_bias=dtb, initial_states=h0, dt_softplus=True,
                              dt_limit=(0.0, float("inf")), return_final_states=True)
                finally:
                    bx.spent("ssd", time.time() - t)
                compile_s = time.time() - t
                out = {"compile_s": round(compile_s, 1)}
                if "y" in ref:
                    out["err_y_vs_eager"] = rel_err(y, ref["y"])
                ms = bx.time_ms(lambda: fn(x, dt, A, Bm, Cm, chunk, D=D, dt_bias=dtb, initial_states=h0,
                                           dt_softplus=True, dt_limit=(0.0, float("inf")),
                                           return_final_states=True))
                return {**out, "ms": round(ms, 4), "Mtok_s": round(T / ms / 1e3, 3)}

            base = {"section": "ssd_prefill", "shape": f"{shape_name} H{H} P{P} N{N} G{G}", "T": T}
            hf_cap = 32768 if bx.full else (32768 if H <= 80 else 8192)
            if T <= hf_cap:
                bx.run({**base, "impl": "hf_eager"}, run_hf)
            bx.run({**base, "impl": "hybrid"}, run_ours)
            if H > 80 and not bx.smoke:  # the other C.B^T variant on the target shape, for tuning
                from hybrid_kernels.ssm.triton_config import CONFIG

                CONFIG["ssd"]["CB"] = not CONFIG["ssd"]["CB"]
                bx.run({**base, "impl": f"hybrid[CB={CONFIG['ssd']['CB']}]"}, run_ours)
                CONFIG["ssd"]["CB"] = not CONFIG["ssd"]["CB"]
            if H <= 80 or bx.full:
                bx.run({**base, "impl": "hf_compiled"}, run_compiled)
            del x, dt, Bm, Cm, ref


def bench_mamba1(bx: Bench) -> None:
    import torch
    from transformers.models.mamba import modeling_mamba as hf1

    import hybrid_kernels.ssm  # noqa: F401

    dev, dt_ = bx.device, bx.dtype
    if bx.smoke:
        Dd, N, lengths, eager_cap, comp_cap = 16, 8, [32], 32, 0
    else:
        Dd, N, lengths = 5120, 16, [512, 2048, 8192, 32768]
        eager_cap = 2048  # HF's eager path is a python loop over T (~6 launches per step)
        comp_cap = 32768 if bx.full else 8192  # the associative scan holds several [D, T, N] fp32 tensors
    for T in lengths:
        g = torch.Generator(device=dev).manual_seed(T)
        u = torch.randn(1, Dd, T, device=dev, generator=g).to(dt_)
        delta = (0.5 * torch.randn(1, Dd, T, device=dev, generator=g) - 3.0).to(dt_)
        A = -torch.arange(1, N + 1, device=dev, dtype=torch.float32).expand(Dd, N).contiguous()
        xproj = torch.randn(1, T, 2 * N + 160, device=dev, generator=g).to(dt_)  # dt_rank 160 | B | C
        Bm, Cm = xproj[..., 160:160 + N].transpose(1, 2), xproj[..., 160 + N:].transpose(1, 2)
        z = torch.randn(1, T, 2 * Dd, device=dev, generator=g).to(dt_)[..., Dd:].transpose(1, 2)
        D = torch.randn(Dd, device=dev, generator=g)
        db = torch.randn(Dd, device=dev, generator=g) * 0.1

        def ours():
            return torch.ops.hybrid.selective_scan(u, delta, A, Bm, Cm, D, z, db, True, None)

        def hf(fn=hf1.mamba_selective_scan, assoc=False):
            return fn(u, delta, A, Bm, Cm, D=D, z=z, delta_bias=db, delta_softplus=True, return_last_state=True,
                      use_associative_scan=assoc)

        ref = {}
        base = {"section": "mamba1_prefill", "shape": f"mamba-2.8b D{Dd} N{N}", "T": T}

        def run_hf():
            if T > eager_cap:
                return {"skipped": f"eager python loop capped at T<={eager_cap}"}
            ref["y"], ref["s"] = hf()
            ms = bx.time_ms(hf)
            return {"ms": round(ms, 4), "Mtok_s": round(T / ms / 1e3, 3)}

        def run_compiled():
            if T > comp_cap:
                return {"skipped": f"compiled associative scan capped at T<={comp_cap} (use --full)"}
            why = bx.compile_allowed("mamba1")
            if why:
                return {"skipped": why}
            fn = torch.compile(lambda: hf(assoc=True), dynamic=False)
            t = time.time()
            try:
                with bx.deadline("mamba1"):
                    y, s = fn()
            except Exception as e:  # noqa: BLE001  (a compile that does not finish is a result)
                return {"error": str(e)[:200], "compile_s": round(time.time() - t, 1)}
            finally:
                bx.spent("mamba1", time.time() - t)
            out = {"compile_s": round(time.time() - t, 1)}
            if "y" not in ref:
                ref["y"], ref["s"] = y, s
            else:
                out["err_y_vs_eager"] = rel_err(y, ref["y"])
            ms = bx.time_ms(fn)
            return {**out, "ms": round(ms, 4), "Mtok_s": round(T / ms / 1e3, 3)}

        def run_ours():
            y, s = ours()
            out = {}
            if "y" in ref:
                out.update(err_y=rel_err(y, ref["y"]), err_state=rel_err(s, ref["s"]))
            ms = bx.time_ms(ours)
            return {**out, "ms": round(ms, 4), "Mtok_s": round(T / ms / 1e3, 3)}

        bx.run({**base, "impl": "hf_eager"}, run_hf)
        if not bx.smoke:
            bx.run({**base, "impl": "hf_compiled_assoc"}, run_compiled)
        bx.run({**base, "impl": "hybrid"}, run_ours)
        del u, delta, xproj, z, ref


def bench_decode(bx: Bench) -> None:
    import torch
    from transformers.models.mamba import modeling_mamba as hf1
    from transformers.models.mamba2 import modeling_mamba2 as hf2

    import hybrid_kernels.ssm  # noqa: F401

    dev, dt_ = bx.device, bx.dtype
    sdt = torch.float32  # HF keeps the recurrent state in fp32 (the prefill's final state)
    if bx.smoke:
        batches = [2]
        shapes = [("mamba2", dict(H=4, P=16, N=16, G=1, conv=96)), ("mamba1", dict(Dd=16, N=8, conv=16))]
    else:
        batches = [1, 8, 64, 256]
        shapes = [("mamba2-2.7b", dict(H=80, P=64, N=128, G=1, conv=5376)),
                  ("mamba-2.8b", dict(Dd=5120, N=16, conv=5120))]
    K = 4
    for name, s in shapes:
        for B in batches:
            g = torch.Generator(device=dev).manual_seed(B)

            def rnd(*shape, dtype=dt_):
                return torch.randn(*shape, device=dev, generator=g).to(dtype)

            C = s["conv"]
            if "H" in s:
                H, P, N, G = s["H"], s["P"], s["N"], s["G"]
                state_elems = H * P * N
                io_bytes = B * (2 * H * P + 2 * G * N + H) * 2
            else:
                Dd, N = s["Dd"], s["N"]
                state_elems = Dd * N
                io_bytes = B * (4 * Dd + 2 * N) * 2
            state_bytes = 2 * B * state_elems * sdt.itemsize  # read + write
            conv_bytes = 2 * B * C * K * dt_.itemsize + 2 * B * C * dt_.itemsize
            per_call = state_bytes + conv_bytes + io_bytes
            n_rot = 1 if bx.smoke else max(1, min(64, math.ceil(256e6 / per_call)))
            S = n_rot * B
            state = rnd(S, *((H, P, N) if "H" in s else (Dd, N)), dtype=sdt)
            conv_state = rnd(S, C, K)
            w, cb = rnd(C, K), rnd(C)
            xc = rnd(n_rot, B, C)
            idx = torch.arange(S, device=dev, dtype=torch.int32).view(n_rot, B)
            if "H" in s:
                x, dt, Bm, Cm = rnd(n_rot, B, H, P), rnd(n_rot, B, H), rnd(n_rot, B, G, N), rnd(n_rot, B, G, N)
                A = -torch.arange(1, H + 1, device=dev, dtype=torch.float32)
                D, dtb = rnd(H), rnd(H) * 0.1 - 3.0

                def ours_ssm(k):
                    return torch.ops.hybrid.ssd_state_update(state, x[k], dt[k], A, Bm[k], Cm[k], D, None, dtb, True,
                                                             0.0, float("inf"), idx[k])

                def hf_ssm(k):
                    return hf2.mamba2_selective_state_update(
                        state[k * B:(k + 1) * B], x[k], dt[k][..., None].expand(-1, -1, P),
                        A[:, None, None].expand(-1, P, N), Bm[k], Cm[k], D[:, None].expand(-1, P),
                        dt_bias=dtb[:, None].expand(-1, P), dt_softplus=True)
            else:
                x, dt, Bm, Cm, z = rnd(n_rot, B, Dd), rnd(n_rot, B, Dd), rnd(n_rot, B, N), rnd(n_rot, B, N), \
                    rnd(n_rot, B, Dd)
                A = -torch.arange(1, N + 1, device=dev, dtype=torch.float32).expand(Dd, N).contiguous()
                D, dtb = rnd(Dd), rnd(Dd, dtype=torch.float32) * 0.1 - 3.0

                def ours_ssm(k):
                    return torch.ops.hybrid.selective_state_update(state, x[k], dt[k], A, Bm[k], Cm[k], D, z[k], dtb,
                                                                   True, idx[k])

                def hf_ssm(k):
                    return hf1.mamba_selective_state_update(state[k * B:(k + 1) * B], x[k], dt[k], A, Bm[k], Cm[k],
                                                            D, dt_bias=dtb, dt_softplus=True, z=z[k])

            def ours_conv(k):
                return torch.ops.hybrid.causal_conv1d_update(xc[k], conv_state, w, cb, "silu", idx[k])

            def hf_conv(k):
                return hf1.causal_conv1d_update(xc[k][..., None], conv_state[k * B:(k + 1) * B], w, cb, "silu")

            base = {"section": "decode", "shape": name, "B": B, "state_dtype": str(sdt).split(".")[-1],
                    "rotations": n_rot}

            def check():
                st0, cs0 = state.clone(), conv_state.clone()
                y_o, c_o = ours_ssm(0), ours_conv(0)
                st_o, cs_o = state[:B].clone(), conv_state[:B].clone()
                state.copy_(st0)
                conv_state.copy_(cs0)
                y_h, c_h = hf_ssm(0), hf_conv(0)
                out = {"err_y": rel_err(y_o, y_h), "err_state": rel_err(st_o, state[:B]),
                       "err_conv_y": rel_err(c_o, c_h[..., 0]), "err_conv_state": rel_err(cs_o, conv_state[:B])}
                state.copy_(st0)
                conv_state.copy_(cs0)
                return out

            def measure(ssm, conv):
                out = {}
                for label, fn, nbytes in (("ssm", lambda: [ssm(k) for k in range(n_rot)], state_bytes + io_bytes),
                                          ("conv", lambda: [conv(k) for k in range(n_rot)], conv_bytes),
                                          ("step", lambda: [(ssm(k), conv(k)) for k in range(n_rot)], per_call)):
                    ms = bx.graph_ms(fn, n_rot)
                    out[f"{label}_us"] = round(ms * 1e3, 2)
                    out[f"{label}_GBs"] = round(nbytes / (ms * 1e-3) / 1e9, 1)
                out["step_pct_peak"] = round(100 * per_call / (out["step_us"] * 1e-6) / PEAK_BW, 1)
                return out

            scratch = torch.empty_like(state[:B])

            def copy_state():
                """The issue's yardstick: a plain device copy of the same state bytes (read B states, write B)."""
                ms = bx.graph_ms(lambda: [scratch.copy_(state[k * B:(k + 1) * B]) for k in range(n_rot)], n_rot)
                return {"ssm_us": round(ms * 1e3, 2), "ssm_GBs": round(state_bytes / (ms * 1e-3) / 1e9, 1)}

            copy_row = bx.run({**base, "impl": "state_copy"}, copy_state) or {}

            def run_ours():
                out = {**check(), **measure(ours_ssm, ours_conv)}
                if copy_row.get("ssm_GBs"):
                    out["ssm_pct_copy"] = round(100 * out["ssm_GBs"] / copy_row["ssm_GBs"], 1)
                return out

            bx.run({**base, "impl": "hybrid"}, run_ours)
            bx.run({**base, "impl": "hf_graphed"}, lambda: measure(hf_ssm, hf_conv))
            bx.run({**base, "impl": "hf_eager"}, lambda: {
                "step_us": round(bx.time_ms(lambda: (hf_ssm(0), hf_conv(0))) * 1e3, 2)})
            del state, conv_state


def bench_conv_norm(bx: Bench) -> None:
    import torch
    from transformers.models.mamba2 import modeling_mamba2 as hf2

    import hybrid_kernels.ssm  # noqa: F401

    dev, dt_ = bx.device, bx.dtype
    C, K, proj = (96, 4, 200) if bx.smoke else (5376, 4, 10576)
    I, gs = (64, 64) if bx.smoke else (5120, 5120)
    for T in ([64] if bx.smoke else [512, 2048, 8192, 32768]):
        g = torch.Generator(device=dev).manual_seed(T)
        xin = torch.randn(1, T, proj, device=dev, generator=g).to(dt_)
        x = xin[..., :C].transpose(1, 2)  # channel-last [B, C, T], as HF's split + transpose gives it
        w, b = torch.randn(C, K, device=dev, generator=g).to(dt_), torch.randn(C, device=dev, generator=g).to(dt_)
        nbytes = 2 * C * T * dt_.itemsize
        base = {"section": "conv_prefill", "shape": f"C{C} K{K}", "T": T}

        def run_hf():
            ms = bx.time_ms(lambda: hf2.causal_conv1d_fn(x, w, b, activation="silu"))
            return {"ms": round(ms, 4), "GBs": round(nbytes / ms / 1e6, 1)}

        def run_ours():
            y, _ = torch.ops.hybrid.causal_conv1d(x, w, b, None, "silu", K)
            err = rel_err(y, hf2.causal_conv1d_fn(x, w, b, activation="silu"))
            ms = bx.time_ms(lambda: torch.ops.hybrid.causal_conv1d(x, w, b, None, "silu", K))
            return {"err_y": err, "ms": round(ms, 4), "GBs": round(nbytes / ms / 1e6, 1)}

        bx.run({**base, "impl": "hf_eager"}, run_hf)
        bx.run({**base, "impl": "hybrid"}, run_ours)

        hs, gate = torch.randn(1, T, I, device=dev, generator=g).to(dt_), xin[..., -I:]
        gated_norm = getattr(hf2, "Mamba2RMSNormGated", None) or hf2.MambaRMSNormGated  # renamed in 5.25
        try:  # transformers >= 5.2x takes the group size; older versions normalise the whole width
            norm = gated_norm(I, group_size=gs, eps=1e-5).to(dev, dt_)
        except TypeError:
            norm = gated_norm(I, eps=1e-5).to(dev, dt_)
            gs = I
        nb = 3 * I * T * dt_.itemsize
        base = {"section": "gated_rms_norm", "shape": f"I{I} group{gs}", "T": T}

        def run_norm_hf():
            ms = bx.time_ms(lambda: norm(hs, gate))
            return {"ms": round(ms, 4), "GBs": round(nb / ms / 1e6, 1)}

        def run_norm_ours():
            err = rel_err(torch.ops.hybrid.gated_rms_norm(hs, gate, norm.weight, 1e-5, gs), norm(hs, gate))
            ms = bx.time_ms(lambda: torch.ops.hybrid.gated_rms_norm(hs, gate, norm.weight, 1e-5, gs))
            return {"err_y": err, "ms": round(ms, 4), "GBs": round(nb / ms / 1e6, 1)}

        bx.run({**base, "impl": "hf_eager"}, run_norm_hf)
        bx.run({**base, "impl": "hybrid"}, run_norm_ours)
        del xin, hs


# ---------------------------------------------------------------------------------------------------------


def markdown(rows: list[dict]) -> str:
    keys = ["section", "shape", "T", "B", "impl", "ms", "Mtok_s", "GBs", "ssm_us", "ssm_GBs", "conv_us", "conv_GBs",
            "step_us", "step_GBs", "step_pct_peak", "ssm_pct_copy", "err_y", "err_state", "compile_s", "skipped", "error"]
    used = [k for k in keys if any(k in r for r in rows)]
    lines = ["| " + " | ".join(used) + " |", "|" + "---|" * len(used)]
    for r in rows:
        cells = []
        for k in used:
            v = r.get(k, "")
            if isinstance(v, float):
                v = f"{v:.2e}" if k.startswith("err") else f"{v:g}"
            cells.append(str(v).replace("|", "/")[:80])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_update_sweep(bx: Bench) -> None:
    """The Mamba2 decode state update's tile (``CONFIG["ssd_update"]``: TILE elements, num_warps) at B = 1 and 8,
    Mamba2-2.7B shape, fp32 state; inputs rotated past L2 in one CUDA graph, as in the decode section."""
    import torch

    import hybrid_kernels.ssm  # noqa: F401
    from hybrid_kernels.ssm.triton_config import CONFIG

    dev, dt_ = bx.device, bx.dtype
    H, P, N, G = (4, 16, 16, 1) if bx.smoke else (80, 64, 128, 1)
    keep = dict(CONFIG["ssd_update"])
    for B in [1, 8]:
        g = torch.Generator(device=dev).manual_seed(B)
        nbytes = 2 * B * H * P * N * 4 + B * (2 * H * P + 2 * G * N + H) * 2
        n_rot = 1 if bx.smoke else max(1, min(64, math.ceil(256e6 / nbytes)))
        state = torch.randn(n_rot * B, H, P, N, device=dev, generator=g)
        x, dt = torch.randn(n_rot, B, H, P, device=dev, generator=g).to(dt_), torch.randn(n_rot, B, H, device=dev,
                                                                                          generator=g).to(dt_)
        Bm, Cm = (torch.randn(n_rot, B, G, N, device=dev, generator=g).to(dt_) for _ in range(2))
        A_log, D, dtb = (torch.rand(H, device=dev, generator=g) for _ in range(3))
        idx = torch.arange(n_rot * B, device=dev, dtype=torch.int32).view(n_rot, B)
        for tile in ([256, 1024] if bx.smoke else [512, 1024, 2048, 4096, 8192]):
            for warps in ([4] if bx.smoke else [1, 2, 4, 8]):
                CONFIG["ssd_update"].update(TILE=tile, num_warps=warps)

                def calls():
                    return [torch.ops.hybrid.ssd_state_update(state, x[k], dt[k], A_log, Bm[k], Cm[k], D, None, dtb,
                                                              True, 0.0, float("inf"), idx[k], True)
                            for k in range(n_rot)]

                def measure():
                    us = bx.graph_ms(calls, n_rot) * 1e3
                    return {"us": round(us, 2), "pct_peak": round(100 * nbytes / (us * 1e-6) / PEAK_BW, 1)}

                bx.run({"section": "update_sweep", "B": B, "TILE": tile, "num_warps": warps}, measure)
        CONFIG["ssd_update"].update(keep)
        del state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, seconds (CPU interpreter without a GPU)")
    ap.add_argument("--compile-check", action="store_true", help="compile all kernels for sm_90, no GPU needed")
    ap.add_argument("--full", action="store_true", help="no caps on the slow HF baselines")
    ap.add_argument("--sections", default="ssd,mamba1,decode,conv",
                    help="comma-separated subset; also update_sweep (the decode state update's tile)")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="compile time allowed per compiled-baseline family is half of this; none after 2x")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--config", default="", help='JSON merged into hybrid_kernels/ssm/triton_config.CONFIG, e.g. \'{"ssd": {"CB": false}}\'')
    ap.add_argument("--only", default="", help="--compile-check: only cases whose name contains this")
    args = ap.parse_args()

    def apply_config():
        from hybrid_kernels.ssm.triton_config import CONFIG

        for sec, vals in (json.loads(args.config) if args.config else {}).items():
            CONFIG[sec].update(vals)

    if args.compile_check:
        os.environ.pop("TRITON_INTERPRET", None)
        apply_config()
        rows = compile_check(args.only)
        bad = [r for r in rows if not r["ok"]]
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        log(f"{len(rows) - len(bad)}/{len(rows)} kernels compiled for sm_90")
        sys.exit(1 if bad else 0)

    import torch

    torch.set_grad_enabled(False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if not args.smoke:
            sys.exit("no GPU: use --smoke (Triton interpreter) or --compile-check")
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        os.environ["HYBRID_TRITON_ON_CPU"] = "1"
    apply_config()
    from hybrid_kernels.ssm.triton_config import CONFIG

    log(f"device={device} torch={torch.__version__} "
        f"gpu={torch.cuda.get_device_name() if device == 'cuda' else '-'} smoke={args.smoke}")
    log(f"CONFIG={json.dumps(CONFIG)}")
    bx = Bench(args.smoke, device, args.full, args.budget_s)
    sections = {"ssd": bench_ssd, "mamba1": bench_mamba1, "decode": bench_decode, "conv": bench_conv_norm,
                "update_sweep": bench_update_sweep}
    for name in args.sections.split(","):
        log(f"== section {name}")
        try:
            sections[name](bx)
        except Exception as e:
            bx.rows.append({"section": name, "error": f"section crashed: {type(e).__name__}: {str(e)[:400]}"})
            traceback.print_exc()
    table = markdown(bx.rows)
    print(table, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": CONFIG, "device": device, "rows": bx.rows}, indent=1,
                                             default=str))
        Path(args.out).with_suffix(".md").write_text(table + "\n")
    log(f"done in {time.time() - T0:.1f}s")


if __name__ == "__main__":
    main()
