"""Shared by the bench scripts: environment stamp, timing, result files."""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

HBM_BPS, PEAK_FLOPS = 4.3e12, 790e12  # measured H200 ceilings (shared/notes/performance.md)


def log(tag: str, msg: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def environment() -> dict:
    import transformers
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                commit=os.environ.get("HYBRID_COMMIT", "unknown"),
                device=torch.cuda.get_device_name() if cuda else "cpu",
                torch=torch.__version__, triton=triton_version, transformers=transformers.__version__,
                python=sys.version.split()[0])


def time_ms(fn, warmup: int = 3, rep: int = 10) -> float:
    """Median wall time of fn() in ms (CUDA-synchronised); for whole-model steps."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def write(out: str | None, name: str, rows: list[dict], table: str, extra: dict | None = None) -> None:
    if not out:
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(bench=name, environment=environment(), rows=rows, **(extra or {}))
    path.write_text(json.dumps(data, indent=1, default=str))
    path.with_suffix(".md").write_text(
        f"# {name}\n\n" + "\n".join(f"- {k}: {v}" for k, v in data["environment"].items()) + "\n\n" + table + "\n")
