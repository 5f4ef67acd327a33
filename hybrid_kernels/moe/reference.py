"""Plain torch mixture-of-experts: the CPU path of the ``hybrid::moe*`` ops and the test oracle.

Shape-static (no ``.item()``, no ``nonzero``): the bodies double as fake implementations. Math in fp32.

Routing methods (each exactly as Hugging Face computes it; ``scale`` = routed scaling factor, 1.0 if none):
  - ``softmax_topk``: softmax -> top-k (-> / sum when ``renormalize``) * scale
        (Mixtral, Qwen3Moe with norm_topk_prob, Jamba without renorm, DeepSeek-V2 "greedy").
  - ``topk_softmax``: top-k of the logits -> softmax over the k values * scale.
  - ``sigmoid_group_topk``: DeepSeek-V3 ``DeepseekV3TopkRouter``: s = sigmoid; c = s + bias; a group scores the
        sum of its top-2 c; keep ``topk_group`` groups; top-k of c -> ids; weights = s at ids
        (-> / (sum + 1e-20) when ``renormalize``) * scale.
  - ``softmax_group_topk``: DeepSeek-V2 "group_limited_greedy": p = softmax; a group scores its max p; keep
        ``topk_group`` groups (the others' p set to 0.0); top-k -> ids, weights = p at ids * scale.
  - ``softmax_bias_topk``: ERNIE-4.5 MoE: p = softmax; top-k of p + bias -> ids; weights = p at ids
        (-> / (sum + 1e-20) when ``renormalize``) * scale.
  - ``sigmoid_logit_bias_topk``: the bias shifts the logits, not the scores: top-k of logits + bias -> ids;
        weights = sigmoid(logits) at ids (-> / sum when ``renormalize``) * scale.
  - ``sparsemixer``: Phi-3.5-MoE's selection at inference, k = 2 picks: pick j takes the largest logit m among
        the experts not yet picked; the experts with (m - s) / max(|s|, m) > 2 * ``jitter_eps`` are masked; its
        weight is the softmax over the unmasked, not-yet-picked logits at the pick: 1 / sum exp(s - m).

Memory traffic of ``experts`` (the fused kernel's roofline): every touched expert's weights once,
3 * H * I elements per expert (gated), plus x [T, H] and out [T, H].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

METHODS = ("softmax_topk", "topk_softmax", "sigmoid_group_topk", "softmax_group_topk", "softmax_bias_topk",
           "sigmoid_logit_bias_topk", "sparsemixer", "sqrtsoftplus_bias_topk")
#: activations of the experts: act(gate) * up (gated) or act(up); "swiglu_clamp" (gated only, gpt-oss):
#: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit); "relu2": relu(x)^2;
#: "swiglu_softcap" (gated only): cap(gate, alpha) * sigmoid(gate) * cap(up, limit) with cap(x, c) = c tanh(x / c);
#: "swiglu_limit" (gated only, DeepSeek-V4): silu(clamp(gate, max=limit)) * clamp(up, -limit, limit)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "swiglu_clamp", "relu2", "swiglu_softcap", "swiglu_limit")
#: the activations that combine gate and up in a form of their own (``glu``), gated experts only
COMBINED = ("swiglu_clamp", "swiglu_softcap", "swiglu_limit")
#: the activations that act on one tensor
ELEMENTWISE = tuple(a for a in ACTIVATIONS if a not in COMBINED)


def check_route_args(num_experts: int, method: str, top_k: int, n_group: int, topk_group: int,
                     jitter_eps: float = 0.0) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown MoE routing method {method!r}; expected one of {METHODS}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if method == "sparsemixer" and not (top_k == 2 and 0 <= jitter_eps < float("inf")):
        raise ValueError(f"sparsemixer selects 2 experts with a finite jitter_eps >= 0, got top_k={top_k}, "
                         f"jitter_eps={jitter_eps}")
    if method.endswith("group_topk"):
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int, top2: bool) -> torch.Tensor:
    """[T, E] bool: experts whose group is among the ``topk_group`` best groups of ``choice``."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    if top2:  # DeepSeek-V3: a group scores the sum of its two best experts
        group_scores = grouped.topk(min(2, E // n_group), dim=-1)[0].sum(dim=-1)
    else:  # DeepSeek-V2 group_limited_greedy: a group scores its best expert
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    return group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E).bool()


def route(logits: torch.Tensor, bias: torch.Tensor | None, *, method: str, top_k: int, renormalize: bool,
          scale: float, n_group: int = 1, topk_group: int = 1,
          jitter_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k]). ``bias`` [E] (DeepSeek-V3 score correction)."""
    check_route_args(logits.shape[-1], method, top_k, n_group, topk_group, jitter_eps)
    logits = logits.float()
    if method == "softmax_topk":
        weights, ids = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif method == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = top.softmax(dim=-1)  # already sums to 1: renormalize is a no-op
    elif method in ("sigmoid_group_topk", "softmax_bias_topk", "sqrtsoftplus_bias_topk"):
        scores = (logits.sigmoid() if method == "sigmoid_group_topk" else logits.softmax(dim=-1)
                  if method == "softmax_bias_topk" else F.softplus(logits).sqrt())
        choice = scores + bias.float().reshape(-1) if bias is not None else scores
        if method == "sigmoid_group_topk":
            keep = _group_mask(choice, n_group, topk_group, top2=True)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif method == "sigmoid_logit_bias_topk":
        choice = logits + bias.float().reshape(-1) if bias is not None else logits
        ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
        weights = logits.sigmoid().gather(1, ids)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif method == "sparsemixer":
        weights, ids = _sparsemixer(logits, top_k, jitter_eps)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:  # softmax_group_topk
        probs = logits.softmax(dim=-1)
        keep = _group_mask(probs, n_group, topk_group, top2=False)
        probs = probs.masked_fill(~keep, 0.0)
        weights, ids = torch.topk(probs, top_k, dim=-1, sorted=False)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale, ids.to(torch.int32)


def _sparsemixer(logits: torch.Tensor, top_k: int, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    avail = torch.ones_like(logits, dtype=torch.bool)
    weights, ids = [], []
    for _ in range(top_k):
        m, i = logits.masked_fill(~avail, float("-inf")).max(dim=-1, keepdim=True)
        # 0 / 0 (a zero logit at a zero maximum) is NaN and compares False: kept, as in HF
        far = (m - logits) / logits.abs().clamp(min=m) > 2 * jitter_eps
        keep = avail & ~far
        weights.append(1.0 / torch.where(keep, torch.exp(logits - m), 0.0).sum(dim=-1, keepdim=True))
        ids.append(i)
        avail = avail.scatter(1, i, False)
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


def activation_fn(name: str):
    """act(x) of the elementwise activations (the ``COMBINED`` ones combine gate and up: ``glu``)."""
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_tanh":
        return lambda v: F.gelu(v, approximate="tanh")
    if name == "relu":
        return F.relu
    if name == "relu2":
        return lambda v: F.relu(v).square()
    raise ValueError(f"unknown MoE activation {name!r}; expected one of {ACTIVATIONS}")


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """The gated experts' product of gate and up (fp32 in, fp32 out)."""
    if activation == "swiglu_clamp":
        g = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * g * torch.sigmoid(g * alpha)
    if activation == "swiglu_softcap":
        return alpha * torch.tanh(gate / alpha) * torch.sigmoid(gate) * limit * torch.tanh(up / limit)
    if activation == "swiglu_limit":
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    return activation_fn(activation)(gate) * up


def split_gate_up(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[.., 2I] -> gate [.., I], up [.., I] (concatenated [gate; up] or interleaved g0 u0 g1 u1 ...)."""
    if interleaved:
        return h[..., 0::2], h[..., 1::2]
    return h.chunk(2, dim=-1)


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
            gated: bool, interleaved: bool, activation: str, b13: torch.Tensor | None = None,
            b2: torch.Tensor | None = None, alpha: float = 1.0, limit: float = float("inf")) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gated) or [E, I, H], w2 [E, H, I], weights [T, k], ids [T, k] -> [T, H] x.dtype;
    optional biases b13 [E, 2I | I] (before the activation) and b2 [E, H] (before the routing weight).

    Dense over experts: every expert runs on every token and a per-token coefficient (the routing weight, or 0)
    selects. E/k times the FLOPs of a sparse loop, but shape-static (the CPU fallback and the fake impl)."""
    E = w13.shape[0]
    xf = x.float()
    wf = weights.float()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in range(E):
        coef = (wf * (ids == e)).sum(dim=-1, keepdim=True)  # [T, 1]
        h = xf @ w13[e].float().t()
        if b13 is not None:
            h = h + b13[e].float()
        if gated:
            a = glu(*split_gate_up(h, interleaved), activation, alpha, limit)
        else:
            a = activation_fn(activation)(h)
        y = a @ w2[e].float().t()
        if b2 is not None:
            y = y + b2[e].float()
        out = out + coef * y
    return out.to(x.dtype)


def router_logits(x: torch.Tensor, router_w: torch.Tensor, router_fp32: bool,
                  logit_bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [T, E]: in fp32 (DeepSeek) or in x.dtype then widened (Mixtral, Qwen3Moe, Jamba); ``logit_bias`` [E]: a
    router whose linear has a bias (gpt-oss)."""
    if router_fp32:
        return F.linear(x.float(), router_w.float(), None if logit_bias is None else logit_bias.float())
    return F.linear(x, router_w.to(x.dtype), None if logit_bias is None else logit_bias.to(x.dtype)).float()


def moe(x: torch.Tensor, router_w: torch.Tensor, router_bias: torch.Tensor | None, w13: torch.Tensor,
        w2: torch.Tensor, *, method: str, top_k: int, renormalize: bool, scale: float, n_group: int,
        topk_group: int, gated: bool, interleaved: bool, activation: str, router_fp32: bool, jitter_eps: float = 0.0,
        router_logit_bias: torch.Tensor | None = None, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
        alpha: float = 1.0, limit: float = float("inf")) -> torch.Tensor:
    """Routed experts of one MoE block: x [T, H] -> [T, H] (shared experts are not part of it)."""
    logits = router_logits(x, router_w, router_fp32, router_logit_bias)
    weights, ids = route(logits, router_bias, method=method, top_k=top_k, renormalize=renormalize, scale=scale,
                         n_group=n_group, topk_group=topk_group, jitter_eps=jitter_eps)
    return experts(x, w13, w2, weights, ids, gated=gated, interleaved=interleaved, activation=activation, b13=b13,
                   b2=b2, alpha=alpha, limit=limit)
