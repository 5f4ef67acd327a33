"""hybrid_kernels/library.py: when a kernel launch may use programmatic dependent launch; every kernel can be\ninlined by Inductor."""
import builtins
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from hybrid_kernels import library

ROOT = Path(__file__).resolve().parents[2]


def test_traced_tells_tracing_from_running():
    real = torch.ones(3)
    assert not library.traced(real) and not library.traced(torch.nn.Parameter(real))
    with FakeTensorMode() as mode:
        assert library.traced(mode.from_tensor(real))
    seen = []
    make_fx(lambda t: seen.append(library.traced(t)) or t + 1)(real)  # a proxy mode, real tensors
    assert seen == [True]
    compiled = []
    torch._dynamo.reset()
    torch.compile(lambda t: compiled.append(library.traced(t)) or t * 2, backend="eager")(real)
    assert compiled and all(compiled)


def test_pdl_only_for_launches_on_real_cuda_tensors(monkeypatch):
    """Where programmatic dependent launch is on (Hopper), a launch on real tensors gets it; a traced one does
    not (torch's analysis of what a traced kernel writes cannot read the wait); CPU tensors never do."""
    monkeypatch.setattr(library, "pdl", lambda: True)

    class Cuda(torch.Tensor):  # a real tensor that says it lives on the GPU
        is_cuda = True

    real = torch.ones(2)
    assert library.pdl_opts(real) == {"PDL": False}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(real)
    monkeypatch.setattr(type(fake), "is_cuda", property(lambda self: True))
    assert library.pdl_opts(fake) == {"PDL": False}
    monkeypatch.setattr(library, "traced", lambda t: False)
    assert library.pdl_opts(real.as_subclass(Cuda)) == {"PDL": True, "launch_pdl": True}



def unresolved_kernel_names(tmp: str) -> dict:
    """For every @triton.jit function in hybrid_kernels/: emit it the way Inductor does, import that file, and list
    the globals its functions load that the file does not define. Needs real JITFunctions (no interpreter)."""
    import dis
    import importlib
    import importlib.util
    import pkgutil
    import types
    from pathlib import Path

    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code
    from triton import JITFunction

    import hybrid_kernels as package
    kernels = {}
    for info in pkgutil.walk_packages(package.__path__, "hybrid_kernels."):
        for name, obj in vars(importlib.import_module(info.name)).items():
            # Gluon kernels are launched by opaque custom ops (hybrid_kernels/mla/ops.py): Inductor never emits them
            gluon = getattr(obj, "is_gluon", lambda: False)()
            if isinstance(obj, JITFunction) and obj.fn.__module__ == info.name and not gluon:
                kernels[f"{info.name}.{name}"] = obj
    assert len(kernels) > 30, sorted(kernels)
    missing = {}
    for i, (qualname, kernel) in enumerate(sorted(kernels.items())):
        path = Path(tmp) / f"k{i}.py"
        path.write_text("import triton\nimport triton.language as tl\n"
                        + user_defined_triton_kernel_transitive_closure_source_code(kernel))
        spec = importlib.util.spec_from_file_location(f"k{i}", path)
        emitted = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(emitted)
        # the kernel itself comes without its decorator; the helpers it calls with theirs
        fns = [v.fn if isinstance(v, JITFunction) else v for v in vars(emitted).values()
               if isinstance(v, JITFunction) or isinstance(v, types.FunctionType)]
        for fn in fns:
            loads = {ins.argval for ins in dis.Bytecode(fn) if ins.opname == "LOAD_GLOBAL"}
            unresolved = sorted(n for n in loads if n not in vars(emitted) and not hasattr(builtins, n))
            if unresolved:
                missing[f"{qualname} ({fn.__name__})"] = unresolved
    return missing


def test_kernels_can_be_inlined_by_inductor(tmp_path):
    """torch.compile re-emits a traced kernel's source, with the jit helpers it calls, into a file of its own
    (Inductor's user-defined-kernel path). Only helpers named directly come along: a helper reached through a
    module attribute (``common.mma``) is a NameError when that file compiles, on the GPU only. Checked in a
    process without TRITON_INTERPRET, where @triton.jit gives the JITFunctions Inductor reads."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(Path(__file__).parent)!r}]; import test_library; "
            f"print(repr(test_library.unresolved_kernel_names({str(tmp_path)!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "{}", done.stdout[-3000:]
