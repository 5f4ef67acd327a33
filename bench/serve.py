"""Online serving benchmark: ``hybrid serve`` driven over HTTP, in the form of vLLM's serving benchmark.

    python bench/serve.py --model mixtral-8x7b-shape --rates 2,8,32,inf --num-requests 200 --out bench/results/x.json
    python bench/serve.py --plot bench/results/x.json          # latency vs request rate, PNG next to it

Starts ``hybrid serve MODEL`` as a user would (a subprocess on 127.0.0.1), then per request rate sends
``--num-requests`` streaming /v1/completions requests with Poisson arrivals (``inf``: all at once); prompts are random
token ids with lengths uniform in ``--prompt-len``, outputs ``--output-len`` tokens (``ignore_eos``). Per rate:
requests/s, output tokens/s, TTFT, TPOT (time per output token after the first) and end-to-end latency at p50 and
p99. Baselines in the same run: one client alone (unloaded TPOT) and the in-process engine streaming the same
request (after the server has stopped), so the HTTP path's cost is a ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def _one(client, url: str, prompt: list[int], out_len: int, t_start: float) -> dict:
    """One streaming request: when it was sent, its first token, every later token."""
    body = dict(prompt=prompt, max_tokens=out_len, temperature=0, ignore_eos=True, stream=True)
    times, sent = [], time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return dict(error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return dict(error=chunk["error"]["message"])
            now = time.perf_counter()
            times += [now] * len(chunk["choices"][0].get("token_ids") or [])
    if not times:
        return dict(error="no tokens")
    return dict(sent=sent - t_start, ttft=times[0] - sent, e2e=times[-1] - sent, tokens=len(times),
                tpot=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None)


async def run_rate(url: str, requests: list[tuple[list[int], int]], rate: float, seed: int) -> dict:
    import httpx
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0, tasks = time.perf_counter(), []
        for prompt, out_len in requests:
            tasks.append(asyncio.create_task(_one(client, url, prompt, out_len, t0)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["tokens"] for r in ok)
    row = dict(rate=rate, requests=len(requests), completed=len(ok), errors=len(errors), wall_s=round(wall, 3),
               req_per_s=round(len(ok) / wall, 3), out_tok_per_s=round(tokens / wall, 1))
    for key in ("ttft", "tpot", "e2e"):
        values = [r[key] * 1e3 for r in ok if r[key] is not None]
        row[f"{key}_p50_ms"], row[f"{key}_p99_ms"] = round(_pct(values, 50), 2), round(_pct(values, 99), 2)
    if errors:
        row["first_error"] = errors[0]
    return row


def start_server(args, port: int) -> subprocess.Popen:
    import httpx
    cmd = [sys.executable, "-m", "runtime.cli", "serve", args.model, "--port", str(port), "--compile", args.compile,
           "--max-num-seqs", str(args.max_num_seqs), "--cache-mb", str(args.cache_mb), "--log-level", "warning"]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.no_packed_steps:
        cmd += ["--no-packed-steps"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
    deadline = time.time() + args.start_timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"hybrid serve exited with {proc.returncode} before it served")
        if time.time() > deadline:
            proc.kill()
            raise SystemExit(f"hybrid serve did not answer /health within {args.start_timeout} s")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)


def in_process_tpot(args, prompt: list[int], out_len: int) -> float:
    """TPOT (ms) of the same request streamed from an engine in this process: the HTTP path's baseline."""
    import torch

    from runtime.cli import DTYPES
    from runtime.engine import Engine, SamplingParams
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    engine = Engine.from_pretrained(args.model, dtype=dtype, compile=args.compile, max_num_seqs=args.max_num_seqs,
                                    cache_memory=args.cache_mb << 20,
                                    packed_steps=False if args.no_packed_steps else None)
    params = SamplingParams(max_tokens=out_len, ignore_eos=True)
    best = float("inf")
    for _ in range(3):  # the first run compiles and records the decode graphs
        times = [time.perf_counter() for e in engine.stream([prompt], params) if e.token_id is not None]
        best = min(best, (times[-1] - times[0]) / (len(times) - 1) * 1e3)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama")
    ap.add_argument("--rates", default="1,4,16,inf", help="requests/s, comma-separated; inf: all at once; "
                    "0.8peak: 80%% of the requests/s the inf rate before it measured")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", default="32,256", help="min,max prompt tokens (uniform)")
    ap.add_argument("--output-len", default="32,128", help="min,max output tokens (uniform)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--cache-mb", type=int, default=4096)
    ap.add_argument("--compile", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--start-timeout", type=float, default=900,
                    help="seconds to wait for the server's /health (its warm-up compiles every call kind first: "
                         "a realistic shape on the H100 took more than 300 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-packed-steps", action="store_true",
                    help="the server's prefills in padded steps (the baseline of packed steps under load)")
    ap.add_argument("--out", help="JSON path (markdown next to it)")
    ap.add_argument("--plot", help="draw the PNG of a results JSON and exit")
    args = ap.parse_args(argv)
    if args.plot:
        return plot(Path(args.plot))
    from bench.common import log, write
    from runtime import zoo
    vocab = zoo.make_config(args.model).get_text_config().vocab_size if args.model in zoo.ZOO else 256
    rng = random.Random(args.seed)
    lo, hi = map(int, args.prompt_len.split(","))
    olo, ohi = map(int, args.output_len.split(","))
    requests = [([rng.randrange(8, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(olo, ohi))
                for _ in range(args.num_requests)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log("serve", f"starting hybrid serve {args.model} on {url}")
    proc = start_server(args, port)
    rows = []
    try:
        probe = (requests[0][0], ohi)
        asyncio.run(run_rate(url, [probe] * 2, float("inf"), args.seed))  # warm-up: compile, record graphs
        alone = asyncio.run(run_rate(url, [probe], float("inf"), args.seed))
        alone["rate"] = "one client"
        rows.append(alone)
        log("serve", f"one client: TPOT {alone['tpot_p50_ms']} ms")
        peak = None
        for spec in args.rates.split(","):
            if spec.endswith("peak"):  # a share of the throughput the "inf" row measured before it
                if peak is None:
                    raise SystemExit(f"--rates: {spec} needs an 'inf' rate before it")
                rate = round(float(spec[:-4] or 1) * peak, 3)
            else:
                rate = float(spec)
            row = asyncio.run(run_rate(url, requests, rate, args.seed))
            if spec.endswith("peak"):
                row["rate_of_peak"] = spec
            if rate == float("inf"):
                peak = row["req_per_s"]
            rows.append(row)
            log("serve", f"rate {rate}: {row['req_per_s']} req/s, {row['out_tok_per_s']} tok/s, TTFT p50/p99 "
                         f"{row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms, TPOT p50/p99 {row['tpot_p50_ms']}/"
                         f"{row['tpot_p99_ms']} ms, {row['errors']} errors")
    finally:
        proc.send_signal(2)
        proc.wait(60)
    engine_tpot = in_process_tpot(args, *probe)
    log("serve", f"in-process engine: TPOT {engine_tpot:.2f} ms (served alone: {alone['tpot_p50_ms']} ms)")
    cols = ["rate", "rate_of_peak", "completed", "errors", "req_per_s", "out_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
            "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms"]
    table = "\n".join(["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
                      + ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows])
    table += (f"\n\nIn-process engine, same request streamed alone: TPOT {engine_tpot:.2f} ms; through HTTP "
              f"{alone['tpot_p50_ms']} ms ({alone['tpot_p50_ms'] / engine_tpot:.3f}x).\n")
    print(table)
    write(args.out, "serve", rows, table, dict(model=args.model, args=vars(args), engine_tpot_ms=round(engine_tpot, 3)))
    return 0


def plot(path: Path) -> int:
    """TTFT and TPOT (p50, p99) against the request rate, one PNG next to the JSON."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = json.loads(path.read_text())
    rows = [r for r in data["rows"] if isinstance(r["rate"], (int, float))]
    finite = [r["rate"] for r in rows if r["rate"] != float("inf")]
    top = max(finite) * 2 if finite else 1.0
    xs = [r["rate"] if r["rate"] != float("inf") else top for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("ttft", "tpot")):
        for q in ("p50", "p99"):
            ax.plot(xs, [r[f"{key}_{q}_ms"] for r in rows], marker="o", label=q)
        ax.set_xscale("log")
        ax.set_xlabel("request rate (req/s; rightmost: all at once)")
        ax.set_ylabel(f"{key.upper()} (ms)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"hybrid serve {data.get('model', '')} ({data['environment']['device']})")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
