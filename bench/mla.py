"""Absorbed MLA attention: our Triton decode / prefill over the paged latent cache vs Hugging Face's path
(re-expand the whole cached latent through kv_b_proj, then SDPA), measured in the same run.

    python bench/mla.py --out bench/results/mla.json     # GPU (one H200), bf16: tune + full table, < 5 minutes
    python bench/mla.py --smoke                          # tiny shapes, CPU (interpreter) or GPU, seconds
    python bench/mla.py --no-tune                        # skip the config sweep, use runtime CONFIGS as is
    python bench/mla.py --compile-check                  # no GPU needed: compile for sm_90, print regs/spills/smem

Shapes: L = kv_lora_rank 512, R = rope 64 (cache row 576), P = V = 128, block_size 64, heads 16 (V2-Lite) and
128 (V3). Decode: every sequence holds S cached tokens; ours = stage 1 + merge (split-KV chosen from shapes).
bytes = B*S*576*2 (latent + rope read) + q + out; flops = 2*B*H*S*(L+R) + 2*B*H*S*L;
roofline = max(bytes / 4.3e12, flops / 790e12). HF = F.linear(latent, kv_b) + key assembly (new_empty + two
copy_) + SDPA, exactly DeepseekV2Attention's decode work. Timing: median of 100 replays of a CUDA graph of
the call, CUDA events around each, L2 evicted before each by reading 256 MB (clean lines: see _flush_l2);
"kernels alone" = the CUPTI durations of our kernels under the same flush. Correctness is checked before timing: ours vs the fp32
absorbed reference (first sequences) and, in the V space (o_lat @ W_UV^T), vs HF's output.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available() and "--compile-check" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit module is imported
if "--compile-check" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hybrid_kernels.library import GLUON  # noqa: E402
from hybrid_kernels.mla import gluon, gluon_common, gluon_narrow, gluon_wide, ops, triton_cache, triton_step  # noqa: E402
from hybrid_kernels.mla import reference as ref  # noqa: E402
from hybrid_kernels.mla import triton_attention as kernels  # noqa: E402
from hybrid_kernels.mla.triton_cache import _mla_cache_write_kernel  # noqa: E402

HBM_BPS, PEAK_FLOPS = 4.3e12, 790e12
FULL = dict(L=512, R=64, P=128, V=128, block=64, heads=[16, 128], batches=[1, 8, 32, 64, 128],
            lens=[1024, 4096, 16384], prefill=[1024, 4096, 8192])
SMOKE = dict(L=32, R=8, P=16, V=16, block=16, heads=[3], batches=[1, 3], lens=[40, 130], prefill=[40])
HF_MAX_BYTES = 40e9          # skip HF's expansion when its intermediates would exceed this
CACHE_MAX_BYTES = 30e9       # skip decode combinations whose latent cache would exceed this
TUNE = {  # swept by --tune: kernels (block_h, block_n, num_warps, num_stages) x per_sm (programs resident per
    # SM, which only sets the split count); scored by the summed time over the regime's tune shapes (B, S)
    "decode_small_h": dict(kernels=[(16, 32, 4, 2), (16, 32, 4, 3), (16, 32, 4, 4), (16, 16, 4, 4), (16, 16, 4, 5),
                                    (16, 32, 8, 3), (16, 32, 8, 4), (16, 64, 8, 3), (16, 64, 4, 3), (16, 16, 8, 5)],
                           per_sm=[1, 2, 3, 4], shapes=[(8, 16384), (32, 4096), (128, 16384)]),
    "decode_large_h": dict(kernels=[(64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (64, 32, 8, 4), (64, 16, 8, 4),
                                    (64, 16, 8, 5), (32, 32, 4, 3), (32, 32, 8, 3), (32, 64, 8, 3)],
                           per_sm=[1, 2], shapes=[(8, 16384), (64, 4096), (64, 16384)]),
}


def log(msg: str) -> None:
    print(f"[mla-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ timing
def _graph(fn):
    """Capture fn in a CUDA graph (warm-up on a side stream first); None if capture fails."""
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
    except Exception:  # noqa: BLE001 - a capture failure only means "time it without a graph"
        torch.cuda.synchronize()
        return None


def kernel_ms(fn, calls: int = 20) -> float:
    """GPU time per call of fn's kernels alone (CUPTI kernel durations summed, as nsys or ncu would report
    them): no launch latency and no gaps between kernels. Complements time_ms, which includes both."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            _flush_l2()
            fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages() if "_mla_" in e.key)
    return total / calls / 1e3


def time_ms(fn, graph: bool = True) -> tuple[float, bool]:
    if not torch.cuda.is_available():  # smoke on the CPU: one warm-up, one timed call
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, False
    g = _graph(fn) if graph else None
    run = g.replay if g is not None else fn
    run()
    times = []
    for _ in range(100):
        _flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), g is not None


_FLUSH: list = []


def _flush_l2() -> None:
    """Evict L2 by reading 256 MB (5x the H200's L2). A read leaves clean lines behind: zeroing a buffer
    (do_bench's flush) leaves up to 50 MB of dirty lines that the next kernel pays to write back (~12 us at
    4.3 TB/s), which is not traffic of the kernel being timed."""
    if not _FLUSH:
        _FLUSH.append(torch.ones(64 << 20, dtype=torch.float32, device="cuda"))
    _FLUSH[0].amax()


# ------------------------------------------------------------------------------------------------ inputs
def make_paged(B: int, S: int, sh: dict, dev, dtype, seed: int = 0, shuffle: bool = True):
    """Random latent cache, S tokens per sequence, blocks shuffled across sequences (as after many allocations and
    frees) or, with shuffle=False, each sequence's blocks in order (a fresh allocator)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    nblk = B * triton.cdiv(S, sh["block"])
    cache = torch.randn(nblk + 1, sh["block"], sh["L"] + sh["R"], device=dev, dtype=dtype, generator=g)
    perm = (torch.randperm(nblk, device=dev, generator=g) if shuffle else torch.arange(nblk, device=dev)).int()
    bt = perm.view(B, -1).contiguous()
    seq = torch.full((B,), S, device=dev, dtype=torch.int32)
    return cache, bt, seq


def dense_from_paged(cache, bt, S: int, sh: dict):
    """HF's DynamicCache layout of the same tokens: latent [B, S, L], k_rope [B, S, R] (contiguous)."""
    B = bt.shape[0]
    rows = cache[bt.long()].reshape(B, -1, cache.shape[-1])[:, :S]
    return rows[..., :sh["L"]].contiguous(), rows[..., sh["L"]:].contiguous()


def hf_expand_attend(q_nope, q_rope, latent, k_rope, w_kvb, sh, scale, is_causal=False):
    """DeepseekV2Attention.expand_kv + sdpa_attention_forward for q [B, H, T, *], latent [B, S, L]."""
    B, H, T, _ = q_nope.shape
    S, P, V = latent.shape[1], sh["P"], sh["V"]
    kv = torch.nn.functional.linear(latent, w_kvb).view(B, S, H, P + V).transpose(1, 2)
    k_nope, value = torch.split(kv, [P, V], dim=-1)
    key = kv.new_empty(B, H, S, P + sh["R"])
    key[..., :P].copy_(k_nope)
    key[..., P:].copy_(k_rope[:, None].expand(B, H, S, -1))
    query = torch.cat([q_nope, q_rope], dim=-1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scale, is_causal=is_causal)


def err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------ decode
@triton.jit
def _read_floor_kernel(X, OUT, N, BLOCK: tl.constexpr):
    """Reads X once and writes one float per program: what any kernel that must read these bytes can do."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + tl.program_id(0), tl.sum(tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32), 0))


def read_floor_ms(t: torch.Tensor, graph: bool) -> float:
    """Time to read a contiguous tensor once (graphed, L2 flushed): the measured ceiling of a memory-bound decode
    of the same cache, next to the 4.3 TB/s of the roofline."""
    flat, block = t.reshape(-1), 8192
    out = torch.empty(triton.cdiv(flat.numel(), block), device=t.device, dtype=torch.float32)
    return time_ms(lambda: _read_floor_kernel[(out.numel(),)](flat, out, flat.numel(), BLOCK=block, num_warps=8),
                   graph=graph)[0]


def decode_row(H, S, B, sh, dev, dtype, args, config) -> dict:
    L, R, P, V = sh["L"], sh["R"], sh["P"], sh["V"]
    scale = (P + R) ** -0.5
    nbytes = B * S * (L + R) * 2 + B * H * (L + R) * 2 + B * H * L * 2
    flops = 2 * B * H * S * (L + R) + 2 * B * H * S * L
    floor_ms = max(nbytes / HBM_BPS, flops / PEAK_FLOPS) * 1e3
    row = dict(kind="decode", H=H, S=S, B=B, bytes=nbytes, flops=flops, roofline_ms=floor_ms,
               bound="memory" if nbytes / HBM_BPS > flops / PEAK_FLOPS else "compute", config=config)
    if B * S * (L + R) * 2 > CACHE_MAX_BYTES:
        row["skipped"] = f"cache {B * S * (L + R) * 2 / 1e9:.0f} GB > {CACHE_MAX_BYTES / 1e9:.0f} GB"
        return row
    cache, bt, seq = make_paged(B, S, sh, dev, dtype, shuffle=not getattr(args, "sequential_pages", False))
    g = torch.Generator(device=dev).manual_seed(1)
    w_kvb = (torch.randn(H * (P + V), L, device=dev, generator=g) * L ** -0.5).to(dtype)
    w_uk, w_uv = ref.split_kv_b(w_kvb, H, P, V)
    q_nope = torch.randn(B, H, P, device=dev, generator=g).to(dtype)
    q_rope = torch.randn(B, H, R, device=dev, generator=g).to(dtype)
    q_lat = ref.absorb_q(q_nope, w_uk)                                            # [B, H, L] (what the pass feeds)
    splits = kernels.choose_num_splits(B * triton.cdiv(H, kernels._tile_rows(H, False, 16, config["block_h"])[1]),
                                       bt.shape[1] * sh["block"], config["block_n"], config.get("per_sm", 1))
    row["num_splits"] = splits

    # On Hopper at DeepSeek widths what ships is a Gluon kernel (gluon_wide.py: 64+ heads, gluon_narrow.py: up to
    # 32); the Triton kernel with the regime's config is then timed too, as the baseline of the same run
    wg = ops.implementation(q_lat, q_rope, cache) == GLUON
    row["kernel"] = ("gluon-narrow" if H <= gluon_common.NARROW_MAX_HEADS else "gluon-wg") if wg else "triton"
    if wg:  # its split count is its own, whatever the tune picked for the Triton kernel
        row["num_splits"] = gluon.split_count(B, H, bt.shape[1] * sh["block"])

    def ours():
        if wg:
            return ops.decode(q_lat, q_rope, cache, bt, seq, scale, 0)
        return kernels.mla_decode_triton(q_lat, q_rope, cache, bt, seq, scale, 0, config=config)

    o_lat = ours()
    nb = min(B, 2)                                                                # fp32 reference on a sub-batch
    want = ref.mla_decode_ref(q_lat[:nb].float(), q_rope[:nb].float(), cache, bt[:nb], seq[:nb], scale)
    row["err_vs_ref"] = err(o_lat[:nb], want)
    hf_bytes = B * S * H * (P + V + P + R) * 2 * 1.25
    if getattr(args, "no_hf", False):
        row["hf_skipped"] = "not run while tuning"
        latent = k_rope = None
    elif hf_bytes > HF_MAX_BYTES:
        row["hf_skipped"] = f"HF expansion needs ~{hf_bytes / 1e9:.0f} GB > {HF_MAX_BYTES / 1e9:.0f} GB"
        latent = k_rope = None
    else:
        latent, k_rope = dense_from_paged(cache, bt, S, sh)
        with torch.no_grad():
            hf_out = hf_expand_attend(q_nope[:, :, None], q_rope[:, :, None], latent, k_rope, w_kvb, sh, scale)[:, :, 0]
        row["err_vs_hf"] = err(ref.unabsorb_out(o_lat, w_uv), hf_out)
        del hf_out
    bad = row["err_vs_ref"] > args.tol or row.get("err_vs_hf", 0.0) > args.tol
    if bad:
        row["mismatch"] = True
        log(f"  !! decode H={H} S={S} B={B}: error vs ref {row['err_vs_ref']:.2e}, vs HF {row.get('err_vs_hf')}")
    row["ours_ms"], row["ours_graphed"] = time_ms(ours, graph=not args.no_graph)
    if wg:
        row["triton_ms"], _ = time_ms(lambda: kernels.mla_decode_triton(q_lat, q_rope, cache, bt, seq, scale, 0,
                                                                        config=config), graph=not args.no_graph)
        row["x_triton"] = row["triton_ms"] / row["ours_ms"]
        # the drop-in decode over HF's dense cache (the same tokens as [B, S, L] + [B, S, R]), which also takes the
        # Gluon kernel at these widths
        d_lat, d_rope = (latent, k_rope) if latent is not None else dense_from_paged(cache, bt, S, sh)

        def dense():
            return ops.mla_attention_dense(q_lat[:, :, None], q_rope[:, :, None], d_lat, d_rope, scale=scale)[:, :, 0]

        row["err_dense_vs_paged"] = err(dense(), o_lat)
        if row["err_dense_vs_paged"] > args.tol:
            row["mismatch"] = True
            log(f"  !! dense decode H={H} S={S} B={B}: error vs the paged decode {row['err_dense_vs_paged']:.2e}")
        row["dense_ms"], _ = time_ms(dense, graph=not args.no_graph)
        del d_lat, d_rope
    if latent is not None:
        with torch.no_grad():
            row["hf_ms"], row["hf_graphed"] = time_ms(
                lambda: hf_expand_attend(q_nope[:, :, None], q_rope[:, :, None], latent, k_rope, w_kvb, sh, scale),
                graph=not args.no_graph)
        row["speedup_vs_hf"] = row["hf_ms"] / row["ours_ms"]
    if row["bound"] == "memory":
        row["read_floor_ms"] = read_floor_ms(cache, graph=not args.no_graph)
        row["read_floor_bytes"] = cache.numel() * cache.element_size()
    if torch.cuda.is_available():
        row["ours_kernel_ms"] = kernel_ms(ours)
        row["pct_roofline_kernel"] = 100 * floor_ms / row["ours_kernel_ms"]
    row["gbps"] = nbytes / row["ours_ms"] / 1e6
    row["tflops"] = flops / row["ours_ms"] / 1e9
    row["pct_roofline"] = 100 * floor_ms / row["ours_ms"]
    log(f"  decode H={H:3d} S={S:5d} B={B:3d} splits={row['num_splits']:2d}: ours {row['ours_ms']:.4f} ms "
        f"{row['gbps']:7.0f} GB/s {row['tflops']:6.1f} TF/s = {row['pct_roofline']:4.0f}% of roofline "
        f"({row['bound']}); HF {row.get('hf_ms', float('nan')):.3f} ms; err ref {row['err_vs_ref']:.1e} "
        f"HF {row.get('err_vs_hf', float('nan')):.1e}")
    del cache, bt, latent, k_rope
    return row


def tune_candidates(regime: str, smoke: bool) -> tuple[list[dict], list[tuple[int, int]]]:
    """The regime's grid as config dicts (the shipped CONFIGS first), and its tune shapes."""
    grid = TUNE[regime]
    keys = ["block_h", "block_n", "num_warps", "num_stages", "per_sm"]
    shipped = dict(kernels.CONFIGS[regime])
    cands = [shipped] + [c for c in (dict(zip(keys, (*k, p))) for k in grid["hybrid_kernels"] for p in grid["per_sm"])
                         if c != shipped]
    if smoke:
        return cands[:2], [(2, 64)]
    return cands, grid["shapes"]


def tune(regime: str, H: int, sh: dict, dev, dtype, args) -> tuple[dict, list]:
    """Time each candidate config at the regime's tune shapes; returns (best config, rows). Candidates that
    only differ in per_sm but give the same split counts are timed once."""
    cands, shapes = tune_candidates(regime, args.smoke)
    quiet = argparse.Namespace(**{**vars(args), "no_hf": True})
    rows, seen = [], {}
    for cfg in cands:
        bh = kernels._tile_rows(H, False, 16, cfg["block_h"])[1]
        splits = tuple(kernels.choose_num_splits(B * triton.cdiv(H, bh), triton.cdiv(S, sh["block"]) * sh["block"],
                                                 cfg["block_n"], cfg["per_sm"]) for B, S in shapes)
        kernel_key = (cfg["block_h"], cfg["block_n"], cfg["num_warps"], cfg["num_stages"], splits)
        if kernel_key in seen:
            continue
        seen[kernel_key] = cfg
        times = []
        try:
            for B, S in shapes:
                r = decode_row(H, S, B, sh, dev, dtype, quiet, cfg)
                if r.get("mismatch"):
                    raise RuntimeError("wrong results")
                times.append(r["ours_ms"])
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report and move on
            log(f"  tune {regime} {cfg}: failed: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        rows.append(dict(cfg=cfg, splits=splits, ms=sum(times), per_shape_ms=times))
    best = min(rows, key=lambda r: r["ms"])["cfg"] if rows else dict(kernels.CONFIGS[regime])
    return best, rows


# ------------------------------------------------------------------------------------------------ prefill
def prefill_row(H, T, sh, dev, dtype, args) -> dict:
    L, R, P, V = sh["L"], sh["R"], sh["P"], sh["V"]
    scale = (P + R) ** -0.5
    pairs = T * (T + 1) // 2
    flops = 2 * H * pairs * (L + R) + 2 * H * pairs * L
    hf_flops = 2 * H * pairs * (P + R) + 2 * H * pairs * V + 2 * T * L * H * (P + V)
    row = dict(kind="prefill", H=H, T=T, flops=flops, hf_flops=hf_flops,
               roofline_ms=max(flops / PEAK_FLOPS, T * (L + R) * 2 / HBM_BPS) * 1e3)
    g = torch.Generator(device=dev).manual_seed(2)
    cache = torch.zeros(triton.cdiv(T, sh["block"]) + 1, sh["block"], L + R, device=dev, dtype=dtype)
    bt = torch.randperm(cache.shape[0] - 1, device=dev, generator=g).int()[None]
    latent = torch.randn(1, T, L, device=dev, generator=g).to(dtype)
    k_rope = torch.randn(1, T, R, device=dev, generator=g).to(dtype)
    pos = torch.arange(T, device=dev)
    slots = bt[0, pos // sh["block"]].long() * sh["block"] + pos % sh["block"]
    triton_cache.mla_cache_write_triton(cache, latent[0], k_rope[0], slots)            # fill through our write op
    w_kvb = (torch.randn(H * (P + V), L, device=dev, generator=g) * L ** -0.5).to(dtype)
    w_uk, w_uv = ref.split_kv_b(w_kvb, H, P, V)
    q_nope = torch.randn(T, H, P, device=dev, generator=g).to(dtype)
    q_rope = torch.randn(T, H, R, device=dev, generator=g).to(dtype)
    q_lat = ref.absorb_q(q_nope, w_uk)
    seq = torch.tensor([T], device=dev, dtype=torch.int32)
    qsl = torch.tensor([0, T], device=dev, dtype=torch.int32)

    def ours():
        return kernels.mla_prefill_triton(q_lat, q_rope, cache, bt, seq, qsl, scale)

    def hf():
        return hf_expand_attend(q_nope.transpose(0, 1)[None], q_rope.transpose(0, 1)[None], latent, k_rope, w_kvb,
                                sh, scale, is_causal=True)

    o_lat = ours()
    n = min(T, 64)                                  # fp32 reference for the last n queries (positions T-n..T-1)
    want = ref.mla_prefill_ref(q_lat[-n:].float(), q_rope[-n:].float(), cache, bt, seq,
                               torch.tensor([0, n], device=dev, dtype=torch.int32), scale)
    row["err_vs_ref"] = err(o_lat[-n:], want)
    # HF's SDPA may fall back to the math kernel (q/k head dim 192 != v head dim 128): H*T*T scores
    run_hf = H * T * T * 2 * 4 + T * H * (P + V + P + R) * 2 <= HF_MAX_BYTES
    if run_hf:
        with torch.no_grad():
            row["err_vs_hf"] = err(ref.unabsorb_out(o_lat, w_uv), hf()[0].transpose(0, 1))
    else:
        row["hf_skipped"] = f"HF/SDPA fallback could need ~{H * T * T * 8 / 1e9:.0f} GB"
    if row["err_vs_ref"] > args.tol or row.get("err_vs_hf", 0.0) > args.tol:
        row["mismatch"] = True
        log(f"  !! prefill H={H} T={T}: error vs ref {row['err_vs_ref']:.2e}, vs HF {row.get('err_vs_hf')}")
    row["ours_ms"], _ = time_ms(ours, graph=not args.no_graph)
    if run_hf:
        with torch.no_grad():
            row["hf_ms"], _ = time_ms(hf, graph=not args.no_graph)
        row["hf_tflops"] = hf_flops / row["hf_ms"] / 1e9
        row["speedup_vs_hf"] = row["hf_ms"] / row["ours_ms"]
    row["tflops"] = flops / row["ours_ms"] / 1e9
    row["pct_roofline"] = 100 * row["roofline_ms"] / row["ours_ms"]
    log(f"  prefill H={H:3d} T={T:5d}: ours {row['ours_ms']:.3f} ms ({row['tflops']:.0f} TF/s absorbed, "
        f"{row['pct_roofline']:.0f}% of roofline); HF expanded {row.get('hf_ms', float('nan')):.3f} ms "
        f"({row.get('hf_tflops', float('nan')):.0f} TF/s); err ref {row['err_vs_ref']:.1e} "
        f"HF {row.get('err_vs_hf', float('nan')):.1e}")
    return row


# ------------------------------------------------------------------------------------------------ cache bytes
def cache_bytes_per_token() -> dict:
    """What the installed transformers stores per token per layer for DeepSeek-V2-Lite widths (measured on a
    1-layer model with a DynamicCache), next to ours and next to expanded per-head K/V."""
    from transformers import DeepseekV2Config, DynamicCache
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Model
    out = {}
    for heads in (16, 128):
        cfg = DeepseekV2Config(vocab_size=32, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=512, q_lora_rank=None,
                               qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1)
        model = DeepseekV2Model(cfg).to(torch.bfloat16).eval()
        cache = DynamicCache(config=cfg)
        T = 8
        kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        try:
            with torch.no_grad():
                model(input_ids=torch.zeros(1, T, dtype=torch.long), use_cache=True, **{kw: cache})
            if hasattr(cache, "layers"):
                tensors = [t for layer in cache.layers for t in (getattr(layer, "keys", None),
                                                                  getattr(layer, "values", None))]
            else:                                                     # older transformers
                tensors = list(cache.key_cache) + list(cache.value_cache)
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        except Exception as exc:  # noqa: BLE001 - report, do not lose the rest of the run
            log(f"  cache bytes: could not measure HF's cache ({type(exc).__name__}: {str(exc)[:100]})")
            tensors = []
        hf = sum(t.numel() * t.element_size() for t in tensors) / T
        out[heads] = dict(ours=(512 + 64) * 2, hf=hf, hf_shapes=[tuple(t.shape) for t in tensors],
                          expanded=heads * ((128 + 64) + 128) * 2)
        log(f"  cache/token/layer H={heads}: ours {out[heads]['ours']} B, HF stores {hf:.0f} B "
            f"({out[heads]['hf_shapes']}), expanded K/V {out[heads]['expanded']} B")
    return out


# ------------------------------------------------------------------------------------------------ compile check
def compile_check() -> None:
    """Compile the attention kernel for sm_90 without a GPU and print ptxas registers / spills / smem."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    ptxas = bundled_ptxas()
    L, R, page = 512, 64, 64

    def one(H, mode, bq, bh, bn, w, st, causal, split):
        args = dict(QL="*bf16", QR="*bf16", KL="*bf16", KR="*bf16", BT="*i32", SEQ="*i32", QSL="*i32", MASK="*bf16",
                    O="*bf16", PO="*fp32", PLSE="*fp32")
        ints = dict(s_qlb=H * L, s_qlt=H * L, s_qlh=L, s_qrb=H * R, s_qrt=H * R, s_qrh=R, s_klb=page * (L + R),
                    s_kls=L + R, s_krb=page * (L + R), s_krs=L + R, s_bt=256, s_mb=0, s_mt=0, s_ms=0, s_ob=H * L,
                    s_ot=H * L, s_oh=L, H=H, T=1, S=4096, L=L, R=R, NSEQ=64, NUM_SPLITS=4, T_SCR=1)
        cx = dict(s_qld=1, s_qrd=1, s_kld=1, s_krd=1, MODE=mode, PAGE=page, MASK_KIND=0, CAUSAL=causal, SPLIT=split,
                  SEARCH_STEPS=7, IEEE=False, BQ=bq, BH=bh, BN=bn, BLOCK_L=L, BLOCK_R=R,
                  WIN=kernels._window_pages(page, bn))
        sig = {n: ("constexpr" if n in cx else args.get(n, "fp32" if n == "sm_scale_log2" else "i32"))
               for n in kernels._mla_attn_kernel.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernels._mla_attn_kernel.arg_names)
                 if sig[n].startswith("*") or (sig[n] == "i32" and ints.get(n, 1) % 16 == 0 and ints.get(n))}
        k = triton.compile(ASTSource(kernels._mla_attn_kernel, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=w, num_stages=st))
        return ptxas_info(ptxas, k)

    for regime, H in (("decode_small_h", 16), ("decode_large_h", 128)):
        kernel_cfgs = {(c["block_h"], c["block_n"], c["num_warps"], c["num_stages"]) for c in tune_candidates(regime, False)[0]}
        for bh, bn, w, st in sorted(kernel_cfgs):
            try:
                log(f"{regime} H={H} bh={bh} bn={bn} warps={w} stages={st}: {one(H, 0, 1, bh, bn, w, st, False, True)}")
            except Exception as exc:  # noqa: BLE001
                log(f"{regime} bh={bh} bn={bn} warps={w} stages={st}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
    if gluon_common.HAVE_GLUON:
        for heads in (128, 16, 32):
            for page, direct in ((64, False), (64, True), (16, False), (0, False)):  # page 0: HF's dense cache
                log(f"gluon decode H={heads} page={page} direct={direct}: "
                    f"{ptxas_info(ptxas, compile_wg(page, direct, heads))}")
    c = kernels.CONFIGS["prefill"]
    log(f"prefill {c}: {one(16, 1, c['block_m'] // c['block_h'], c['block_h'], c['block_n'], c['num_warps'], c['num_stages'], True, False)}")
    for kern, cfg in ((kernels._mla_merge_kernel, kernels.CONFIGS["merge"]),
                      (kernels._mla_merge_uv_kernel, kernels.CONFIGS["merge_uv"])):
        ptrs = dict(PO="*fp32", PLSE="*fp32", O="*bf16", W="*bf16")
        cx = dict(BLOCK_L=L, BLOCK_S=16, BV=cfg.get("block_v", 16))
        sig = {n: "constexpr" if n in cx else ptrs.get(n, "i32") for n in kern.arg_names}
        cx = {n: v for n, v in cx.items() if n in kern.arg_names}
        k = triton.compile(ASTSource(kern, sig, cx), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg["num_warps"]))
        log(f"{kern.fn.__name__} {cfg}: {ptxas_info(ptxas, k)}")
    step = triton_step
    kern = step._mla_step_prep_kernel
    for block_b in (16, step.CONFIG["max_block_b"]):
        ptrs = dict(QN="*bf16", W="*bf16", QL="*bf16", KV="*bf16", NW="*bf16", KR="*bf16", SLOTS="*i64", CACHE="*bf16")
        cx = dict(BLOCK_B=block_b, BLOCK_P=128, BLOCK_L=step.CONFIG["block_l"], BLOCK_LN=L, BLOCK_R=R, IEEE=False)
        sig = {n: "constexpr" if n in cx else ptrs.get(n, "fp32" if n == "eps" else "i32") for n in kern.arg_names}
        k = triton.compile(ASTSource(kern, sig, cx), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=step.CONFIG["num_warps"]))
        log(f"_mla_step_prep_kernel BLOCK_B={block_b} {step.CONFIG}: {ptxas_info(ptxas, k)}")


def bundled_ptxas():
    """The ptxas that ships with Triton, else the one Triton is told to use (``TRITON_PTXAS_PATH``) or the CUDA
    toolkit's on the PATH or in /usr/local/cuda (None where there is none)."""
    d = Path(triton.__file__).parent / "backends/nvidia/bin"
    found = [d / "ptxas-blackwell", d / "ptxas", os.environ.get("TRITON_PTXAS_PATH"), shutil.which("ptxas"),
             "/usr/local/cuda/bin/ptxas"]
    return next((Path(p) for p in found if p and Path(p).exists()), None)


def compile_wg(page: int, direct: bool, heads: int = 128):
    """A Gluon decode kernel compiled for sm_90 on any machine (no GPU): gluon_wide.py's at 64+ heads, gluon_narrow.py's
    at up to 32 (heads padded to 16 or 32). The interpreter cannot run Gluon, so this is what CPU CI can check of them.
    Strides are taken as multiples of 16, as at DeepSeek widths."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    c = gluon_common
    ptrs = dict(QL="*bf16", QR="*bf16", LATP="*bf16", ROPEP="*bf16", BT="*i32", SEQ="*i32", PO="*fp32", PLSE="*fp32",
                O="*bf16")
    cx = dict(PAGE=page, LAT=c.LAT, ROPE=c.ROPE, DIRECT=direct, BN=c.BN, num_warps=4)
    if heads <= c.NARROW_MAX_HEADS:
        k, cx = gluon_narrow._mla_decode_narrow_kernel, {**cx, "HN": 16 if heads <= 16 else 32}
    else:
        k, cx = gluon_wide._mla_decode_wg_kernel, {**cx, "BH": c.WIDE_HEADS}
    sig = {n: "constexpr" if n in cx else ptrs.get(n, "fp32" if n == "sm_scale_log2" else "i32") for n in k.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names)
             if n not in cx and n not in ("H", "NUM_SPLITS", "S_DENSE", "sm_scale_log2")}
    return triton.compile(GluonASTSource(k, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4))  # gluon_wide's: the default partition's; the worker adds 4 more


def ptxas_info(ptxas, k) -> str:
    """Registers, spills, shared memory and the dot instruction of a compiled kernel (ptxas -v when present)."""
    info = ""
    if ptxas is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return (f"regs {regs.group(1) if regs else '?'} spills {spill.group(1) if spill else '?'} B smem "
            f"{k.metadata.shared} B {'wgmma' if 'wgmma' in k.asm['ptx'] else 'mma.sync'}")


# ------------------------------------------------------------------------------------------------ main
def table(rows: list, cache_info: dict, tuned: dict) -> str:
    out = ["| H | S | B | splits | kernel | ours ms | GB/s | TFLOP/s | % roofline (bound) | kernels alone ms (% roofline) "
           "| Triton kernel ms (x) | dense drop-in ms | cache read once ms (% of 4.3 TB/s) | HF ms | speedup "
           "| err ref / HF |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "decode":
            continue
        if "skipped" in r:
            out.append(f"| {r['H']} | {r['S']} | {r['B']} | | | skipped: {r['skipped']} | | | | | | | | | | |")
            continue
        hf = f"{r['hf_ms']:.3f}" if "hf_ms" in r else f"skip ({r.get('hf_skipped', '')})"
        sp = f"{r['speedup_vs_hf']:.1f}x" if "speedup_vs_hf" in r else ""
        kern = f"{r['ours_kernel_ms']:.4f} ({r['pct_roofline_kernel']:.0f}%)" if "ours_kernel_ms" in r else ""
        tri = f"{r['triton_ms']:.4f} ({r['x_triton']:.2f}x)" if "triton_ms" in r else ""
        dense = f"{r['dense_ms']:.4f}" if "dense_ms" in r else ""
        read = (f"{r['read_floor_ms']:.4f} ({r['read_floor_bytes'] / r['read_floor_ms'] / HBM_BPS * 1e5:.0f}%)"
                if "read_floor_ms" in r else "")
        out.append(f"| {r['H']} | {r['S']} | {r['B']} | {r['num_splits']} | {r.get('kernel', 'triton')} | "
                   f"{r['ours_ms']:.4f} | {r['gbps']:.0f} | {r['tflops']:.1f} | {r['pct_roofline']:.0f}% ({r['bound']}) | "
                   f"{kern} | {tri} | {dense} | {read} | {hf} | {sp} | "
                   f"{r['err_vs_ref']:.1e} / {r.get('err_vs_hf', float('nan')):.1e} |")
    out += ["", "| prefill H | T | ours ms | ours TFLOP/s (absorbed flops) | HF expanded ms | HF TFLOP/s | speedup "
            "| err ref / HF |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "prefill":
            hf = (f"{r['hf_ms']:.3f} | {r['hf_tflops']:.0f} | {r['speedup_vs_hf']:.2f}x" if "hf_ms" in r
                  else f"skip ({r.get('hf_skipped')}) | | ")
            out.append(f"| {r['H']} | {r['T']} | {r['ours_ms']:.3f} | {r['tflops']:.0f} | {hf} | "
                       f"{r['err_vs_ref']:.1e} / {r.get('err_vs_hf', float('nan')):.1e} |")
    out += ["", "| heads | ours B/token/layer | HF stores | expanded K/V |", "|---|---|---|---|"]
    for h, c in cache_info.items():
        out.append(f"| {h} | {c['ours']} | {c['hf']:.0f} ({c['ours'] and c['hf'] / c['ours']:.1f}x) | "
                   f"{c['expanded']} ({c['expanded'] / c['ours']:.1f}x) |")
    out += ["", "Decode configs used: " + json.dumps(tuned)]
    return "\n".join(out)


def split_sweep(args) -> None:
    """Where the split-KV model (kernels.choose_num_splits) leaves time at small grids: every power-of-two
    split count at 16 heads for small-batch decode shapes and the smallest of the 64K+ key shapes, with CUDA graphs,
    on the kernel that ships (the Gluon one on Hopper)."""
    dev, dtype, sh, H = "cuda", torch.bfloat16, FULL, 16
    cfg = kernels.decode_config(H)
    L, R, P = sh["L"], sh["R"], sh["P"]
    rows = []
    for B, S in ((1, 1024), (1, 4096), (8, 1024), (8, 4096), (32, 1024), (64, 1024), (128, 1024), (32, 4096),
                 (8, 16384)):
        cache, bt, seq = make_paged(B, S, sh, dev, dtype)
        g = torch.Generator(device=dev).manual_seed(1)
        q_lat = torch.randn(B, H, L, device=dev, generator=g).to(dtype)
        q_rope = torch.randn(B, H, R, device=dev, generator=g).to(dtype)
        scale = (P + R) ** -0.5
        if ops.implementation(q_lat, q_rope, cache) == GLUON:
            auto = gluon.split_count(B, H, bt.shape[1] * sh["block"])
        else:
            auto = kernels.choose_num_splits(B, bt.shape[1] * sh["block"], cfg["block_n"], cfg.get("per_sm", 1))
        want = ops.decode(q_lat, q_rope, cache, bt, seq, scale, 1)
        times = {}
        s = 1
        while s <= min(128, S // cfg["block_n"]):
            got = ops.decode(q_lat, q_rope, cache, bt, seq, scale, s)
            assert err(got, want) < args.tol, (B, S, s, err(got, want))
            times[s] = time_ms(lambda: ops.decode(q_lat, q_rope, cache, bt, seq, scale, s))[0]
            s *= 2
        best = min(times, key=times.get)
        rows.append(dict(B=B, S=S, auto=auto, times_us={k: round(v * 1e3, 2) for k, v in times.items()}, best=best))
        log(f"B={B:3d} S={S:5d}: auto {auto} ({times.get(auto, float('nan')) * 1e3:.1f} us), best {best} "
            f"({times[best] * 1e3:.1f} us); " + " ".join(f"{k}:{v * 1e3:.1f}" for k, v in times.items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  triton=triton.__version__, config=cfg, split_sweep=rows), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter or GPU), seconds")
    ap.add_argument("--out", default=None, help="write JSON results here")
    ap.add_argument("--no-tune", action="store_true", help="use runtime CONFIGS without sweeping")
    ap.add_argument("--no-graph", action="store_true", help="time without CUDA graphs")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--heads", default=None, help="comma list, e.g. 16 or 16,128")
    ap.add_argument("--sequential-pages", action="store_true",
                    help="each sequence's cache blocks in order (default: shuffled across sequences)")
    ap.add_argument("--tol", type=float, default=5e-2, help="max |err| / max |ref| allowed (bf16)")
    ap.add_argument("--compile-check", action="store_true", help="compile for sm_90 on any machine, print resources")
    ap.add_argument("--split-sweep", action="store_true",
                    help="16 heads, small batches: time every split count against the automatic one, then stop")
    args = ap.parse_args()
    if args.compile_check:
        compile_check()
        return
    if args.split_sweep:
        split_sweep(args)
        return
    gpu = torch.cuda.is_available()
    smoke = args.smoke or not gpu
    args.smoke = smoke
    sh = SMOKE if smoke else FULL
    dev = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32          # the interpreter cannot do bf16 arithmetic
    heads = [int(h) for h in args.heads.split(",")] if args.heads else sh["heads"]
    log(f"device {torch.cuda.get_device_name() if gpu else 'cpu (interpreter)'}, torch {torch.__version__}, "
        f"triton {triton.__version__}, dtype {dtype}, shapes {'smoke' if smoke else 'full'}")
    t_start = time.time()
    tuned = {}
    tune_rows = {}
    for H in heads:
        regime = "decode_small_h" if H <= 32 else "decode_large_h"
        if regime in tuned:
            continue
        if args.no_tune:
            tuned[regime] = dict(kernels.CONFIGS[regime])
            continue
        cands, shapes = tune_candidates(regime, smoke)
        log(f"tuning {regime} at H={H}, (B, S) in {shapes}, over {len(cands)} configs")
        tuned[regime], tune_rows[regime] = tune(regime, H, sh, dev, dtype, args)
        for r in sorted(tune_rows[regime], key=lambda r: r["ms"])[:12]:
            log(f"    {r['cfg']} splits {r['splits']}: {r['ms']:.4f} ms "
                f"({' + '.join(f'{t:.4f}' for t in r['per_shape_ms'])})")
        log(f"  -> best {regime}: {tuned[regime]} (paste into hybrid_kernels/mla/triton_attention.py CONFIGS if it differs)")
    rows = []
    for H in heads:
        regime = "decode_small_h" if H <= 32 else "decode_large_h"
        for S in sh["lens"]:
            for B in sh["batches"]:
                log(f"decode H={H} S={S} B={B} ({time.time() - t_start:.0f}s elapsed)")
                rows.append(decode_row(H, S, B, sh, dev, dtype, args, tuned[regime]))
                if gpu:
                    torch.cuda.empty_cache()
    if not args.no_prefill:
        for H in heads:
            for T in sh["prefill"]:
                log(f"prefill H={H} T={T} ({time.time() - t_start:.0f}s elapsed)")
                rows.append(prefill_row(H, T, sh, dev, dtype, args))
                if gpu:
                    torch.cuda.empty_cache()
    log("cache bytes per token per layer")
    cache_info = cache_bytes_per_token()
    md = table(rows, cache_info, tuned)
    print("\n" + md + "\n", flush=True)
    bad = [r for r in rows if r.get("mismatch")]
    log(f"done in {time.time() - t_start:.0f}s; {len(bad)} mismatching rows")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name() if gpu else "cpu", torch=torch.__version__, triton=triton.__version__,
            smoke=smoke, rows=rows, tune=tune_rows, configs=tuned, cache_bytes=cache_info, markdown=md), indent=1,
            default=str))
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
