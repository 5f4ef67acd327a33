"""One description of an MoE block variant, shared by the pass that finds it, the probe that proves it, the op that
runs it and the kernels' branch choices: how the router turns logits into (weights, ids) (``RouteSpec``) and how
the experts compute (``ExpertsSpec``). ``MoESpec`` builds the positional arguments of ``hybrid::moe`` and
``hybrid::moe_block`` in schema order from whatever the tensors are (live tensors or graph nodes); the order is
written here and in the op signatures in ops.py, nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass

from .reference import ACTIVATIONS, METHODS


@dataclass(frozen=True)
class RouteSpec:
    """Routing: ``method`` (reference.METHODS), top-k, renormalisation, the routed scaling factor, group limits, and
    whether the router's matmul runs in fp32 (DeepSeek) or in the activations' dtype."""
    method: str
    top_k: int
    renormalize: bool = False
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_fp32: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown MoE routing method {self.method!r}; expected one of {METHODS}")

    @property
    def uses_bias(self) -> bool:
        """Whether the router's score-correction bias enters the choice (sigmoid routing)."""
        return "sigmoid" in self.method

    def kwargs(self) -> dict:
        """Keyword arguments of ``reference.route`` and the Triton routing launchers."""
        return dict(method=self.method, top_k=self.top_k, renormalize=self.renormalize, scale=float(self.scale),
                    n_group=self.n_group, topk_group=self.topk_group)

    def describe(self) -> str:
        return (f"{self.method}, top-{self.top_k}{', renormalised' if self.renormalize else ''}"
                f"{f', x{self.scale:g}' if self.scale != 1 else ''}")


@dataclass(frozen=True)
class ExpertsSpec:
    """The experts: a fused gate + up weight ``[E, 2I, H]`` (``gated``; halves ``interleaved`` or concatenated) or an
    up weight alone, and the activation (reference.ACTIVATIONS)."""
    gated: bool = True
    interleaved: bool = False
    activation: str = "silu"

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.activation!r}; expected one of {ACTIVATIONS}")

    def kwargs(self) -> dict:
        return dict(gated=self.gated, interleaved=self.interleaved, activation=self.activation)


@dataclass(frozen=True)
class MoESpec:
    route: RouteSpec
    experts: ExpertsSpec

    def _static(self) -> tuple:
        r, e = self.route, self.experts
        return (r.method, int(r.top_k), bool(r.renormalize), float(r.scale), int(r.n_group), int(r.topk_group),
                bool(e.gated), bool(e.interleaved), e.activation, bool(r.router_fp32))

    def moe_args(self, x, router_w, router_bias, w13, w2) -> tuple:
        """``hybrid::moe``: the routed experts of a block, x [T, H]."""
        return (x, router_w, router_bias if self.route.uses_bias else None, w13, w2, *self._static())

    def block_args(self, x, router_w, router_bias, w13, w2, shared=None, shared_gate=None) -> tuple:
        """``hybrid::moe_block``: the whole block, x [..., H], with the shared expert's output (optionally gated)."""
        return (x, router_w, router_bias if self.route.uses_bias else None, w13, w2, shared, shared_gate,
                *self._static())

    def kwargs(self) -> dict:
        """Keyword arguments of ``reference.moe`` and ``triton_experts.moe_triton``."""
        return dict(**self.route.kwargs(), **self.experts.kwargs(), router_fp32=self.route.router_fp32)

    def describe(self) -> str:
        return f"{self.route.describe()}, {self.experts.activation}"

    @classmethod
    def from_args(cls, method: str, top_k: int, renormalize: bool, scale: float, n_group: int, topk_group: int,
                  gated: bool, interleaved: bool, activation: str, router_fp32: bool) -> "MoESpec":
        """The spec an op call's static arguments describe (the inverse of ``moe_args`` / ``block_args``)."""
        return cls(RouteSpec(method, top_k, renormalize, scale, n_group, topk_group, router_fp32),
                   ExpertsSpec(gated, interleaved, activation))
