"""Engine directories, the reading side: ``load_model`` checks one (``check_manifest``) and returns its
``ExportedModel``, what the engine runs in place of the HF model. runtime/aot writes them (``hybrid export``).

An engine directory holds:
  - ``manifest.json``: format version; the sha256 of its own content (``SEAL``: an edited manifest is refused); hybrid, torch, triton and transformers versions; device kind and compute
    capability; dtype; the engine's plan (cache layers, block size, paged decode, limits); the programs with their
    input bindings; sha256 of every other file;
  - ``config.json`` / ``generation_config.json`` and the tokenizer files, as the model directory had them;
  - ``weights.safetensors`` (the tensors the graphs read, by the model's parameter names) and
    ``consts.safetensors`` (other tensors the graphs read: scalars the model keeps);
  - ``programs/N.pt2``: one ``torch.export`` program per kind of model call (``variant_key``) and size range, and
    ``programs/N.aoti.pt2`` (exported with ``--aot inductor``): the same program compiled by
    AOTInductor, which runs in its place (fused) where it loads;
  - ``triton/`` (GPU engines): the Triton cache of the kernels the export ran, used at load (no JIT compile of them).
It is tied to the torch and triton versions and the device kind (and GPU architecture) it was exported with:
anything else is refused in one line (``EngineFileError``).

``ExportedModel.forward`` has the HF signature the engine calls: each call's tensors (``step_tensors``) pick the
program of its variant and are passed to it with the weights; the SSM states a fresh prefill makes are left on the
cache as HF's code leaves them. No dynamo, no Inductor compile, no modeling code: the programs are ATen graphs with
hybrid's ops, or their AOTInductor packages (compiled at export).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import warnings
from pathlib import Path

import torch

#: format 2: the manifest carries the sha256 of its own content (``SEAL``)
FORMAT = 2
MANIFEST = "manifest.json"
#: the manifest's entry holding the sha256 of the rest of it: a manifest edited after export is refused at load
SEAL = "manifest_sha256"
#: the Triton kernels compiled at export (a GPU engine): the cache Triton reads at load, unless TRITON_CACHE_DIR is set
TRITON_CACHE = "triton"
_STATE = re.compile(r"^(conv|ssm)\.(\d+)$")
#: the names ``step_tensors`` gives
_STEP_INPUT = re.compile(r"^(ids|positions|mask(\.\w+)?|hybrid_block_table|hybrid_seq_lens|write_slots|gather_idx|"
                         r"block_table|seq_lens|(buf|conv|ssm)\.\d+)$")


class EngineFileError(ValueError):
    """An engine directory that cannot be loaded here as it is: the message names the file or field and what to do."""


def step_tensors(input_ids: torch.Tensor, cache, kwargs: dict) -> dict[str, torch.Tensor]:
    """The named tensors of one model call by the engine: its step inputs, the step maps bound on ``cache``, the
    attention buffers and the SSM states bound for the call (absent on a first prefill chunk: HF makes them)."""
    out = {"ids": input_ids, "positions": kwargs["position_ids"]}
    mask = kwargs.get("attention_mask")
    if isinstance(mask, dict):
        out.update({f"mask.{k}": v for k, v in sorted(mask.items()) if v is not None})
    elif mask is not None:
        out["mask"] = mask
    for name in ("hybrid_block_table", "hybrid_seq_lens"):
        if kwargs.get(name) is not None:
            out[name] = kwargs[name]
    if cache.attention:
        first = cache.attention[0]
        for name in ("write_slots", "gather_idx", "block_table", "seq_lens"):
            if getattr(first, name) is not None:
                out[name] = getattr(first, name)
        out.update({f"buf.{i}": layer.buf for i, layer in enumerate(cache.attention)})
    for j, layer in enumerate(cache.states):
        for kind, state in (("conv", layer.conv_states[0]), ("ssm", layer.recurrent_states[0])):
            if state is not None:
                out[f"{kind}.{j}"] = state
    return out


def variant_key(named: dict[str, torch.Tensor], paged: bool) -> str:
    """Which exported program runs a call: the tensors it has and the sizes dynamo specialises (a batch or a query
    length of one)."""
    b, q = named["ids"].shape
    states = sorted({m.group(1) for m in map(_STATE.match, named) if m})
    parts = ["decode" if paged else ("step" if q == 1 else "prefill"), f"b{'1' if b == 1 else 'N'}",
             f"q{'1' if q == 1 else 'N'}", "states:" + "+".join(states) if states else "fresh"]
    parts += sorted(k for k in named if k in ("hybrid_block_table", "block_table", "write_slots"))
    return "/".join(parts)


@dataclasses.dataclass
class ProgramSpec:
    """How an exported program is called: ``inputs`` in order, each ("step", name) | ("weight", name) |
    ("const", name); ``logits`` the output index of the logits; ``states`` {"conv.j": output index} for the SSM
    states the call leaves on the cache (a fresh prefill's new states); ``dims`` {step tensor: [[lo, hi] per dim]},
    the sizes the program takes (hi None: unbounded), as torch.export found them (a branch of the model on a size,
    e.g. a prompt shorter than an SSD chunk, bounds it: another program of the same key takes the other side)."""
    key: str
    file: str
    inputs: list[tuple[str, str]]
    logits: int
    states: dict[str, int]
    dims: dict[str, list[list[int | None]]] = dataclasses.field(default_factory=dict)
    package: str | None = None  # the program compiled by AOTInductor (the route that runs it fused), if built

    def fits(self, named: dict[str, torch.Tensor]) -> bool:
        for name, dims in self.dims.items():
            shape = named[name].shape
            if len(shape) != len(dims):
                return False
            for n, (lo, hi) in zip(shape, dims):
                if (lo is not None and n < lo) or (hi is not None and n > hi):
                    return False
        return True

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ProgramSpec":
        return cls(d["key"], d["file"], [tuple(x) for x in d["inputs"]], d["logits"], dict(d["states"]),
                   {k: [list(x) for x in v] for k, v in d.get("dims", {}).items()}, d.get("package"))


class MissingProgram(RuntimeError):
    """A model call of a variant the engine directory has no program for."""


def find_programs(programs: dict[str, list], named: dict[str, torch.Tensor], paged: bool) -> list:
    """The (spec, program)s of ``programs`` {key: [(spec, program), ...]} whose sizes take this call. Where the model
    branches on sizes in ways no range says (a prompt that fills whole SSD chunks or not, one chunk or several),
    several fit and a program's own guards decide (``_is_guard_failure``)."""
    return [entry for entry in programs.get(variant_key(named, paged), ()) if entry[0].fits(named)]


def _is_guard_failure(e: BaseException) -> bool:
    """An exported program's check of its inputs' sizes, raised before it computes anything."""
    return isinstance(e, (AssertionError, RuntimeError)) and ("Guard failed" in str(e)
                                                               or "Runtime assertion failed" in str(e))


def describe_call(named: dict[str, torch.Tensor]) -> str:
    b, q = named["ids"].shape
    keys = named["gather_idx"].shape[1] if "gather_idx" in named else None
    return f"{b} sequence(s) x {q} token(s)" + (f" over {keys} cached keys" if keys is not None else "")


class ExportedModel(torch.nn.Module):
    def __init__(self, config, generation_config, plan: dict, programs: dict[str, list],
                 weights: dict[str, torch.Tensor], consts: dict[str, torch.Tensor]):
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.engine_plan = plan  # what the engine found about the model at export (the manifest's "engine")
        self._weights = torch.nn.ParameterList(torch.nn.Parameter(w, requires_grad=False) for w in weights.values())
        self._by_name = dict(zip(weights, self._weights))
        self._consts = consts
        self._programs = programs

    def forward(self, input_ids: torch.Tensor, past_key_values=None, position_ids=None, attention_mask=None,
                use_cache: bool = True, logits_to_keep: int = 1, **extra):
        cache = past_key_values
        kwargs = dict(extra, position_ids=position_ids, attention_mask=attention_mask)
        named = step_tensors(input_ids, cache, kwargs)
        paged = bool(cache.attention and cache.attention[0].paged)
        out = None
        for spec, run in find_programs(self._programs, named, paged):
            args = [named[n] if kind == "step" else (self._by_name[n] if kind == "weight" else self._consts[n])
                    for kind, n in spec.inputs]
            try:
                out = run(*args)
                break
            except (AssertionError, RuntimeError) as e:
                if not _is_guard_failure(e):
                    raise
        if out is None:
            raise MissingProgram(f"this engine directory has no exported graph for a {variant_key(named, paged)} call "
                                 f"of {describe_call(named)}: export it again with --max-seq-len / --max-batch "
                                 "covering it, or run the model directory")
        for name, index in spec.states.items():
            kind, j = name.split(".")
            layer = cache.states[int(j)]
            (layer.conv_states if kind == "conv" else layer.recurrent_states)[0] = out[index]
        return StepOutput(out[spec.logits])


class StepOutput:
    """What the runner reads of a model call: its logits (HF's output has them as ``.logits``)."""

    def __init__(self, logits):
        self.logits = logits

def versions() -> dict:
    import transformers
    import triton
    from importlib.metadata import PackageNotFoundError, version
    try:
        hybrid = version("hybrid")
    except PackageNotFoundError:
        hybrid = "source"
    return {"hybrid": hybrid, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"kind": "cuda", "capability": f"{major}.{minor}", "name": torch.cuda.get_device_name(device)}
    return {"kind": "cpu", "capability": None, "name": platform.machine()}


def seal(manifest: dict) -> str:
    """The sha256 of a manifest's entries but ``SEAL`` itself, as canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in manifest.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _spec_from_json(d: dict):
    from .cache import LayerSpec
    dt = lambda s: getattr(torch, s.replace("torch.", ""))  # noqa: E731
    return LayerSpec(d["kind"], d["heads"], d["k_dim"], d["v_dim"], tuple(d["conv_shape"]), tuple(d["ssm_shape"]),
                     dt(d["conv_dtype"]), dt(d["ssm_dtype"]), d["window"])


# -- load --------------------------------------------------------------------------------------------------
def is_engine_dir(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and (Path(path) / MANIFEST).is_file()


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise EngineFileError(f"{path / MANIFEST} is not a readable manifest ({' '.join(str(e).split())}): export "
                              "the engine again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise EngineFileError(f"{path} is an engine directory of format {got!r}; this hybrid reads format {FORMAT}: "
                              "export it again with this hybrid")
    if manifest.get(SEAL) != seal(manifest):
        raise EngineFileError(f"{path / MANIFEST} was changed after export (its {SEAL} does not match its content): "
                              "export the engine again (a manifest is written by `hybrid export`, not by hand)")
    want = {"versions": dict, "device": dict, "dtype": str, "files": dict, "programs": list, "engine": dict}
    for key, kind in want.items():
        if not isinstance(manifest.get(key), kind):
            what = "no" if key not in manifest else f"a malformed ({type(manifest[key]).__name__})"
            raise EngineFileError(f"{path / MANIFEST} has {what} {key!r} entry: export the engine again")
    return manifest


def check_manifest(path: Path, manifest: dict, device: torch.device) -> None:
    """Versions, device and every file's checksum; EngineFileError naming the first that does not match."""
    have = versions()
    for lib in ("torch", "triton"):
        if manifest["versions"].get(lib) != have[lib]:
            raise EngineFileError(f"{path} was exported with {lib} {manifest['versions'].get(lib)}, this is {lib} "
                                  f"{have[lib]}: export it again here (an engine directory is tied to its versions)")
    want = manifest["device"]
    if want["kind"] != device.type:
        raise EngineFileError(f"{path} is a {want['kind']} engine, asked to run on {device}: export it again with "
                              f"--device {device.type}")
    if device.type == "cuda" and device_info(device)["capability"] != want["capability"]:
        raise EngineFileError(f"{path} was exported for GPU architecture sm {want['capability']} ({want['name']}); "
                              f"this GPU is sm {device_info(device)['capability']}: export it again on this GPU")
    # every file the directory holds is checked, but hidden ones and those under hidden folders (a download tool's
    # .cache/, an OS's .DS_Store), which the load never reads
    held = {rel.as_posix() for rel in (f.relative_to(path) for f in path.rglob("*") if f.is_file())
            if rel.name != MANIFEST and not any(p.startswith(".") for p in rel.parts) and rel.parts[0] != TRITON_CACHE}
    needed = {"config.json", "weights.safetensors", "consts.safetensors"} | {
        p[k] for p in manifest["programs"] if isinstance(p, dict) for k in ("file", "package")
        if isinstance(p.get(k), str)}
    unlisted = sorted((held | needed) - set(manifest["files"]))
    if unlisted:
        raise EngineFileError(f"{path / MANIFEST} lists no checksum for {', '.join(unlisted[:3])}: the manifest was "
                              "changed or the directory holds files it did not write; remove those files or export the engine again")
    for rel, digest in manifest["files"].items():
        file = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise EngineFileError(f"{path / MANIFEST} lists {rel}, outside the engine directory: export the engine "
                                  "again")
        if not file.is_file():
            raise EngineFileError(f"{file} is missing from the engine directory: copy the whole directory again")
        if sha256(file) != digest:
            raise EngineFileError(f"{file} fails its checksum (the manifest's sha256 differs): the file is corrupt or "
                                  "was changed; copy the directory again or export it again")


#: HYBRID_ENGINE_ROUTE=exported runs an engine directory's exported programs even where it holds AOTInductor packages
ROUTE_ENV = "HYBRID_ENGINE_ROUTE"


def branches(spec: ProgramSpec, specs: list[ProgramSpec]) -> bool:
    """Whether another program of ``spec``'s kind takes some of the same sizes: the model branches there in a way no
    size range shows (a prompt of whole SSD chunks or not), and only the exported programs' guards tell which one
    runs a call. An AOTInductor package keeps no such guard and would run any call its ranges take, so these calls
    go to the exported programs."""
    def overlap(a: ProgramSpec, b: ProgramSpec) -> bool:
        for name in a.dims.keys() & b.dims.keys():
            for (lo1, hi1), (lo2, hi2) in zip(a.dims[name], b.dims[name]):
                if (hi1 is not None and lo2 is not None and hi1 < lo2) or (hi2 is not None and lo1 is not None
                                                                           and hi2 < lo1):
                    return False
        return True
    return any(other is not spec and other.key == spec.key and overlap(spec, other) for other in specs)


def _load_package(path: Path, spec: ProgramSpec):
    """The AOTInductor package of ``spec``, or None (with a warning naming it) when it does not load here: its
    exported program then runs the calls, exactly and slower."""
    import torch._inductor
    try:
        # single-threaded: no model-container pool and its stream synchronisation, which a CUDA graph capture forbids
        return torch._inductor.aoti_load_package(str(path / spec.package), run_single_threaded=True)
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"hybrid engine: {path / spec.package} does not load as an AOTInductor package "
                      f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); its exported program runs instead "
                      "(unfused, slower)", stacklevel=3)
        return None


class Program:
    """One program of an engine directory, read at its first call: a run reads only the programs its calls reach
    (each takes about a third of a second to read and rebuild, and a directory of a model with state layers holds
    dozens). The files' checksums and the versions they need were checked when the directory loaded.
    ``package``: run its AOTInductor package where one loads here, else the exported program."""

    def __init__(self, path: Path, spec: ProgramSpec, package: bool):
        self.path, self.spec, self.package = path, spec, package
        self.loaded = None  # the module that runs the calls, once read

    def __call__(self, *args):
        if self.loaded is None:
            self.loaded = self._load()
        return self.loaded(*args)

    def _load(self):
        program = _load_package(self.path, self.spec) if self.package else None
        if program is not None:
            return program
        try:
            return torch.export.load(str(self.path / self.spec.file)).module()
        except Exception as e:  # noqa: BLE001
            raise EngineFileError(f"{self.path / self.spec.file} does not load as an exported program "
                                  f"({type(e).__name__}: {' '.join(str(e).split())[:200]}): export the engine "
                                  "again") from None


#: the engine plan's entries a load reads, with their types (ints: positive)
PLAN_TYPES = {"specs": list, "block_size": int, "paged_decode": bool, "latent": bool, "max_batch": int,
              "max_seq_len": int, "max_prefill_tokens": int, "model_class": str}


def parse_plan(path: Path, manifest: dict) -> tuple[torch.dtype, list[ProgramSpec], dict]:
    """The manifest's dtype, program specs and engine plan, checked: an entry of the wrong type, a layer spec that does
    not parse, or a program reading a cache layer the plan does not have is an EngineFileError naming it."""
    def malformed(what: str) -> EngineFileError:
        return EngineFileError(f"{path / MANIFEST} has a malformed {what}: export the engine again")
    dtype = getattr(torch, str(manifest["dtype"]).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise malformed(f"dtype ({manifest['dtype']!r})")
    plan = dict(manifest["engine"])
    for name, kind in PLAN_TYPES.items():
        value = plan.get(name)
        if type(value) is not kind or (kind is int and value < 1):
            raise malformed(f"engine entry {name!r} ({value!r})")
    try:
        plan["specs"] = [_spec_from_json(d) for d in plan["specs"]]
        specs = [ProgramSpec.from_json(d) for d in manifest["programs"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise malformed(f"layer or program entry ({type(e).__name__}: {e})") from None
    for spec in specs:  # cache tensors are named "<what>.<layer>"
        for kind, name in spec.inputs:
            if kind not in ("step", "weight", "const") or (kind == "step" and not _STEP_INPUT.match(name)):
                raise malformed(f"program {spec.file} (input {kind} {name!r}: no such step tensor or kind)")
        for name in [n for _, n in spec.inputs] + list(spec.states):
            layer = name.rpartition(".")[2]
            if layer.isdigit() and int(layer) >= len(plan["specs"]):
                raise malformed(f"program {spec.file} (it reads {name}, the plan has {len(plan['specs'])} layers)")
    return dtype, specs, plan


def load_model(path: str | Path, device: str | None = None, dtype: torch.dtype | None = None):
    """The ExportedModel of an engine directory (checked: ``check_manifest``) and its tokenizer (or None)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, GenerationConfig

    import hybrid_kernels  # noqa: F401  (the hybrid:: ops the programs call)
    from runtime import zoo

    from . import attention  # noqa: F401

    path = Path(path)
    manifest = read_manifest(path)
    kind = manifest["device"]["kind"]
    if device is None and kind == "cuda" and not torch.cuda.is_available():
        raise EngineFileError(f"{path} is a cuda engine, and this machine has no usable CUDA: run it on a GPU, or "
                              "export the model again with --device cpu")
    dev = zoo.check_device(device or kind)
    if dtype is not None and str(dtype) != manifest["dtype"]:
        raise EngineFileError(f"{path} was exported in {manifest['dtype'].replace('torch.', '')}, asked for "
                              f"{str(dtype).replace('torch.', '')}: leave --dtype unset, or export it again")
    check_manifest(path, manifest, dev)
    want, specs, plan = parse_plan(path, manifest)
    if (path / TRITON_CACHE).is_dir() and "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = str((path / TRITON_CACHE).resolve())
    config = AutoConfig.from_pretrained(path)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = None
    # the model's dtype first: the engine takes its cache dtype from the first parameter (float32 buffers such as
    # RoPE's inverse frequencies come after)
    loaded = load_file(str(path / "weights.safetensors")).items()
    weights = {k: v.to(dev) for k, v in sorted(loaded, key=lambda kv: kv[1].dtype != want)}
    consts = {k: v.to(dev) for k, v in load_file(str(path / "consts.safetensors")).items()}
    for spec in specs:
        for kind, name in spec.inputs:
            held = weights if kind == "weight" else consts if kind == "const" else None
            if held is not None and name not in held:
                raise EngineFileError(f"{path / spec.file} reads the {kind} {name!r}, which "
                                      f"{'weights' if kind == 'weight' else 'consts'}.safetensors does not hold: export "
                                      "the engine again")
    programs = {}
    packaged = os.environ.get(ROUTE_ENV, "packaged") != "exported"
    for spec in specs:
        package = packaged and bool(spec.package) and not branches(spec, specs)
        programs.setdefault(spec.key, []).append((spec, Program(path, spec, package)))
    model = ExportedModel(config, generation_config, plan, programs, weights, consts)
    tokenizer = zoo.load_tokenizer(str(path)) if (path / "tokenizer_config.json").is_file() else None
    return model, tokenizer
