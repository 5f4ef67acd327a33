"""One description of an MoE block variant, shared by the pass that finds it, the probe that proves it, the op that
runs it and the kernels' branch choices: how the router turns logits into (weights, ids) (``RouteSpec``) and how
the experts compute (``ExpertsSpec``); the block's tensors in one named tuple (``MoEWeights``). ``MoESpec`` builds the
positional arguments of ``hybrid::moe`` and ``hybrid::moe_block`` in schema order from whatever the tensors are (live
tensors or graph nodes); the order is written here and in the op signatures in ops.py, nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .reference import ACTIVATIONS, COMBINED, METHODS


class MoEWeights(NamedTuple):
    router_w: Any                  # [E, H]
    router_logit_bias: Any = None  # [E]: the router linear's own bias (gpt-oss)
    router_bias: Any = None        # [E]: the score-correction bias of sigmoid routing (DeepSeek-V3)
    w13: Any = None                # [E, 2I | I, H] (or [E, H, 2I | I] with ExpertsSpec.transposed)
    w2: Any = None                 # [E, H, I] (or [E, I, H] transposed)
    b13: Any = None                # [E, 2I | I]: gate / up biases
    b2: Any = None                 # [E, H]: down biases


@dataclass(frozen=True)
class RouteSpec:
    """Routing: ``method`` (reference.METHODS), top-k, renormalisation, the routed scaling factor, group limits,
    whether the router's matmul runs in fp32 (DeepSeek) or in the activations' dtype, and the sparse mixer's
    masking threshold (``jitter_eps``; read by ``sparsemixer`` only)."""
    method: str
    top_k: int
    renormalize: bool = False
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_fp32: bool = False
    jitter_eps: float = 0.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown MoE routing method {self.method!r}; expected one of {METHODS}")
        if self.method != "sparsemixer" and self.jitter_eps:
            raise ValueError(f"jitter_eps is read by the sparsemixer routing only, not by {self.method}")

    @property
    def uses_bias(self) -> bool:
        """Whether the router's score-correction bias enters the choice."""
        return self.method in ("sigmoid_group_topk", "softmax_bias_topk", "sigmoid_logit_bias_topk",
                               "sqrtsoftplus_bias_topk")

    def kwargs(self) -> dict:
        """Keyword arguments of ``reference.route`` and the Triton routing launchers."""
        return dict(method=self.method, top_k=self.top_k, renormalize=self.renormalize, scale=float(self.scale),
                    n_group=self.n_group, topk_group=self.topk_group, jitter_eps=float(self.jitter_eps))

    def static(self) -> tuple:
        return (self.method, int(self.top_k), bool(self.renormalize), float(self.scale), int(self.n_group),
                int(self.topk_group), bool(self.router_fp32), float(self.jitter_eps))

    def describe(self) -> str:
        return (f"{self.method}{f' (jitter eps {self.jitter_eps:g})' if self.method == 'sparsemixer' else ''}, "
                f"top-{self.top_k}{', renormalised' if self.renormalize else ''}"
                f"{f', x{self.scale:g}' if self.scale != 1 else ''}")


@dataclass(frozen=True)
class ExpertsSpec:
    """The experts: a fused gate + up weight (``gated``; halves ``interleaved`` or concatenated) or an up weight alone,
    the activation (reference.ACTIVATIONS, with ``alpha`` / ``limit`` for the combined ones), and whether the weights are
    stored transposed ([E, in, out])."""
    gated: bool = True
    interleaved: bool = False
    activation: str = "silu"
    transposed: bool = False
    alpha: float = 1.0
    limit: float = float("inf")

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.activation!r}; expected one of {ACTIVATIONS}")
        if self.activation in COMBINED and not self.gated:
            raise ValueError(f"the {self.activation} activation needs gated experts")
        if self.activation == "swiglu_softcap" and not (0 < self.alpha < float("inf") and 0 < self.limit < float("inf")):
            raise ValueError(f"swiglu_softcap needs finite positive caps, got gate {self.alpha}, up {self.limit}")
        if self.activation == "swiglu_limit" and not 0 < self.limit < float("inf"):
            raise ValueError(f"swiglu_limit needs a finite positive limit, got {self.limit}")

    def kwargs(self) -> dict:
        return dict(gated=self.gated, interleaved=self.interleaved, activation=self.activation, alpha=float(self.alpha),
                    limit=float(self.limit))

    def static(self) -> tuple:
        return (bool(self.gated), bool(self.interleaved), self.activation, bool(self.transposed), float(self.alpha),
                float(self.limit))

    def describe(self) -> str:
        act = {"swiglu_clamp": f"swiglu_clamp (alpha {self.alpha:g}, limit {self.limit:g})",
               "swiglu_softcap": f"swiglu_softcap (gate cap {self.alpha:g}, up cap {self.limit:g})",
               "swiglu_limit": f"swiglu_limit (limit {self.limit:g})"}.get(
            self.activation, self.activation)
        return act + (", transposed weights" if self.transposed else "")


@dataclass(frozen=True)
class MoESpec:
    route: RouteSpec
    experts: ExpertsSpec

    def moe_args(self, x, w: MoEWeights) -> tuple:
        """``hybrid::moe``: the routed experts of a block, x [T, H]."""
        return (x, *self._tensors(w), *self.route.static(), *self.experts.static())

    def block_args(self, x, w: MoEWeights, shared=None, shared_gate=None) -> tuple:
        """``hybrid::moe_block``: the whole block, x [..., H], with the shared expert's output (optionally gated)."""
        return (x, *self._tensors(w), shared, shared_gate, *self.route.static(), *self.experts.static())

    def _tensors(self, w: MoEWeights) -> tuple:
        return w._replace(router_bias=w.router_bias if self.route.uses_bias else None)

    def kwargs(self) -> dict:
        """Keyword arguments of ``reference.moe`` and ``triton_experts.moe_triton`` (tensors aside)."""
        return dict(**self.route.kwargs(), **self.experts.kwargs(), router_fp32=self.route.router_fp32)

    def describe(self) -> str:
        return f"{self.route.describe()}, {self.experts.describe()}"

    @classmethod
    def from_args(cls, method: str, top_k: int, renormalize: bool, scale: float, n_group: int, topk_group: int,
                  router_fp32: bool, jitter_eps: float, gated: bool, interleaved: bool, activation: str,
                  transposed: bool, alpha: float, limit: float) -> "MoESpec":
        """The spec an op call's static arguments describe (the inverse of ``moe_args`` / ``block_args``)."""
        return cls(RouteSpec(method, top_k, renormalize, scale, n_group, topk_group, router_fp32, jitter_eps),
                   ExpertsSpec(gated, interleaved, activation, transposed, alpha, limit))
