"""Engine files (runtime/aot, runtime/engine/exported.py): export, load without compiling, the same tokens; the
refusals of a directory that does not fit."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from runtime import zoo
from runtime.aot import export_engine
from runtime.cli import main
from runtime.engine import Engine, SamplingParams
from runtime.engine.exported import SEAL, EngineFileError, seal

PROMPTS = [[5, 6, 7, 8, 9], [3] * 21, [11]]
#: one family per layer kind: attention, MLA + MoE, SSM (Mamba1); every tiny zoo family was checked by hand
#: (docs/engine-files.md), the SSD and hybrid ones take minutes to export on a CI CPU
FAMILIES = ["llama", "deepseek_v3", "mamba"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    dirs = {}

    def get(name):
        if name not in dirs:
            dirs[name] = tmp_path_factory.mktemp("engines") / name
            export_engine(name, dirs[name], progress=lambda msg: None)
        return dirs[name]
    return get


def hf_greedy(name: str, prompt: list[int], n: int) -> list[int]:
    model = zoo.load(name)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_directory_generates_hf_tokens_without_compiling(exported, name):
    from torch._dynamo.utils import counters
    path = exported(name)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 2 and manifest["manifest_sha256"] == seal(manifest) and manifest["device"]["kind"] == "cpu" and manifest["programs"]
    assert set(manifest["files"]) >= {"weights.safetensors", "config.json", "programs/0.pt2"}
    frames = counters["frames"]["total"]
    engine = Engine.from_pretrained(str(path))  # an engine directory is recognised
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert counters["frames"]["total"] == frames, "dynamo traced something while loading or generating"
    assert [o.finish_reason for o in outs] == ["length"] * 3, [o.error for o in outs]
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(name, prompt, 10)


def test_ssd_directory_takes_every_prompt_length(tmp_path, caplog):
    """HF's Mamba2 scan branches on whole chunks or a padded one, and on one chunk or several, where no size range
    says so: the export drives every prompt length so each branch gets its program, and a loaded directory tries the
    programs whose ranges fit until one's guards pass. Every length within the limits gives the model's tokens."""
    path = export_engine("mamba2", tmp_path / "m2", max_seq_len=24, progress=lambda msg: None)
    engine = Engine.from_pretrained(str(path))
    assert engine.scheduler.max_prefill_seqs > 1 and "equal length" in engine.prefill_batch_note
    sizes, launch = [], engine.runner.launch
    engine.runner.launch = lambda step, ahead=None: (sizes.append(len(step.seqs)) if step.kind != "decode" else None,
                                                     launch(step, ahead))[1]
    # every length twice: prompts of one length (and first chunks of 12) prefill together, unpadded
    prompts = [[(k * i + n) % 200 + 3 for i in range(n)] for n in range(1, 21) for k in (7, 11)]
    with caplog.at_level(logging.WARNING, logger="runtime.engine"):
        outs = engine.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert [o.error for o in outs] == [None] * len(prompts)
    assert max(sizes) >= 2 and not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()], sizes
    # whole chunks and padded ones, one chunk and several (tiny mamba2: chunks of 8): the model directory's tokens
    want = Engine(zoo.load("mamba2"), compile=None).generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_streaming_sampling_and_batching_from_an_engine_directory(exported):
    engine = Engine.from_engine(exported("llama"), max_num_seqs=2)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    events = [e for e in engine.stream(PROMPTS, params) if e.token_id is not None]
    assert len(events) == 18
    again = Engine.from_engine(exported("llama"), max_num_seqs=2).generate(PROMPTS, params)
    by_request = {}
    for e in events:
        by_request.setdefault(e.request_id, []).append(e.token_id)
    assert sorted(map(tuple, by_request.values())) == sorted(tuple(o.token_ids) for o in again)


def test_engine_directory_prefills_several_prompts_a_step(exported):
    """A model without state layers is exported with programs for padded prefills of several prompts: prompts arriving
    together share prefill steps from the directory as from the model directory, with HF's tokens. A model with state
    layers batches prompts of one length only (unpadded rows), and says so."""
    engine = Engine.from_engine(exported("llama"))
    assert engine.prefill_batch_note is None and engine.scheduler.max_prefill_seqs > 1
    sizes, launch = [], engine.runner.launch
    engine.runner.launch = lambda step, ahead=None: (sizes.append(len(step.seqs)) if step.kind != "decode" else None,
                                                     launch(step, ahead))[1]
    prompts = PROMPTS + [[4] * 9, list(range(30, 42))]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert max(sizes) >= 2, sizes
    assert [o.token_ids for o in outs] == [hf_greedy("llama", p, 5) for p in prompts]
    mamba = Engine.from_engine(exported("mamba"))
    assert mamba.scheduler.equal_lengths and "equal length" in mamba.prefill_batch_note


def test_a_directory_reads_only_the_programs_its_calls_reach(exported):
    """Programs are read at their first call: loading reads none, a short request only those of its calls."""
    engine = Engine.from_engine(exported("llama"))
    programs = [p for ps in engine.model._programs.values() for _, p in ps]
    assert programs and all(p.loaded is None for p in programs)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert out[0].token_ids == hf_greedy("llama", [5, 6, 7], 3)
    read = [p.spec.key for p in programs if p.loaded is not None]
    assert 0 < len(read) < len(programs), read


def test_load_in_a_process_that_cannot_import_the_modeling_code(exported):
    path = exported("llama")
    script = textwrap.dedent(f"""
        import importlib.abc, json, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.startswith("transformers.models.llama.modeling"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        from runtime.engine import Engine, SamplingParams
        engine = Engine.from_pretrained({str(path)!r})
        out = engine.generate({PROMPTS!r}, SamplingParams(max_tokens=6, ignore_eos=True))
        assert not any(m.startswith("transformers.models.llama.modeling") for m in sys.modules)
        print(json.dumps([o.token_ids for o in out]))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    tokens = json.loads(p.stdout.strip().splitlines()[-1])
    assert tokens == [hf_greedy("llama", prompt, 6) for prompt in PROMPTS]


def test_cli_export_and_generate(tmp_path, capsys):
    """A delta-rule + attention + MoE hybrid through the CLI, exported for 4 sequences of 64 tokens: `generate`
    takes the directory's batch limit as its default, and a 40-token prompt goes in two chunks, the second
    continuing from the state rows (a program whose conv state is concatenated before the chunk)."""
    out = tmp_path / "eng"
    assert main(["export", "qwen3_next", str(out), "--max-batch", "4", "--max-seq-len", "64"]) == 0
    err = capsys.readouterr().err
    assert "exporting graph 1" in err and "wrote" in err
    manifest = json.loads((out / "manifest.json").read_text())
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir() if f.is_file()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as every other file
    assert manifest["engine"]["prefill_note"] is None and manifest["engine"]["max_prefill_tokens"] < 40
    prompt = list(range(5, 45))
    assert main(["generate", str(out), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "5",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]
    assert got == hf_greedy("qwen3_next", prompt, 5)
    assert main(["export", "qwen3_next", str(out)]) == 2  # not empty: refused
    assert "not an empty directory" in capsys.readouterr().err


def _broken(exported, tmp_path, change):
    path = tmp_path / "eng"
    shutil.copytree(exported("llama"), path)
    change(path)
    return path


def _edit_manifest(fn, reseal=True):
    def change(path):
        m = json.loads((path / "manifest.json").read_text())
        fn(m)
        if reseal:  # as an exporter would have written it: the load's checks past the seal are what is tested
            m[SEAL] = seal(m)
        (path / "manifest.json").write_text(json.dumps(m))
    return change


def _flip_byte(path):
    data = bytearray((path / "weights.safetensors").read_bytes())
    data[-1] ^= 1
    (path / "weights.safetensors").write_bytes(bytes(data))


@pytest.mark.parametrize("change, message", [
    (_flip_byte, "weights.safetensors fails its checksum"),
    (lambda p: (p / "programs" / "0.pt2").unlink(), "0.pt2 is missing"),
    (_edit_manifest(lambda m: m.update(format=99)), "format 99; this hybrid reads format 2"),
    (_edit_manifest(lambda m: m["versions"].update(torch="2.0.0")), "exported with torch 2.0.0"),
    (_edit_manifest(lambda m: m["device"].update(kind="cuda", capability="9.0")), "is a cuda engine"),
    (lambda p: (p / "manifest.json").write_text("{"), "is not a readable manifest"),
    (_edit_manifest(lambda m: m["engine"].update(block_size=32), reseal=False),
     "manifest.json was changed after export (its manifest_sha256 does not match its content)"),
    (_edit_manifest(lambda m: m["files"].pop("weights.safetensors")), "lists no checksum for weights.safetensors"),
    (_edit_manifest(lambda m: m["files"].update({"../x": "0"})), "lists ../x, outside the engine directory"),
    (_edit_manifest(lambda m: m["engine"].update(max_batch="lots")), "malformed engine entry 'max_batch' ('lots')"),
    (_edit_manifest(lambda m: m.update(dtype="torch.bogus")), "malformed dtype ('torch.bogus')"),
    (_edit_manifest(lambda m: m["engine"]["specs"].pop()), "malformed program"),
    (_edit_manifest(lambda m: m["programs"][0]["inputs"].append(["step", "nope"])),
     "malformed program programs/0.pt2 (input step 'nope'"),
    (_edit_manifest(lambda m: m["programs"][0]["inputs"].append(["weight", "nope"])),
     "programs/0.pt2 reads the weight 'nope', which weights.safetensors does not hold"),
], ids=["checksum", "missing", "format", "torch", "device", "manifest", "edited", "unlisted", "outside", "plan", "dtype",
        "layers", "step-input", "weight-input"])
def test_a_directory_that_does_not_fit_is_one_line(exported, tmp_path, capsys, change, message):
    path = _broken(exported, tmp_path, change)
    with pytest.raises(EngineFileError, match=re.escape(message)):
        Engine.from_engine(path)
    if "cuda" in message:  # asked for the CPU by name
        with pytest.raises(EngineFileError, match="is a cuda engine, asked to run on cpu"):
            Engine.from_engine(path, device="cpu")
    assert main(["generate", str(path), "--prompt-ids", "5,6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hybrid: error: ") and message in err[-1] and "Traceback" not in "\n".join(err)


def test_requests_beyond_the_exported_limits(exported, tmp_path):
    def limits(m):  # as `hybrid export --max-batch 2 --max-seq-len 64` writes them (the programs take any size)
        m["engine"].update(max_batch=2, max_seq_len=64)
    path = _broken(exported, tmp_path, _edit_manifest(limits))
    with pytest.raises(ValueError, match="beyond the engine directory's --max-batch 2"):
        Engine.from_engine(path, max_num_seqs=4)
    engine = Engine.from_engine(path, max_num_seqs=2)
    with pytest.raises(ValueError, match="maximum length of 64 tokens .the engine directory's --max-seq-len 64: export "
                                         "again with a larger --max-seq-len"):
        engine.generate([[5] * 60], SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="exported with 16"):
        Engine.from_engine(path, block_size=32)
    with pytest.raises(EngineFileError, match="exported in float32"):
        Engine.from_pretrained(str(path), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compiled already"):
        Engine.from_engine(path, compile="hybrid")


def test_hidden_files_pass_and_other_unlisted_files_are_refused(exported, tmp_path):
    """Files under hidden folders (what a download tool's ``--local-dir`` leaves in .cache/) and hidden files are
    not the engine's: the directory loads with them. A visible file the manifest does not list is refused in one
    line that says what to do."""
    def hidden(p):
        (p / ".cache" / "huggingface").mkdir(parents=True)
        (p / ".cache" / "huggingface" / "x.lock").write_text("")
        (p / ".DS_Store").write_text("")
    path = _broken(exported, tmp_path, hidden)
    assert Engine.from_engine(path).generate([[5, 6]], SamplingParams(max_tokens=2))[0].token_ids
    (path / "notes.txt").write_text("mine")
    with pytest.raises(EngineFileError, match="lists no checksum for notes.txt: .* remove those files or export"):
        Engine.from_engine(path)


def test_export_checks_its_limits_and_directory_before_loading(tmp_path, capsys):
    """A sequence limit under what an engine directory can hold and a directory that cannot be written are refused
    in one line before the model is loaded."""
    assert main(["export", "llama", str(tmp_path / "short"), "--max-seq-len", "4"]) == 2
    assert "at least 16 tokens a sequence (--max-seq-len 16 or more)" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["export", "llama", str(tmp_path / "file" / "eng")]) == 2
    err = capsys.readouterr().err
    assert "cannot write the engine directory" in err and "loading" not in err
    assert not (tmp_path / "short").exists()


def test_aot_inductor_packages_load_in_a_fresh_process(tmp_path):
    """``aot="inductor"``: every program also compiled by AOTInductor (linked against libstdc++ dynamically, checked
    against its exported program at export); a fresh process runs the packages, traces nothing and compiles nothing,
    and generates HF's greedy tokens; HYBRID_ENGINE_ROUTE=exported runs the exported programs of the same
    directory, with the same tokens."""
    import zipfile

    from runtime.aot.package import needed_libraries
    path = tmp_path / "llama"
    export_engine("llama", path, aot="inductor", progress=lambda msg: None)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["aot"]["route"] == "inductor" and all(p["package"] for p in manifest["programs"])
    with zipfile.ZipFile(path / manifest["programs"][0]["package"]) as z:
        so = next(n for n in z.namelist() if n.endswith(".so"))
        assert any(lib.startswith("libstdc++") for lib in needed_libraries(z.extract(so, tmp_path)))
    script = textwrap.dedent(f"""
        import json, os, sys
        from torch._dynamo.utils import counters
        from runtime.engine import Engine, SamplingParams
        engine = Engine.from_pretrained({str(path)!r})
        out = engine.generate({PROMPTS!r}, SamplingParams(max_tokens=6, ignore_eos=True))
        kinds = sorted({{type(p.loaded).__name__ for ps in engine.model._programs.values() for _, p in ps
                         if p.loaded is not None}})
        print(json.dumps([kinds, counters["frames"]["total"], counters["inductor"].get("fxgraph_cache_miss", 0),
                          [o.token_ids for o in out]]))
    """)
    want = [hf_greedy("llama", prompt, 6) for prompt in PROMPTS]
    for route, kind in (("packaged", "AOTICompiledModel"), ("exported", "GraphModule")):
        env = dict(os.environ, HYBRID_ENGINE_ROUTE=route)
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        kinds, frames, misses, tokens = json.loads(p.stdout.strip().splitlines()[-1])
        assert kinds == [kind] and frames == 0 and misses == 0 and tokens == want, (route, kinds, frames, misses)


def test_a_compiler_that_links_libstdcxx_statically_is_refused(tmp_path, monkeypatch):
    from runtime.aot.package import PackageError, choose_compiler
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    cxx = tmp_path / "static-g++"
    cxx.write_text('#!/bin/sh\nexec g++ -static-libstdc++ "$@"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    with pytest.raises(PackageError, match="does not build shared objects that link libstdc.. dynamically"):
        choose_compiler()
    monkeypatch.setenv("CXX", shutil.which("g++"))
    assert choose_compiler() == shutil.which("g++")


def test_programs_that_branch_by_guards_run_exported_not_packaged():
    """Two programs of one kind whose size ranges overlap (HF's SSD scan on whole chunks or a padded one) are told
    apart only by the exported programs' guards, which an AOTInductor package does not keep (a package of one branch
    would run the other branch's prompts through its own): those run as exported programs; programs of disjoint ranges or of a
    kind of their own keep their packages."""
    from runtime.engine.exported import ProgramSpec, branches

    def spec(key, q):
        return ProgramSpec(key, "", [], 0, {}, {"ids": [[1, 1], q]}, package="p")
    whole, padded = spec("prefill/b1/qN/fresh", [9, None]), spec("prefill/b1/qN/fresh", [9, None])
    short, step = spec("prefill/b1/qN/fresh", [2, 8]), spec("step/b1/q1/fresh", [1, 1])
    specs = [whole, padded, short, step]
    assert branches(whole, specs) and branches(padded, specs)
    assert not branches(short, specs) and not branches(step, specs)
    assert branches(short, specs + [spec("prefill/b1/qN/fresh", [2, 8])])


def test_infinite_bounds_become_finite_in_packages():
    """AOTInductor writes a custom op's float arguments as JSON numbers: the MoE experts' limit of inf (no clamp)
    goes into the package as float32's largest value, which clamps no finite value either."""
    import math

    from hybrid_kernels.moe import ops  # noqa: F401
    from runtime.aot.package import FLOAT_MAX, finite_bounds

    def f(x, w13, w2, weights, ids):
        return torch.ops.hybrid.moe_experts(x, w13, w2, None, None, weights, ids, True, False, "swiglu_clamp", False,
                                            1.702, float("inf"))
    args = (torch.randn(3, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 6), torch.rand(3, 2),
            torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32))
    ep = torch.export.export(_Wrap(f), args)
    fixed = finite_bounds(ep)
    limits = [n.args[-1] for n in fixed.graph.nodes if "moe_experts" in str(n.target)]
    assert limits == [FLOAT_MAX] and any(math.isinf(n.args[-1]) for n in ep.graph.nodes
                                         if "moe_experts" in str(n.target))
    torch.testing.assert_close(fixed.module()(*args), ep.module()(*args))


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)
