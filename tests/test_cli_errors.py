"""Model directories that are not what their files say, and the CLI under bad input: loading refuses other models'
weights, unreadable JSON / safetensors files and directories that need their own Python code (never run unless asked),
each in one line naming the file; ``zoo save`` never overwrites by accident; every CLI error is one
``hybrid: error: ...`` line on stderr (exit 2 for bad input, 1 for a failed run), no traceback unless --debug, and
nothing on stdout."""
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import cli, zoo
from runtime.engine import Engine, SamplingParams
from runtime.zoo import LoadError

HYBRID = [sys.executable, "-m", "runtime.cli"]
#: what the CLI may print on stderr besides its error line (progress)
PROGRESS = ("loading ", "building ", "tracing ")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for name in ("llama", "mixtral"):
        zoo.save(name, root / name)
    return root


def copy(saved: Path, tmp_path: Path, name: str = "llama") -> Path:
    return Path(shutil.copytree(saved / name, tmp_path / name))


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer ("w0" .. "w249"), saved as transformers saves a fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(250)}, "[UNK]": 250}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)


def remote_code_dir(saved: Path, tmp_path: Path) -> Path:
    """A directory whose config names an unknown model type with an auto_map: loading it runs its Python files,
    which leave a marker file behind."""
    path = copy(saved, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mystery", auto_map={"AutoConfig": "custom.MysteryConfig",
                                                  "AutoModelForCausalLM": "custom.MysteryForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "custom.py").write_text(
        "from pathlib import Path\n"
        "Path(__file__).with_name('RAN').touch()\n"  # (transformers copies the module: the marker says where)
        "Path(%r).touch()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class MysteryConfig(LlamaConfig):\n    model_type = 'mystery'\n"
        "class MysteryForCausalLM(LlamaForCausalLM):\n    config_class = MysteryConfig\n" % str(path / "RAN"))
    return path


@pytest.fixture
def run_cli(capsys):
    """``hybrid ARGS`` in this process -> (exit code, stdout, stderr); the CLI's logging setup is undone after."""
    logger, engine_logger = logging.getLogger("runtime"), logging.getLogger("runtime.engine")
    saved = (logger.level, list(logger.handlers), engine_logger.level)

    def run(*args):
        capsys.readouterr()  # what the test printed before is not the CLI's
        code = cli.main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err
    yield run
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    engine_logger.setLevel(saved[2])


def error_line(err: str) -> str:
    """The one error line of a CLI run's stderr (the rest may only be progress lines)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line]
    errors = [line for line in lines if line.startswith("hybrid: error: ")]
    assert len(errors) == 1, err
    assert all(line.startswith(PROGRESS) or line in errors for line in lines), err
    return errors[0]


# -- a silently wrong model -------------------------------------------------------------------------------------
def test_another_models_weights_are_refused(saved, tmp_path, run_cli):
    path = copy(saved, tmp_path)
    shutil.copy(saved / "mixtral" / "model.safetensors", path / "model.safetensors")
    message = (r"weight files do not match its config.json: 6 of the model's weights are not in them "
               r"\(model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.gate_proj.weight, "
               r"model.layers.0.mlp.up_proj.weight, ...\); 32 weights in them belong to no parameter of the model "
               r"\(model.layers.0.block_sparse_moe.experts.0.w1.weight, .*allow_missing_weights=True "
               r"\(--allow-missing-weights\)")
    with pytest.raises(LoadError, match=message):
        zoo.load(str(path))
    with pytest.raises(LoadError, match="weight files do not match"):
        Engine.from_pretrained(str(path), device="cpu")
    code, out, err = run_cli("generate", path, "--prompt-ids", "5,6", "--compile", "none")
    assert code == 2 and not out and "6 of the model's weights are not in them" in error_line(err)
    with pytest.warns(UserWarning, match="loaded anyway"):
        zoo.load(str(path), allow_missing_weights=True)
    code, out, err = run_cli("generate", path, "--prompt-ids", "5,6", "--compile", "none", "--max-new-tokens", "2",
                             "--allow-missing-weights", "--json")
    assert code == 0 and len(json.loads(out)["outputs"][0]["token_ids"]) == 2
    assert "hybrid: warning: " in err and "loaded anyway (allow_missing_weights): those weights are random" in err


def test_weights_of_other_shapes_are_refused(saved, tmp_path):
    path = copy(saved, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(LoadError, match=r"6 have other shapes \(model.layers.0.mlp.down_proj.weight \(64, 96\) in the "
                                        r"files, \(64, 100\) in the model"):
        zoo.load(str(path))


def test_every_zoo_model_saves_and_loads_exactly(tmp_path):
    for name, entry in zoo.ZOO.items():
        if entry.realistic:
            continue
        model = zoo.load(str(zoo.save(name, tmp_path / name)))  # no missing or unexpected weights
        want = zoo.build(name).state_dict()
        assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items()), name


def _truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:len(data) // 2])


def _config(**fields):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **fields}))
    return edit


def _index_with_a_missing_shard(path):
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")


@pytest.mark.parametrize("edit, message", [
    (lambda p: (p / "model.safetensors").unlink(), r"has no weights \(none of model.safetensors, "),
    (_truncate, r"model.safetensors is not a readable safetensors file \(Error while deserializing header: incomplete "
                r"metadata, file not fully covered\): it is truncated or corrupt; copy it again"),
    (lambda p: (p / "model.safetensors").write_bytes(b"not a tensor" * 50),
     "model.safetensors is not a readable safetensors file"),
    (lambda p: (p / "config.json").write_text('{"model_type": "llama",'),
     r"config.json is not valid JSON \(Expecting property name enclosed in double quotes at line 1, column 24\)"),
    (lambda p: (p / "config.json").write_bytes(b"\xff\xfe\x00garbage"), "config.json is not a text file"),
    (lambda p: (p / "config.json").write_text("[1, 2]"), r"config.json holds a JSON list where an object"),
    (lambda p: (p / "config.json").write_text('{"hidden_size": 64}'), "config.json has no model_type"),
    (_config(model_type="mystery"), "config.json names model type 'mystery', which transformers .* does not know"),
    (_config(hidden_size=-5), "transformers cannot build the model from its files"),
    (lambda p: (p / "generation_config.json").write_text("{"), "generation_config.json is not valid JSON"),
    (_index_with_a_missing_shard, "model.safetensors.index.json lists model-00002-of-00002.safetensors, which is "
                                  "not in"),
], ids=["no-weights", "truncated", "garbage", "bad-json", "binary", "json-list", "no-model-type", "unknown-type",
        "bad-value", "bad-generation-config", "missing-shard"])
def test_bad_model_files_are_one_line_naming_the_file(saved, tmp_path, run_cli, edit, message):
    path = copy(saved, tmp_path)
    edit(path)
    with pytest.raises(LoadError, match=message):
        zoo.load(str(path))
    code, out, err = run_cli("explain", path, "--json")
    assert code == 2 and not out
    line = error_line(err)
    assert str(path) in line and ("\n" not in line)


def test_remote_code_is_refused_and_never_run(saved, tmp_path, run_cli):
    path = remote_code_dir(saved, tmp_path)
    message = (r"needs its own Python code to load model type 'mystery' \(auto_map in config.json\); hybrid never runs "
               r"a model directory's code unless asked: pass trust_remote_code=True \(--trust-remote-code\)")
    with pytest.raises(LoadError, match=message):
        zoo.load(str(path))
    code, out, err = run_cli("generate", path, "--prompt-ids", "5", "--json")
    assert code == 2 and not out and "--trust-remote-code" in error_line(err)
    assert not (path / "RAN").exists()


def test_remote_code_prompt_never_appears_on_a_terminal(saved, tmp_path):
    """transformers asks "run the custom code? [y/N]" when trust_remote_code is left unset and stdin is a terminal;
    the CLI always sets it: with a terminal on stdin it still refuses in one line and --json prints nothing."""
    path = remote_code_dir(saved, tmp_path)
    leader, follower = os.openpty()
    try:
        res = subprocess.run(HYBRID + ["explain", str(path), "--json"], stdin=follower, capture_output=True, text=True,
                             timeout=120)
    finally:
        os.close(leader)
        os.close(follower)
    assert res.returncode == 2 and res.stdout == "" and "[y/N]" not in res.stderr
    assert "needs its own Python code" in error_line(res.stderr) and not (path / "RAN").exists()


def test_trust_remote_code_opts_in(saved, tmp_path):
    path = remote_code_dir(saved, tmp_path)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    code = (f"from runtime import zoo; m = zoo.load({str(path)!r}, trust_remote_code=True); "
            "print(type(m).__name__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "MysteryForCausalLM" and (path / "RAN").exists()


def test_tokenizer_files(saved, tmp_path):
    """A directory's tokenizer loads (text prompts work); its bad files and remote code are one line each."""
    path = copy(saved, tmp_path)
    write_tokenizer(path)
    engine = Engine.from_pretrained(str(path), device="cpu", compile=None)
    out = engine.generate("w5 w6 w7", SamplingParams(max_tokens=3))[0]
    assert out.prompt_token_ids == [5, 6, 7] and out.text is not None
    good = (path / "tokenizer.json").read_text()
    (path / "tokenizer.json").write_text(good[:40])
    with pytest.raises(LoadError, match=r"tokenizer.json is not valid JSON \("):
        zoo.load_tokenizer(str(path))
    (path / "tokenizer.json").write_text(good)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MysteryTokenizer", auto_map={"AutoTokenizer": ["tok.MysteryTokenizer", None]})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "tok.py").write_text(f"from pathlib import Path\nPath({str(path / 'RAN')!r}).touch()\n")
    with pytest.raises(LoadError, match=r"needs its own Python code to load its tokenizer \(MysteryTokenizer\) "
                                        r"\(auto_map in tokenizer_config.json\)"):
        Engine.from_pretrained(str(path), device="cpu", compile=None)
    assert not (path / "RAN").exists()


# -- zoo save -----------------------------------------------------------------------------------------------------
def test_zoo_save_never_overwrites_by_accident(tmp_path, run_cli):
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    (full / "model-00001-of-00002.safetensors").write_text("stale")
    code, out, err = run_cli("zoo", "save", "llama", full)
    assert code == 2 and not out and f"{full} is not empty (2 entries: model-00001-of-00002.safetensors, notes.txt)" \
        in error_line(err) and "--force" in err
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, out, err = run_cli("zoo", "save", "llama", afile)
    assert code == 2 and not out and f"{afile} is a file" in error_line(err) and afile.read_text() == "x"
    code, out, err = run_cli("zoo", "save", "nosuch", tmp_path / "new")
    assert code == 2 and "unknown zoo model 'nosuch'" in error_line(err) and not (tmp_path / "new").exists()
    for target in (full, afile):  # --force: the model is written, the stale shard gone, other files kept
        code, out, err = run_cli("zoo", "save", "llama", target, "--force")
        assert code == 0 and out.startswith(f"wrote {target}")
        assert zoo.load(str(target)).config.model_type == "llama"
    assert (full / "notes.txt").read_text() == "mine" and not (full / "model-00001-of-00002.safetensors").exists()
    code, out, err = run_cli("zoo", "save", "llama", tmp_path / "fresh" / "deeper")
    assert code == 0 and (tmp_path / "fresh" / "deeper" / "model.safetensors").is_file()
    fresh = tmp_path / "fresh" / "deeper"  # the weights are as readable as the config (the umask decides)
    assert (fresh / "model.safetensors").stat().st_mode & 0o777 == (fresh / "config.json").stat().st_mode & 0o777


# -- the CLI's errors ------------------------------------------------------------------------------------------------
def test_text_prompts_need_tokenizer_files(tmp_path, run_cli):
    """A zoo model and the directory zoo save writes have a character tokenizer; without its files, text is refused."""
    code, out, err = run_cli("zoo", "save", "llama", tmp_path / "m")
    assert code == 0
    for args in (["llama"], [tmp_path / "m"]):
        code, out, err = run_cli("generate", *args, "--compile", "none", "--prompt", "hello", "--max-new-tokens", "3")
        assert code == 0 and out.startswith("[0] "), err
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "m" / f).unlink()
    code, out, err = run_cli("generate", tmp_path / "m", "--compile", "none", "--prompt", "hello")
    assert code == 2 and not out and "prompt: this model has no tokenizer" in error_line(err)


def test_outputs_follow_the_order_of_the_prompts_and_hold_no_special_tokens(run_cli):
    """--prompt-ids and --prompt mixed: outputs in the order given; text without EOS (as the server streams it)."""
    import json
    code, out, err = run_cli("generate", "llama", "--compile", "none", "--prompt-ids", "5,6,7", "--prompt", "hi",
                             "--prompt-ids", "9", "--prompt-ids", "5,6", "--max-new-tokens", "12", "--json")
    assert code == 0, err
    outputs = json.loads(out)["outputs"]
    assert [o["prompt_token_ids"] for o in outputs][0::2] == [[5, 6, 7], [9]]
    assert outputs[1]["prompt_token_ids"] not in ([5, 6, 7], [9]) and outputs[3]["prompt_token_ids"] == [5, 6]
    assert outputs[3]["finish_reason"] == "stop"  # it ends at EOS (zoo llama's greedy tokens), whose text is not shown
    assert all("</s>" not in o["text"] and "<s>" not in o["text"] for o in outputs)


def test_no_packed_steps_gives_the_same_tokens(run_cli, monkeypatch):
    """--no-packed-steps prefills in padded steps; the tokens are the packed steps' (greedy)."""
    import json

    from runtime.engine import Engine
    built, real = [], Engine.from_pretrained.__func__

    def spy(cls, *a, **kw):
        built.append(real(cls, *a, **kw))
        return built[-1]
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(spy))
    args = ["generate", "llama", "--compile", "none", "--prompt-ids", "5,6,7", "--prompt-ids", "9,10,11,12,13",
            "--max-new-tokens", "6", "--json"]
    runs = [run_cli(*args), run_cli(*args, "--no-packed-steps")]
    assert all(code == 0 for code, _, _ in runs), runs
    assert [e.scheduler.packed for e in built] == [True, False] and built[1].packed_note == "packed_steps=False"
    packed, padded = ([o["token_ids"] for o in json.loads(out)["outputs"]] for _, out, _ in runs)
    assert packed == padded and all(len(t) == 6 for t in packed)


@pytest.mark.parametrize("args, message", [
    (["demo", "--tokens", "0"], "argument --tokens: must be an integer >= 1, got 0"),
    (["demo", "--new-tokens", "x"], "argument --new-tokens: must be an integer >= 1, got 'x'"),
    (["explain", "llama", "--batch", "0"], "argument --batch: must be an integer >= 1, got 0"),
    (["explain", "llama", "--generate", "-1"], "argument --generate: must be an integer >= 0"),
    (["explain", "llama", "--tokens", "250", "--generate", "10"],
     r"--tokens \+ --generate \(250 \+ 10 tokens\) exceed the model's maximum length of 256 tokens"),
    (["explain", "llama", "--device", "floppy"], "argument --device: device 'floppy' is not a device name torch knows"),
    (["generate", "llama", "--prompt-ids", "5", "--max-new-tokens", "0"],
     "argument --max-new-tokens: SamplingParams: max_tokens must be >= 1, got 0"),
    (["generate", "llama", "--prompt-ids", "5", "--temperature", "nan"],
     "argument --temperature: SamplingParams: temperature must be a finite number >= 0.0, got nan"),
    (["generate", "llama", "--prompt-ids", "5", "--top-p", "2"], r"argument --top-p: SamplingParams: top_p must be"),
    (["generate", "llama", "--prompt-ids", "5", "--top-k", "1.5"], "argument --top-k: must be an integer, got '1.5'"),
    (["generate", "llama", "--prompt-ids", "5", "--seed", "-3"], r"argument --seed: SamplingParams: seed must be in"),
    (["generate", "llama", "--prompt-ids", "5", "--cache-mb", "0"], "argument --cache-mb: must be an integer >= 1"),
    (["generate", "llama", "--prompt-ids", "5,x"], "argument --prompt-ids: takes comma-separated integers"),
    (["generate", "llama", "--prompt-ids", "5,,7"], "argument --prompt-ids: takes comma-separated integers"),
    (["generate", "llama", "--compile", "none", "--prompt-ids", "-1,5"],
     r"prompt: token ids \[-1\] are outside the vocabulary \[0, 256\)"),
    (["generate", "llama", "--compile", "none", "--prompt-ids", "5", "--cache-mb", "100000000"],
     r"cache_memory of 100000000 MB is more than the \d+ MB free on cpu: lower it \(hybrid: --cache-mb\)"),
    (["generate", "llama", "--compile", "hybrid-cudagraphs", "--prompt-ids", "5", "--device", "cpu"],
     "compile='hybrid-cudagraphs' records CUDA graphs and needs the model on a CUDA device"),
    (["generate", "llama", "--compile", "none"], "give at least one --prompt or --prompt-ids"),
    (["generate", "llama", "--compile", "none", "--prompt-ids", "5,300"],
     r"prompt: token ids \[300\] are outside the vocabulary \[0, 256\)"),
    (["generate", "llama", "--compile", "none", "--prompt-ids", "5", "--max-new-tokens", "300"],
     "exceeds the model's maximum length of 256 tokens"),
    (["generate", "/no/such/model", "--prompt-ids", "5"], "is neither a zoo model"),
    (["generate", "llama", "--prompt-ids", "5", "--bogus"], "unrecognized arguments: --bogus"),
    (["zoo"], "the following arguments are required: zoo_cmd"),
])
def test_cli_bad_input_is_one_line(run_cli, args, message):
    import re
    code, out, err = run_cli(*args)
    assert code == 2 and not out
    assert re.search(message, error_line(err)), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_cli_cuda_on_a_cpu_only_torch(run_cli):
    code, out, err = run_cli("generate", "llama", "--prompt-ids", "5", "--device", "cuda")
    assert code == 2 and not out
    assert "argument --device: device 'cuda': this torch has no usable CUDA" in error_line(err)
    with pytest.raises(ValueError, match="this torch has no usable CUDA"):
        Engine.from_pretrained("llama", device="cuda")


def test_cli_failed_requests_print_no_partial_result(run_cli, monkeypatch):
    """A step that raises fails its requests: the CLI says which and why in one line, exits 1, prints no output."""
    from runtime.engine.model_runner import ModelRunner
    real = ModelRunner.finish

    def finish(self, pending):
        if any(s.prompt == [9, 9] for s in pending.step.seqs):
            raise RuntimeError("device fell over")
        return real(self, pending)
    monkeypatch.setattr(ModelRunner, "finish", finish)
    code, out, err = run_cli("generate", "llama", "--compile", "none", "--prompt-ids", "5,6", "--prompt-ids", "9,9",
                             "--json")
    assert code == 1 and not out
    assert error_line(err) == "hybrid: error: request 1 failed: RuntimeError: device fell over"


def test_cli_unexpected_failures_and_debug(run_cli, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("boom")
    monkeypatch.setattr(zoo, "load", broken)
    code, out, err = run_cli("explain", "llama")
    assert code == 1 and not out
    assert error_line(err) == ("hybrid: error: TypeError: boom (a failure of the run: --debug or HYBRID_DEBUG=1 shows "
                               "the traceback)")
    code, out, err = run_cli("explain", "llama", "--debug")
    assert code == 1 and "Traceback" in err and "TypeError: boom" in err
    monkeypatch.setattr(zoo, "load", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    code, out, err = run_cli("explain", "llama")
    assert code == 130 and err.strip().endswith("hybrid: interrupted")


def test_cli_debug_shows_the_traceback(saved, tmp_path, run_cli, monkeypatch):
    path = copy(saved, tmp_path)
    _truncate(path)
    code, out, err = run_cli("explain", path)
    assert code == 2 and "truncated or corrupt" in error_line(err)
    monkeypatch.setenv("HYBRID_DEBUG", "1")
    code, out, err = run_cli("explain", path)
    assert code == 2 and "Traceback" in err and "LoadError" in err and not out


def test_disable_takes_only_pass_names(run_cli):
    """``--disable`` is checked when the flags are parsed, before any model loads, against the pipeline's names."""
    import passes
    assert list(cli.PASSES) == passes.PASS_NAMES
    code, out, err = run_cli("explain", "llama", "--disable", "bogus")
    assert code == 2 and out == "" and err.count("\n") == 1 and "invalid choice: 'bogus'" in err and "glu" in err


def test_flags_that_would_do_nothing_are_refused(run_cli):
    """A flag that only sizes what another flag does is refused without it, in one line naming the missing flag."""
    code, out, err = run_cli("generate", "llama", "--prompt-ids", "5,6", "--redundant-experts", "2")
    assert code == 2 and not out and "add --save-expert-placement" in err, err
    code, out, err = run_cli("generate", "mixtral", "--prompt-ids", "5,6", "--expert-parallel")
    assert code == 2 and not out and "add --tensor-parallel N" in err and "building" not in err, err


def test_an_engine_directory_given_to_export_or_explain_is_named_as_one(tmp_path, run_cli):
    """export and explain take a model: an engine directory is named as what it is (not as one missing a manifest)."""
    engine = tmp_path / "eng"
    assert run_cli("export", "llama", engine, "--device", "cpu", "--max-batch", "2", "--max-seq-len", "32",
                   "--aot", "none")[0] == 0
    for command in (["export", engine, tmp_path / "again"], ["explain", engine]):
        code, out, err = run_cli(*command)
        assert code == 2 and "is an engine directory: `hybrid generate` and `hybrid serve` run it" in err, err
