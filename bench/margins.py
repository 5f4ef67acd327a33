"""Where the engine's greedy tokens leave HF eager's, and whether that is a near tie: HF's top-1 minus top-2 logit
at that step, against the spread of its margins over the sequence.

    python bench/margins.py --model mamba2-2.7b-shape --options '{}' '{"norm": false}'

Same prompts as bench/engine.py (seed 0, random ids), one sequence. For each engine configuration (backend options,
one engine each): the first step where its greedy tokens differ from HF eager's, HF's top-1 minus top-2 logit at
that step, and HF's median and smallest margin over the sequence. A divergence where HF's margin is far below its
median (a few hundredths of a logit in bf16) is a near tie that any change of summation order can flip.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log  # noqa: E402
from runtime import zoo  # noqa: E402
from runtime.engine import Engine, SamplingParams  # noqa: E402


def tag(msg):
    log("margins", msg)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mamba2-2.7b-shape")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--options", nargs="+", default=["{}"], help="JSON backend options, one engine per entry")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = zoo.build(args.model, dtype=torch.bfloat16 if dev == "cuda" else torch.float32, device=dev)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=g).to(dev)
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = []  # no end token (the engine ignores it too; None would be filled back in from the model's
    # generation config): HF's min_new_tokens would mask it instead
    with torch.no_grad():
        out = model.generate(prompt, generation_config=cfg, max_new_tokens=args.tokens, do_sample=False,
                             attention_mask=torch.ones_like(prompt), pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    hf_ids = out.sequences[0, args.prompt:].tolist()
    top2 = [torch.topk(step[0].float(), 2).values for step in out.logits]
    margins = [float(t[0] - t[1]) for t in top2]
    rows = []
    for opts in args.options:
        engine = Engine(model, cache_memory=1 << 30, max_num_seqs=1, compile_options=json.loads(opts))
        rid = engine.add_request(prompt[0].tolist(), SamplingParams(max_tokens=args.tokens, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        ids = engine.output(rid).token_ids
        first = next((i for i, (a, b) in enumerate(zip(ids, hf_ids)) if a != b), None)
        row = dict(model=args.model, options=opts, agreeing_prefix=len(ids) if first is None else first,
                   hf_margin_at_divergence=None if first is None else margins[first],
                   hf_median_margin=statistics.median(margins), hf_min_margin=min(margins),
                   hf_min_margin_step=margins.index(min(margins)))
        rows.append(row)
        tag(json.dumps(row))
        del engine
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
