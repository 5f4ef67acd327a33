"""The split-KV merge's program tiles (kernels.merge_tiles: rows x columns of the merged output per program), swept on
the Gluon decode rows that split (GPU).

For each (heads, S cached keys, B sequences): the whole decode as it ships (attention + merge, CUDA-graphed, L2
flushed, median of 100 replays: bench/mla.py's time_ms) with every candidate tile, with and without PDL on the merge,
three rounds in turn; the tile merge_tiles picks is marked. Every candidate's output is checked against the shipped
one first. Usage: python3 bench/mla_merge.py [--out merge.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.mla import make_paged, time_ms  # noqa: E402
from hybrid_kernels.mla import gluon  # noqa: E402
from hybrid_kernels.mla import gluon_common as widths  # noqa: E402
from hybrid_kernels.mla import triton_attention as kernels  # noqa: E402

SHAPES = ((16, 1024, 64), (16, 4096, 32), (16, 16384, 8), (16, 1024, 1), (16, 16384, 1), (16, 4096, 8),
          (128, 4096, 32), (128, 1024, 8), (128, 16384, 1))       # (heads, S, B)
TILES = [(hb, bl) for hb in (1, 2, 4, 8, 16) for bl in (128, 256, 512)]


def row(H: int, S: int, B: int) -> dict | None:
    dev, dt = "cuda", torch.bfloat16
    cache, bt, seq = make_paged(B, S, dict(L=widths.LAT, R=widths.ROPE, block=widths.BN), dev, dt)
    q_lat = torch.randn(B, H, widths.LAT, device=dev).to(dt)
    q_rope = torch.randn(B, H, widths.ROPE, device=dev).to(dt)
    splits = gluon.split_count(B, H, bt.shape[1] * widths.BN)
    if splits == 1:
        return None
    block_s = min(triton.next_power_of_2(splits), kernels.CONFIGS["merge"]["block_s"])
    rule = kernels.merge_tiles(B * H, block_s, widths.LAT)
    real_tiles, real_pdl = kernels.merge_tiles, kernels.pdl_opts

    def decode():
        return gluon.decode(q_lat, q_rope, cache, cache[..., widths.LAT:], widths.BN, bt, seq, 192 ** -0.5, splits,
                              None)

    shipped = decode()
    cands = [(hb, bl, True) for hb, bl in TILES if hb * block_s * bl <= 2 * kernels.CONFIGS["merge"]["max_elems"]]
    cands += [(*rule, False)]
    times = {c: [] for c in cands}
    try:
        for rnd in range(3):
            for hb, bl, pdl in cands:
                kernels.merge_tiles = lambda rows, bs, L, t=(hb, bl): t
                kernels.pdl_opts = real_pdl if pdl else (lambda t: {"PDL": False})
                if rnd == 0:
                    err = (decode().float() - shipped.float()).abs().max().item()
                    assert err < 1e-2, f"tile {hb}x{bl}: output differs from the shipped merge's by {err}"
                times[(hb, bl, pdl)].append(time_ms(decode)[0] * 1e3)
    finally:
        kernels.merge_tiles, kernels.pdl_opts = real_tiles, real_pdl
    med = {c: statistics.median(v) for c, v in times.items()}
    best = min(med, key=med.get)
    picked = med[(*rule, True)]
    print(f"H={H} S={S} B={B} splits={splits} rows={B * H}: merge_tiles picks {rule[0]}x{rule[1]} {picked:.1f} us, "
          f"best {best[0]}x{best[1]}{'' if best[2] else ' without PDL'} {med[best]:.1f} us", flush=True)
    print("   " + "  ".join(f"{hb}x{bl}{'' if pdl else '-nopdl'}{'*' if (hb, bl) == rule else ''}={t:.1f}"
                           for (hb, bl, pdl), t in med.items()), flush=True)
    return dict(H=H, S=S, B=B, splits=splits, rows=B * H, rule=list(rule), us={f"{hb}x{bl}{'' if p else '-nopdl'}": t
                                                                              for (hb, bl, p), t in med.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write JSON rows here")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and widths.HAVE_GLUON):
        sys.exit("bench/mla_merge.py needs an sm_90 GPU and Triton with Gluon (the decode kernels that split)")
    rows = [r for shape in SHAPES if (r := row(*shape)) is not None]
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
