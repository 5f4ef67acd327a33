"""The house: imports run one way up the floors (kernels and graphs at the bottom -> passes -> compiler -> runtime ->
bench), no module imports another in a circle, and library code cites no dates or bench result files (history goes to
git, numbers to bench/). Read from the source, so a function-local import counts as much as one at the top."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: floor of each top-level folder; a module may import its own folder and the floors below
FLOORS = {"hybrid_kernels": 0, "graphs": 0, "passes": 1, "compiler": 2, "runtime": 3, "bench": 4}
#: within runtime: the CLI drives the engine, never the other way round
RUNTIME_TOP = "runtime.cli"
LIBRARY = ("hybrid_kernels", "graphs", "passes", "compiler", "runtime")


def _modules() -> dict[str, Path]:
    out = {}
    for top in FLOORS:
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (the longest module prefix of each imported name)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # ``from pkg import name``: the submodule pkg.name where there is one, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != name:
                found.add(".".join(parts))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_imports_run_one_way_up_the_floors():
    wrong = []
    for mod, targets in _graph().items():
        top = mod.split(".")[0]
        for t in targets:
            ttop = t.split(".")[0]
            if ttop != top and FLOORS[ttop] >= FLOORS[top]:
                wrong.append(f"{mod} -> {t}")
            if top == "runtime" and t.startswith(RUNTIME_TOP) and not mod.startswith(RUNTIME_TOP):
                wrong.append(f"{mod} -> {t} (the CLI is the top of runtime)")
            if mod.startswith("runtime.engine") and t.startswith("runtime.aot"):
                wrong.append(f"{mod} -> {t} (the engine reads engine files itself; runtime.aot writes them)")
    assert not wrong, "imports that run back up the floors:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    graph = _graph()
    cycles, state = [], {}

    def visit(mod, stack):
        state[mod] = "open"
        stack.append(mod)
        for t in sorted(graph.get(mod, ())):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[mod] = "done"

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_check_sees_real_imports():
    """Control: the walk finds imports that are there, relative and function-local ones included."""
    graph = _graph()
    assert "hybrid_kernels.library" in graph["hybrid_kernels.mla.ops"]            # absolute
    assert "hybrid_kernels.mla.triton_attention" in graph["hybrid_kernels.mla.ops"]  # relative (from . import ...)
    assert "passes.prepare" in graph["runtime.engine.model_runner"]  # inside a function
    assert "runtime.engine" in graph["runtime.cli"]


def test_library_code_cites_no_dates_or_bench_results():
    pattern = re.compile(r"20\d\d-\d\d-\d\d|bench/results")
    hits = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
            for top in LIBRARY for path in sorted((ROOT / top).rglob("*.py"))
            for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "library code that cites a date or a bench result (history belongs in git, numbers in " \
                     "bench/):\n" + "\n".join(hits)


def test_top_level_packages_shadow_no_installed_distribution():
    """Each of our import names belongs to hybrid alone: a name another installed distribution also provides (HF's
    ``kernels``, which transformers requires) would shadow it, and transformers' own imports of it would fail."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    taken = {top: sorted(set(owners.get(top, [])) - {"hybrid"}) for top in LIBRARY}
    assert not {top: d for top, d in taken.items() if d}, taken
