"""Whole models, eager vs ``torch.compile(backend="hybrid")`` with Inductor: logits within 1e-5 (fp32) and
identical greedy tokens through the recompiles generate triggers, with DynamicCache and StaticCache."""
import pytest

from harness import assert_matches, run_both
from test_modules import EXPECTED


@pytest.mark.parametrize("name", list(EXPECTED))
def test_dynamic_cache(name):
    assert_matches(run_both(name, new_tokens=4))


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "mamba2", "jamba"])
def test_static_cache(name):
    assert_matches(run_both(name, new_tokens=4, cache_implementation="static"))
