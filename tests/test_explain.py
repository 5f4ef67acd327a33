"""The explain report finds every MLA attention, Mamba mixer and MoE block of every zoo family, in prefill
and decode graphs, from Python and from the CLI."""
import json
import subprocess
import sys

import pytest
import torch

from compiler import explain
from runtime import zoo
from harness import prompt
from test_modules import EXPECTED

#: status each kind reaches today (updated as the rewrite passes land)
STATUS = {"mla": "rewritten", "ssm": "rewritten", "moe": "rewritten"}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_explain_finds_every_region(name):
    model = zoo.build(name)
    report = explain(model, prompt(model, 1, 8), generate_tokens=3)
    regions = {r["module"]: r for r in report.regions()}
    assert {m: r["kind"] for m, r in regions.items()} == EXPECTED[name]
    for r in regions.values():
        assert r["status"] == STATUS[r["kind"]], r
        assert len(r["graphs"]) >= 2, "region must be seen in prefill and decode graphs"
        assert r["reason"] or r["status"] == "rewritten"
    if not EXPECTED[name]:
        assert "no MLA, SSM or MoE region" in report.table()


def test_cli_explain_json_on_a_model_directory(tmp_path):
    hybrid = [sys.executable, "-m", "runtime.cli"]
    subprocess.run(hybrid + ["zoo", "save", "jamba", str(tmp_path / "jamba")], check=True, capture_output=True)
    res = subprocess.run(hybrid + ["explain", str(tmp_path / "jamba"), "--json"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(res.stdout)
    kinds = sorted(r["kind"] for r in data["regions"])
    assert kinds == ["moe", "moe", "ssm", "ssm"]
    assert {"kind", "module", "class", "status", "reason"} <= set(data["regions"][0])
    assert data["regions"][0]["module"].startswith("model.layers.")


def test_cli_bad_model_is_a_clear_error():
    res = subprocess.run([sys.executable, "-m", "runtime.cli", "explain", "/no/such/dir"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2
    assert "neither a zoo model" in res.stderr and "hybrid zoo save" in res.stderr


def test_each_report_numbers_its_own_graphs():
    """Graph numbers in a report count from 0 however many graphs the process compiled before it."""
    model = zoo.build("llama")
    ids = prompt(model, 1, 6)
    for _ in range(2):
        report = explain(model, ids, generate_tokens=2)
        assert [g.graph for g in report.graphs] == list(range(len(report.graphs))) and len(report.graphs) >= 2
        assert "graph 0:" in report.table()
