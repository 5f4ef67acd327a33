"""The survey's fixed sample (``bench/survey.py --sample``): every sample architecture builds tiny from its default
config, and hybrid neither crashes nor gives a wrong result on it: explain, the compiled model's logits and greedy
tokens (dynamic and static cache), the engine's greedy tokens against HF's. A clean refusal by the engine passes.
One test per architecture, each in a child process of its own (``pytest -n 2`` splits them).

A sample architecture takes 1-3 minutes on two CPU cores, so by default only ``QUICK`` runs (a family outside the zoo
whose linear-attention layers the engine keeps as state rows beside paged attention and MoE); ``HYBRID_SURVEY=1``
runs the whole sample."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import survey  # noqa: E402

QUICK = ["qwen3_next"]
ARCHS = survey.SAMPLE if os.environ.get("HYBRID_SURVEY") == "1" else QUICK


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_sample_architecture(arch):
    r = survey.run_one(arch)
    assert r["outcome"] not in ("unbuildable", "hf-fails"), f"{arch} is in the sample but {r['outcome']}: {r['reason']}"
    assert r["outcome"] not in ("crash", "wrong"), f"{arch}: {r['outcome']}: {r['reason']}"


def test_quick_is_part_of_the_sample():
    assert set(QUICK) <= set(survey.SAMPLE)
