"""Where the 16-head Gluon decode (hopper_narrow.py) spends its time (dev probe, H200).

For each shape (B sequences x S cached keys, DeepSeek-V2-Lite attention, shuffled 64-key pages):
  - the time as bench/mla.py takes it (CUDA graph of attention + merge, L2 flushed, median of 100 replays), next to
    one plain read of the cache and to the same launch with every length 0 (launch, queries, epilogue, merge: the
    part that does not scale with the keys);
  - a timeline from the kernel's own global-timer stamps (TS), medians over 20 flushed launches: how far apart the
    programs start, the time to the first tile's copies (issued once the length is known; "lengths") and to that
    tile landing, the steady per-tile time, the epilogue, and when the first and the last program end (all from the first program's start). The global timer
    may tick as coarsely as 1 us on some GPUs: the figures are medians over programs and launches, and the per-tile
    time spans a whole loop.
Usage (GPU): python3 bench/mla_probe.py [--shapes 1024x64,4096x32] [--out probe.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.mla import _flush_l2, make_paged, read_floor_ms, time_ms  # noqa: E402
from runtime.ops.mla import hopper, kernels  # noqa: E402

SHAPES = "1024x64,1024x128,4096x32,16384x8,4096x128,256x128"     # the rows under 80% at 16 heads, two more
STAMPS = ("start", "lengths", "tile0", "loop_end", "end", "sm", "tiles")
HBM_BPS = 4.3e12


def decode(q_lat, q_rope, cache, bt, seq, scale, splits, **knobs):
    """hopper._decode's paged path, ``knobs`` (the stamps TS) to the narrow kernel."""
    out = q_lat.new_empty(q_lat.shape)
    parts = hopper._launch(q_lat, q_rope, cache, cache[..., hopper.LAT:], cache.shape[1], bt, seq, scale, splits,
                           out, **knobs)
    if parts is not None:
        B, H, L = q_lat.shape
        kernels.merge(*parts, out, H=H, L=L, num_splits=splits, n_scr_tokens=B, t_out=1, w_uv=None)
    return out


def timeline(ts: torch.Tensor) -> dict:
    """One launch's stamps [programs, 8] (ns; columns STAMPS) -> figures in us, from the first program's start.
    Programs without keys have no tile stamps and count only for start, lengths and end."""
    t = ts[:, :5].double() / 1e3
    t = t - t[:, 0].min()
    tiles = ts[:, 6]
    busy = tiles > 0
    start, lengths, tile0, loop_end, end = t.unbind(1)
    per_tile = (loop_end - tile0)[tiles > 1] / (tiles[tiles > 1] - 1)
    med = (lambda x: x.median().item() if x.numel() else float("nan"))
    return dict(start_spread=start.max().item(), to_lengths=med(lengths - start),
                to_tile0=med(tile0[busy] - start[busy]), to_tile0_max=(tile0[busy] - start[busy]).max().item()
                if busy.any() else float("nan"),
                per_tile=med(per_tile), epilogue=med(end[busy] - loop_end[busy]), first_end=end.min().item(),
                last_end=end.max().item(), programs_per_sm=torch.bincount(ts[:, 5]).max().item())


def probe(S: int, B: int) -> dict:
    dev, dt, H = "cuda", torch.bfloat16, 16
    sh = dict(L=hopper.LAT, R=hopper.ROPE, block=hopper.BN)
    cache, bt, seq = make_paged(B, S, sh, dev, dt)
    g = torch.Generator(device=dev).manual_seed(1)
    q_lat = torch.randn(B, H, hopper.LAT, device=dev, generator=g).to(dt)
    q_rope = torch.randn(B, H, hopper.ROPE, device=dev, generator=g).to(dt)
    scale = 192 ** -0.5
    splits = hopper.split_count(B, H, bt.shape[1] * hopper.BN)
    nbytes = B * S * (sh["L"] + sh["R"]) * 2 + B * H * (sh["L"] + sh["R"]) * 2 + B * H * sh["L"] * 2
    read_ms = read_floor_ms(cache, graph=True)
    ms = time_ms(lambda: decode(q_lat, q_rope, cache, bt, seq, scale, splits))[0]
    no_keys = torch.zeros_like(seq)
    empty_ms = time_ms(lambda: decode(q_lat, q_rope, cache, bt, no_keys, scale, splits))[0]
    ts = torch.zeros(B * splits, 8, device=dev, dtype=torch.int64)
    figs = []
    for _ in range(20):
        ts.zero_()
        _flush_l2()
        decode(q_lat, q_rope, cache, bt, seq, scale, splits, TS=ts)
        torch.cuda.synchronize()
        figs.append(timeline(ts))
    r = dict(S=S, B=B, splits=splits, us=ms * 1e3, pct_roofline=100 * nbytes / HBM_BPS / (ms / 1e3),
             read_once_us=read_ms * 1e3, no_keys_us=empty_ms * 1e3,
             **{k: statistics.median(f[k] for f in figs) for k in figs[0]})
    print(f"S={S:5d} B={B:3d} splits={splits:2d} {r['us']:6.1f} us ({r['pct_roofline']:3.0f}%, read once "
          f"{r['read_once_us']:5.1f}, no keys {r['no_keys_us']:4.1f}) | start spread {r['start_spread']:4.1f} lengths "
          f"{r['to_lengths']:4.1f} tile0 {r['to_tile0']:4.1f} (max {r['to_tile0_max']:4.1f}) per tile "
          f"{r['per_tile']:4.2f} epilogue {r['epilogue']:4.1f} end {r['first_end']:5.1f}..{r['last_end']:5.1f}",
          flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="comma list of SxB (cached keys x sequences)")
    ap.add_argument("--out", default=None, help="write JSON rows here")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and hopper.HAVE_GLUON):
        sys.exit("bench/mla_probe.py needs an sm_90 GPU and Triton with Gluon (the kernel it probes)")
    rows = []
    for shape in args.shapes.split(","):
        S, B = (int(x) for x in shape.split("x"))
        rows.append(probe(S, B))
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    triton=__import__("triton").__version__)
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
