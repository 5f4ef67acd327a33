"""Engine files: cold start (process start to first token) and decode TPOT, engine directory vs model directory.

    python3 bench/engine_files.py --models llama,deepseek_v3 --device cuda --out $OUT

Per model: `hybrid export` into a temporary directory (timed), then in fresh processes `hybrid generate MODEL` (which
traces and compiles) and `hybrid generate ENGINE_DIR` (no compile), each timed from process start to the first
tokens (the whole process: start, load or compile, 16 greedy tokens of 2 prompts, exit), their tokens compared. ``--tpot``: in this process, the
decode TPOT of B = 8 streams from each engine (the in-process compiled engine is the baseline), the same run; an
engine directory with AOTInductor packages (`--aot inductor`) also through its exported
programs (HYBRID_ENGINE_ROUTE=exported).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log, write  # noqa: E402

PROMPT = "5,6,7,8,9,10,11"


def _cli(*args: str, timeout: float = 400) -> tuple[float, dict | None, str]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    out = json.loads(p.stdout) if p.returncode == 0 and p.stdout.strip().startswith("{") else None
    return seconds, out, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""


PHASES = """
import json, sys, time
t0 = time.perf_counter()
import torch
from runtime.engine import Engine, SamplingParams
t1 = time.perf_counter()
engine = Engine.from_pretrained(sys.argv[1], device=sys.argv[2])
t2 = time.perf_counter()
first = next(e for e in engine.stream([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True)))
t3 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, load_s=t2 - t1, first_token_s=t3 - t2)))
"""


def phases(target: str, device: str) -> dict:
    """Seconds of a fresh process spent importing, loading (and compiling) and reaching the first token."""
    p = subprocess.run([sys.executable, "-c", PHASES, target, device], capture_output=True, text=True, timeout=400)
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1:]}
    return {k: round(v, 2) for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


def tpot(engine, batch: int, tokens: int) -> float:
    from runtime.engine import SamplingParams
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8] for i in range(batch)]
    best = float("inf")
    for _ in range(3):  # the first run records the decode graphs (and, in-process, compiles)
        stamps, first = [], None
        for e in engine.stream(prompts, params):
            first = e.request_id if first is None else first
            if e.token_id is not None and e.request_id == first:
                stamps.append(time.perf_counter())
        best = min(best, (stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1e3)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama,deepseek_v3")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tpot", action="store_true", help="also decode TPOT at B = 8 in this process")
    ap.add_argument("--cold", action="store_true", help="cold start in fresh processes")
    ap.add_argument("--phases", action="store_true", help="import / load / first-token seconds of the engine directory")
    ap.add_argument("--aot", choices=("inductor", "none"), default=None, help="hybrid export --aot (default: export's)")
    ap.add_argument("--out", default=None, help="result file (.json; a .md beside it)")
    args = ap.parse_args(argv)
    rows = []
    work = Path(tempfile.mkdtemp(prefix="engine_files_"))
    for model in args.models.split(","):
        d = work / model
        t0 = time.perf_counter()
        aot = ["--aot", args.aot] if args.aot else []
        p = subprocess.run([sys.executable, "-m", "runtime.cli", "export", model, str(d), "--device", args.device, *aot],
                           capture_output=True, text=True, timeout=900)
        row = {"model": model, "export_s": round(time.perf_counter() - t0, 1), "export_rc": p.returncode}
        log("export", f"{model}: rc {p.returncode} in {row['export_s']} s; {p.stderr.strip().splitlines()[-1:]}")
        if p.returncode:
            rows.append(row)
            continue
        manifest = json.loads((d / "manifest.json").read_text())
        row["graphs"] = len(manifest["programs"])
        row["aot"] = manifest.get("aot", {}).get("route", "none")
        if args.cold:  # one fresh process each: start, load (and compile), 16 greedy tokens for 2 prompts, exit
            toks = {}
            for name, target in (("model_dir", model), ("engine_dir", str(d))):
                s, out, err = _cli("generate", target, "--prompt-ids", PROMPT, "--prompt-ids", "9,9,9",
                                   "--max-new-tokens", "16", "--json", "--device", args.device)
                row[f"cold_{name}_s"] = round(s, 2)
                toks[name] = [o["token_ids"] for o in out["outputs"]] if out else err
                log("cold", f"{model} {name}: {s:.1f} s {err}")
            row["tokens_equal"] = toks["model_dir"] == toks["engine_dir"]
            row["cold_speedup"] = round(row["cold_model_dir_s"] / row["cold_engine_dir_s"], 2)
        if args.phases:
            for k, v in phases(str(d), args.device).items():
                row[f"engine_dir_{k}"] = v
            log("phases", f"{model}: {row}")
        if args.tpot:  # engine_dir: its AOTInductor packages where it has them; engine_dir_exported: its programs
            import os

            from runtime.engine import Engine
            runs = [("in_process", model), ("engine_dir", str(d))]
            if row["aot"] == "inductor":
                runs.append(("engine_dir_exported", str(d)))
            for name, target in runs:
                os.environ["HYBRID_ENGINE_ROUTE"] = "exported" if name == "engine_dir_exported" else "packaged"
                engine = Engine.from_pretrained(target, device=args.device, max_num_seqs=8)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    row[f"tpot_{name}_ms"] = round(tpot(engine, 8, 48), 3)
                # whether decode replayed CUDA graphs (a capture that fails warns and runs the steps uncaptured)
                row[f"decode_graphs_{name}"] = len(engine.runner._graphs) if engine.runner.graphs_enabled else 0
                notes = sorted({" ".join(str(w.message).split())[:200] for w in caught if "hybrid" in str(w.message)})
                log("tpot", f"{model} {name}: {row[f'tpot_{name}_ms']} ms, {row[f'decode_graphs_{name}']} decode "
                            f"graphs; {notes}")
                del engine
            os.environ.pop("HYBRID_ENGINE_ROUTE")
            row["tpot_ratio"] = round(row["tpot_engine_dir_ms"] / row["tpot_in_process_ms"], 3)
        rows.append(row)
    cols = sorted({k for r in rows for k in r}, key=lambda k: (k != "model", k))
    table = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n" + "\n".join(
        "| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows)
    print(table)
    write(args.out, "engine_files", rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
