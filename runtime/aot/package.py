"""AOTInductor packages of exported programs (the engine directory's compiled route, docs/engine-files.md).

``build_package`` compiles one exported program with ``aoti_compile_and_package``, checks that the shared object in
the package links libstdc++ dynamically (a copy linked in statically disagrees with the one torch loaded about
locale facets and crashes at load, inside ``std::regex``), loads it back and checks it against the exported program
on the inputs the capture recorded. ``choose_compiler`` picks the C++ compiler that does so.
"""
from __future__ import annotations

import copy
import math
import os
import shutil
import subprocess
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch

#: the compilers tried, in order, when $CXX is unset: Inductor's default, then the system's
_CANDIDATES = ("g++", "/usr/bin/g++", "clang++")


class PackageError(RuntimeError):
    """An AOTInductor package that cannot be built, loads wrong, or computes something else than its program."""


def needed_libraries(so: Path) -> list[str]:
    """The NEEDED entries of a shared object's dynamic section (``readelf -d``)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        raise PackageError("readelf is not installed: the libstdc++ linkage of AOTInductor packages cannot be "
                           "checked (install binutils, or export with --aot none)")
    out = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def _links_libstdcxx_dynamically(cxx: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        src, so = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
        src.write_text('#include <string>\nextern "C" int probe(const char* s) { return std::string(s).size(); }\n')
        try:
            subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(so)], capture_output=True, check=True,
                           timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        return any(lib.startswith("libstdc++") for lib in needed_libraries(so))


def choose_compiler() -> str:
    """$CXX when set (it must link libstdc++ dynamically), else the first of ``_CANDIDATES`` that does."""
    if os.environ.get("CXX"):
        cxx = os.environ["CXX"]
        if not _links_libstdcxx_dynamically(cxx):
            raise PackageError(f"CXX={cxx} does not build shared objects that link libstdc++ dynamically (its "
                               "packages crash at load): set CXX to one that does (e.g. /usr/bin/g++), or export "
                               "with --aot none")
        return cxx
    for cxx in _CANDIDATES:
        if shutil.which(cxx) and _links_libstdcxx_dynamically(cxx):
            return cxx
    raise PackageError(f"none of {', '.join(_CANDIDATES)} builds shared objects that link libstdc++ dynamically: "
                       "set CXX to a compiler that does, or export with --aot none")


def check_package(path: Path) -> None:
    """Every shared object in the package lists libstdc++ among its NEEDED libraries."""
    with zipfile.ZipFile(path) as z, tempfile.TemporaryDirectory() as tmp:
        for name in z.namelist():
            if name.endswith(".so"):
                so = Path(z.extract(name, tmp))
                if not any(lib.startswith("libstdc++") for lib in needed_libraries(so)):
                    raise PackageError(f"{path.name}: {Path(name).name} links libstdc++ statically (NEEDED: "
                                       f"{', '.join(needed_libraries(so)) or 'nothing'}); it would crash at load: "
                                       "export again with CXX set to a compiler that links it dynamically")


def _same(got, want) -> float | None:
    """None when the outputs agree, else the largest difference relative to the largest value. Inductor fuses and
    keeps 16-bit intermediates in fp32 where the exported program rounds each op: tolerance 1e-3 in fp32, 3e-2 in
    16-bit."""
    got, want = list(got), list(want)
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for g, w in zip(got, want):
        if not isinstance(w, torch.Tensor):
            continue
        if g.shape != w.shape:
            return float("inf")
        if w.numel() == 0 or not w.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(g, w) else float("inf"))
            continue
        tol = 1e-3 if w.dtype == torch.float32 else 3e-2
        rel = ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp(min=1.0)).item()
        worst = max(worst, rel if rel > tol else 0.0)
    return worst or None


#: what an infinite float argument of a hybrid op becomes in a package (AOTInductor serialises the arguments of the
#: custom ops it calls as JSON numbers, which have no infinity)
FLOAT_MAX = float(torch.finfo(torch.float32).max)


def finite_bounds(ep):
    """A copy of ``ep`` whose hybrid ops take +-FLOAT_MAX for +-inf. Their infinite arguments are clamp bounds that
    leave values alone (the MoE experts' SwiGLU limit, the SSM time-step maximum): a bound of the largest float32
    clamps no finite value either. The package is checked against ``ep`` itself afterwards."""
    ep = copy.deepcopy(ep)

    def fix(a):
        if isinstance(a, float) and math.isinf(a):
            return math.copysign(FLOAT_MAX, a)
        return type(a)(fix(x) for x in a) if isinstance(a, (list, tuple)) else a
    for node in ep.graph_module.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("hybrid."):
            node.args = fix(node.args)
            node.kwargs = {k: fix(v) for k, v in node.kwargs.items()}
    ep.graph_module.recompile()
    return ep


def build_package(ep, example: list, path: Path, cxx: str) -> None:
    """Compile ``ep`` to the AOTInductor package ``path`` with ``cxx``, check its linkage, load it, and check it
    against ``ep`` on ``example`` (the call's inputs as the capture recorded them; cloned, the programs write the
    cache in place)."""
    import torch._inductor
    try:
        # torch's own pytree deprecation notice, raised inside its compile (not about this package)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated")
            torch._inductor.aoti_compile_and_package(finite_bounds(ep), package_path=str(path),
                                                     inductor_configs={"cpp.cxx": (None, cxx)})
    except Exception as e:  # noqa: BLE001
        raise PackageError(f"AOTInductor cannot compile {path.name} ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:300]})") from None
    check_package(path)
    runner = torch._inductor.aoti_load_package(str(path), run_single_threaded=True)
    clones = lambda: [a.clone() if isinstance(a, torch.Tensor) else a for a in example]  # noqa: E731
    with torch.no_grad():
        want = ep.module()(*clones())
        got = runner(*clones())
    err = _same(got, want)
    if err is not None:
        raise PackageError(f"the AOTInductor package {path.name} differs from its exported program by {err:.1e}")
