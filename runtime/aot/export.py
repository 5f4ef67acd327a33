"""``export_engine``: a model (zoo name or HF model directory) -> an engine directory (its layout:
runtime/engine/exported.py, which reads it back).

The model runs in an engine built without compiling, over requests that reach every kind of model call the engine
makes (``runtime.engine.warmup.call_kinds``); ``Capture`` exports each kind once, after hybrid's passes. The engine's plan (cache layers,
block size, paged decode, limits), the programs' bindings and every file's sha256 go into the manifest.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from runtime.engine.exported import FORMAT, MANIFEST, SEAL, TRITON_CACHE, device_info, seal, sha256, versions
from runtime.engine.warmup import call_kinds, prompt_ids

#: "inductor": every program also as an AOTInductor package; "none": the exported programs alone
AOT_ROUTES = ("inductor", "none")
#: the shortest sequence limit an export takes: below it the export's requests reach no prefill program
MIN_SEQ_LEN = 16


def _spec_json(spec) -> dict:
    d = dataclasses.asdict(spec)
    d["conv_dtype"], d["ssm_dtype"] = str(spec.conv_dtype), str(spec.ssm_dtype)
    d["conv_shape"], d["ssm_shape"] = list(spec.conv_shape), list(spec.ssm_shape)
    return d


# -- export ------------------------------------------------------------------------------------------------
def _other(engine, ids: list[int]) -> list[int]:
    """A prompt of ``ids``' length with other tokens."""
    return [(3 * t + 5) % (engine.vocab_size - 1) + 1 for t in ids]


def _uncovered(cap, chunk: int, block_size: int, max_len: int) -> list[tuple[list[list[int]], int]]:
    """Requests for the sizes beyond the bound of a program (a branch of the model on a size bounds it), so that
    another program takes them: prompts one token past a bounded prompt length, contexts one block past a bounded
    block table."""
    runs = []
    for specs in cap.programs.values():
        for spec, _ in specs:
            q_hi = spec.dims.get("ids", [[None, None]] * 2)[1][1]
            continuing = "states:" in spec.key and not spec.key.startswith(("decode", "step"))
            several = "/bN/" in spec.key  # a program for several sequences: two prompts together
            if q_hi is not None and q_hi < chunk:
                n = q_hi + 1 + (chunk if continuing else 0)
                if n < max_len - 3:
                    runs.append(([prompt_ids(cap.engine, n, 11)] + [prompt_ids(cap.engine, n, 14)] * several, 2))
            for name, per_key in (("block_table", block_size), ("gather_idx", 1)):
                hi = spec.dims.get(name, [[None, None]] * 2)[1][1]
                if hi is not None and (hi + 1) * per_key < max_len - 3:
                    n = (hi + 1) * per_key
                    runs.append(([prompt_ids(cap.engine, n, 12)] + [prompt_ids(cap.engine, n, 13)] * several, 4))
    return runs


def export_engine(name_or_path: str, out_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None,
                  max_batch: int = 32, max_seq_len: int | None = None, block_size: int = 16,
                  max_prefill_tokens: int = 512, compile_options: dict | None = None, force: bool = False,
                  aot: str | None = None, progress=print) -> Path:
    """Export the model ``name_or_path`` (a zoo name or an HF model directory) as an engine directory. ``aot``:
    "inductor" compiles every program into an AOTInductor package too (the route that loads fused), "none" (the
    default) keeps the exported programs alone: decode over packages under CUDA graphs is not confirmed yet
    (docs/engine-files.md)."""
    from runtime import zoo
    from runtime.engine import Engine, SamplingParams

    from .capture import Capture
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"{out} exists and is not an empty directory: give a new path, or --force to replace "
                              "the engine files in it")
    if max_seq_len is not None and max_seq_len < MIN_SEQ_LEN:
        raise ValueError(f"max_seq_len {max_seq_len}: an engine directory holds at least {MIN_SEQ_LEN} tokens a "
                         f"sequence (--max-seq-len {MIN_SEQ_LEN} or more)")
    dev = zoo.check_device(device)
    zoo.writable_dir(out, "the engine directory")
    aot = aot or "none"
    if aot not in AOT_ROUTES:
        raise ValueError(f"aot={aot!r}: expected one of {', '.join(AOT_ROUTES)}")
    cxx = None
    if aot == "inductor":  # before the long part: a compiler that cannot build loadable packages fails here
        from .package import choose_compiler
        cxx = choose_compiler()
    if dev.type == "cuda":  # the Triton kernels the export compiles ship in the directory (load_model reads them)
        out.mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str((out / TRITON_CACHE).resolve())
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    progress(f"loading {name_or_path} ({str(dtype).replace('torch.', '')}, {dev})")
    model = zoo.load(name_or_path, dtype=dtype, device=str(dev))
    tokenizer = zoo.load_tokenizer(name_or_path)
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_seq_len and limit and max_seq_len > limit:
        progress(f"max_seq_len {max_seq_len} is past the model's {limit} positions "
                 f"(max_position_embeddings): exporting for {limit}")
    max_seq_len = min(max_seq_len or limit or 4096, limit or 1 << 30)
    # prompts are prefilled in chunks of at most this many tokens, at export and at load
    chunk = max(8, min(max_prefill_tokens, max_seq_len // 2))
    engine = Engine(model, tokenizer=tokenizer, compile=None, cache_memory=64 << 20, block_size=block_size,
                    max_num_seqs=4, max_prefill_tokens=chunk, overlap=False, bucket_decode=dev.type == "cuda",
                    packed_steps=False)  # a directory's programs are the padded steps' (packed steps: no program)
    if engine.cache.states:  # prompts (or chunks) of one length per prefill step, unpadded: a state layer's scan
        # branches on each row's length and padding, so padded rows of several lengths would need a program per
        # combination of branches; rows of one length take the branches of that length
        engine.runner.pad_states, engine.scheduler.equal_lengths = False, True
    cap = Capture(engine, compile_options, progress).install()
    runs = call_kinds(engine, block_size, chunk, max_seq_len)
    if engine.cache.states:  # every single-prompt length also as two prompts of that length: the batched programs
        runs += [([p[0], _other(engine, p[0])], n) for p, n in runs if len(p) == 1]
    for _ in range(4):  # the workload, then requests for what its programs left out, while they add programs
        before = cap.count
        for prompts, n in runs:
            engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
            if cap.error is not None:
                raise cap.error
        runs = _uncovered(cap, chunk, block_size, max_seq_len)
        if cap.count == before or not runs:
            break
    _write(out, engine, cap, model, tokenizer, dev, dtype, dict(max_batch=max_batch, max_seq_len=max_seq_len,
                                                                  max_prefill_tokens=chunk), block_size, cxx, progress)
    return out


def _write(out: Path, engine, cap, model, tokenizer, dev, dtype, limits: dict, block_size: int, cxx: str | None,
           progress):
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    (out / "programs").mkdir(exist_ok=True)
    for old in list(out.glob("programs/*.pt2")) + [out / MANIFEST]:
        old.unlink(missing_ok=True)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    save_file({k: v.detach().contiguous().clone() for k, v in cap.weights.items()}, str(out / "weights.safetensors"))
    save_file({k: v.contiguous() for k, v in cap.consts.items()}, str(out / "consts.safetensors"))
    umask = os.umask(0)
    os.umask(umask)
    for name in ("weights.safetensors", "consts.safetensors"):  # safetensors writes 0600; as every other file
        os.chmod(out / name, 0o666 & ~umask)
    programs = []
    total = cap.count
    for key in sorted(cap.programs):
        for spec, ep in cap.programs[key]:
            n = len(programs)
            spec.file = f"programs/{n}.pt2"
            # saved without the call's inputs (whole cache buffers: tens of MB a program, never read at load);
            # AOTInductor's build below needs them
            inputs, ep.example_inputs = ep.example_inputs, None
            torch.export.save(ep, str(out / spec.file))
            ep.example_inputs = inputs
            if cxx is not None:
                from .package import build_package
                progress(f"compiling graph {n + 1}/{total} with AOTInductor ({cxx}): {spec.key}")
                spec.package = f"programs/{n}.aoti.pt2"
                build_package(ep, cap.examples[id(ep)], out / spec.package, cxx)
            programs.append(spec.to_json())
    plan = {"specs": [_spec_json(s) for s in engine._layer_specs], "prefill_note": engine.prefill_note,
            "own_attention": engine._own_attention, "block_size": block_size,
            "paged_decode": engine.runner.paged_decode, "latent": engine.runner.paged_latent,
            "prefill_seqs": ("one" if engine.scheduler.max_prefill_seqs == 1 else
                             "equal" if engine.scheduler.equal_lengths else "several"),
            **limits, "model_class": type(model).__name__}
    files = {p.relative_to(out).as_posix(): sha256(p) for p in sorted(out.rglob("*"))
             if p.is_file() and p.relative_to(out).parts[0] != TRITON_CACHE}  # Triton checks its own cache
    manifest = {"format": FORMAT, "versions": versions(), "device": device_info(dev), "dtype": str(dtype),
                "aot": {"route": "inductor" if cxx else "none", "compiler": cxx}, "engine": plan,
                "programs": programs, "files": files}
    manifest[SEAL] = seal(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    progress(f"wrote {out}: {len(programs)} graphs, {len(files)} files")


