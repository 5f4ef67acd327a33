"""runtime/ops/library.py: when a kernel launch may use programmatic dependent launch."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from runtime.ops import library


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
