"""Shared numerics harness: the same zoo model run eagerly and compiled with the hybrid backend.

Every pass test uses it: logits must match eager within the dtype's tolerance and greedy ``generate``
must give identical tokens (DynamicCache and ``cache_implementation="static"``), through the recompiles
generate triggers.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from compiler import collect
from runtime import zoo
from hybrid_kernels.numerics import TOLERANCE, rel_err


@dataclass
class Run:
    logits_err: float
    eager_tokens: torch.Tensor | None
    compiled_tokens: torch.Tensor | None
    report: object

    @property
    def same_tokens(self) -> bool:
        return self.eager_tokens is not None and torch.equal(self.eager_tokens, self.compiled_tokens)


def prompt(model, batch: int = 2, tokens: int = 9, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, tokens), generator=g)


def compile_forward(model, options: dict | None = None):
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="hybrid", options=options or {})
    return model


def run_both(name: str, *, options: dict | None = None, new_tokens: int = 5, batch: int = 2, tokens: int = 9,
             cache_implementation: str | None = None, dtype=torch.float32, seed: int = 0, **overrides) -> Run:
    """Eager and hybrid-compiled copies of zoo model ``name`` on the same prompt."""
    eager = zoo.build(name, dtype=dtype, seed=seed, **overrides)
    compiled = compile_forward(zoo.build(name, dtype=dtype, seed=seed, **overrides), options)
    ids = prompt(eager, batch, tokens, seed)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if cache_implementation:
        gen["cache_implementation"] = cache_implementation
    with torch.no_grad(), collect() as report:
        ref = eager(ids).logits
        out = compiled(ids).logits
        ref_tokens = eager.generate(ids, **gen) if new_tokens else None
        out_tokens = compiled.generate(ids, **gen) if new_tokens else None
    torch._dynamo.reset()
    return Run(rel_err(out, ref), ref_tokens, out_tokens, report)


def assert_matches(run: Run, dtype=torch.float32) -> None:
    assert run.logits_err <= TOLERANCE[dtype], f"logits relative error {run.logits_err:.2e}"
    if run.eager_tokens is not None:
        assert run.same_tokens, f"generate differs:\neager    {run.eager_tokens.tolist()}\ncompiled {run.compiled_tokens.tolist()}"


def capture_graphs(model, *args, generate_tokens: int = 0, **kwargs) -> list[tuple]:
    """The dynamo graphs (GraphModule, example_inputs) of ``model.forward``, without compiling them."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=backend)
    with torch.no_grad():
        if generate_tokens:
            model.forward = compiled
            try:
                model.generate(*args, max_new_tokens=generate_tokens, min_new_tokens=generate_tokens,
                               do_sample=False, **kwargs)
            finally:
                del model.forward
        else:
            compiled(*args, **kwargs)
    torch._dynamo.reset()
    return graphs


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor an HF cache object holds, in a deterministic order (for drop-in cache comparisons)."""
    out: list[torch.Tensor] = []

    def walk(obj, depth=0):
        if depth > 4:
            return
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k], depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            for k in sorted(vars(obj)):
                walk(vars(obj)[k], depth + 1)

    walk(cache)
    return out


@contextlib.contextmanager
def compiled_with_spy(fn, options, inspect):
    """(fn compiled with the hybrid backend, explain report, [inspect(gm) for every graph handed to Inductor]): what
    the passes left for Inductor, graph by graph."""
    import torch._inductor.compile_fx as cfx
    seen, real = [], cfx.compile_fx

    def spy(gm, example_inputs, *args, **kwargs):
        seen.append(inspect(gm))
        return real(gm, example_inputs, *args, **kwargs)
    cfx.compile_fx = spy
    torch._dynamo.reset()
    try:
        with collect() as report, torch.no_grad():
            yield torch.compile(fn, backend="hybrid", options=options), report, seen
    finally:
        cfx.compile_fx = real
        torch._dynamo.reset()
