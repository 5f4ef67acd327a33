"""Map FX nodes to the live nn.Modules that produced them, and classify modules by what they hold.

Dynamo tags every node with ``meta["nn_module_stack"] = {str(id(module)): (path, class)}``, outermost
first. The ids point at live modules while the model is being compiled; :class:`ModuleIndex` resolves
them (checking the recorded class) so passes can read parameters, shapes and config values.

Classification never looks at class names (they differ across families and versions): a module is an
MLA attention, a Mamba1 / Mamba2 mixer or an MoE block by the parameters and children it holds.
"""
from __future__ import annotations

import gc
import re
from dataclasses import dataclass

import torch
from torch import fx, nn

MLA, SSM, MOE, DELTA = "mla", "ssm", "moe", "delta"


def clean_path(dynamo_path: str) -> str:
    """``"L['self'].model.layers[0].mlp"`` -> ``"model.layers.0.mlp"`` (the ``named_modules`` name)."""
    path = re.sub(r"^L\['[^']*'\](\[\d+\])?\.?", "", dynamo_path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    parts = [p for p in path.split(".") if p and p not in ("_modules", "_parameters", "_buffers")]
    return ".".join(parts)


def node_module_keys(node: fx.Node) -> list[str]:
    """Module ids on the node's stack, outermost first."""
    return list((node.meta.get("nn_module_stack") or {}).keys())


@dataclass
class ModuleRecord:
    key: str
    path: str
    cls: type
    module: nn.Module | None


class ModuleIndex:
    """Resolves the module ids found in a graph's ``nn_module_stack`` metadata to live modules."""

    def __init__(self, gm: fx.GraphModule):
        self.records: dict[str, ModuleRecord] = {}
        for node in gm.graph.nodes:
            for key, (path, cls) in (node.meta.get("nn_module_stack") or {}).items():
                if key not in self.records:
                    self.records[key] = ModuleRecord(key, clean_path(str(path)), cls, None)
        self._resolve()

    def _resolve(self) -> None:
        wanted = {int(k): k for k in self.records if k.isdigit()}
        if not wanted:
            return
        # The modules are alive (the model is being traced); gc gives them back without unsafe casts.
        for obj in gc.get_objects():
            key = wanted.get(id(obj))
            if key is not None and isinstance(obj, nn.Module):
                rec = self.records[key]
                if isinstance(obj, rec.cls) or type(obj).__name__ == getattr(rec.cls, "__name__", None):
                    rec.module = obj

    def module(self, key: str) -> nn.Module | None:
        rec = self.records.get(key)
        return rec.module if rec else None

    def __iter__(self):
        return iter(self.records.values())


# --------------------------------------------------------------------------------------------------
# Classification by parameters and children
# --------------------------------------------------------------------------------------------------

def _direct_params(module: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters(recurse=False))
    out.update(dict(module.named_buffers(recurse=False)))
    return out


def _has_weight(module: nn.Module | None) -> bool:
    return module is not None and isinstance(getattr(module, "weight", None), torch.Tensor)


def is_mla_attention(m: nn.Module) -> bool:
    """DeepSeek-style multi-head latent attention: latent down-projection, its norm and up-projection."""
    children = dict(m.named_children())
    if not all(_has_weight(children.get(n)) for n in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")):
        return False
    has_q = _has_weight(children.get("q_proj")) or (
        _has_weight(children.get("q_a_proj")) and _has_weight(children.get("q_b_proj")))
    return has_q


def experts_weights(m: nn.Module) -> dict[str, torch.Tensor] | None:
    """The 3-D expert weights of an experts container ({name: [E, out, in]}), or None."""
    params = {n: p for n, p in m.named_parameters(recurse=False) if p.dim() == 3}
    if "down_proj" not in params or not ({"gate_up_proj", "up_proj"} & params.keys()):
        return None
    if len({p.shape[0] for p in params.values()}) != 1:
        return None
    return params


def router_linear(m: nn.Module, num_experts: int, hidden: int) -> nn.Module | None:
    """The module that holds a router's one 2-D weight [E, H]: the router itself (a bare Parameter or a Linear) or
    its only such child (a router that wraps its linear, e.g. ``router.gate``), else None."""
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and tuple(w.shape) == (num_experts, hidden):
        return m
    found = [c for c in m.children() if isinstance(getattr(c, "weight", None), torch.Tensor)
             and tuple(c.weight.shape) == (num_experts, hidden)]
    return found[0] if len(found) == 1 else None


def router_weight(m: nn.Module, num_experts: int, hidden: int) -> torch.Tensor | None:
    """A router holds one 2-D weight [E, H] (a bare Parameter, a Linear's weight, or its linear child's)."""
    lin = router_linear(m, num_experts, hidden)
    return None if lin is None else lin.weight


def moe_parts(m: nn.Module) -> tuple[str, str] | None:
    """(router child name, experts child name) when ``m`` is an MoE block, else None."""
    experts = [(n, c) for n, c in m.named_children() if experts_weights(c) is not None]
    if len(experts) != 1:
        return None
    ename, emod = experts[0]
    w = experts_weights(emod)
    num_experts, hidden = w["down_proj"].shape[0], w["down_proj"].shape[1]
    if getattr(emod, "is_transposed", False):
        hidden = w["down_proj"].shape[2]
    routers = [n for n, c in m.named_children() if router_weight(c, num_experts, hidden) is not None]
    if len(routers) != 1:
        return None
    return routers[0], ename


def split_moe_layouts(m: nn.Module) -> list[tuple[str, str, str, str | None]]:
    """(router child, gate-up child, down child, bias parameter) for each way ``m`` reads as an MoE block whose experts
    are split over two modules of one 3-D ``weight`` each (JetMoE's ``input_linear`` [E, 2I | I, H] and
    ``output_linear`` [E, H, I]) beside one router [E, H], with at most a bias [H] of its own (added after the sum);
    [] otherwise. Both orders are listed where the shapes allow both (H = I): a probe of the live block decides."""
    split = {n: dict(c.named_parameters()) for n, c in m.named_children()}
    split = {n: ps["weight"] for n, ps in split.items() if list(ps) == ["weight"] and ps["weight"].dim() == 3}
    own = dict(m.named_parameters(recurse=False))
    if len(split) != 2 or len(own) > 1:
        return []
    (a, wa), (b, wb) = split.items()
    found = []
    for up, wu, down, wd in ((a, wa, b, wb), (b, wb, a, wa)):
        e, h, i = wd.shape
        if wu.shape[0] != e or wu.shape[2] != h or wu.shape[1] not in (i, 2 * i):
            continue
        routers = [n for n, c in m.named_children() if n not in split and router_weight(c, e, h) is not None]
        if len(routers) == 1 and all(tuple(p.shape) == (h,) for p in own.values()):
            found.append((routers[0], up, down, next(iter(own), None)))
    return found


def is_moe_block(m: nn.Module) -> bool:
    return moe_parts(m) is not None


def is_mamba1_mixer(m: nn.Module) -> bool:
    p = _direct_params(m)
    a, d = p.get("A_log"), p.get("D")
    children = dict(m.named_children())
    return (a is not None and a.dim() == 2 and d is not None and d.dim() == 1 and d.shape[0] == a.shape[0]
            and all(_has_weight(children.get(n)) for n in ("x_proj", "dt_proj", "conv1d", "in_proj", "out_proj")))


def mamba2_dims(m: nn.Module) -> dict[str, int] | None:
    """Sizes of a Mamba2 / SSD mixer, derived from its weights and checked against each other.

    A gated delta-net layer also holds ``A_log``, ``dt_bias`` and a conv1d, but it has no per-head ``D``
    and its in_proj width does not decompose as ``z + (x, B, C) + dt``: it is rejected here. The gated norm may hold
    no weight (Falcon-H1 without ``mamba_rms_norm``: y * silu(z)); the SSM pass's probe proves the math either way.
    """
    p = _direct_params(m)
    children = dict(m.named_children())
    a, d, dt_bias = p.get("A_log"), p.get("D"), p.get("dt_bias")
    if a is None or a.dim() != 1 or d is None or dt_bias is None:
        return None
    heads = a.shape[0]
    if d.shape != (heads,) or dt_bias.shape != (heads,):
        return None
    if not all(_has_weight(children.get(n)) for n in ("conv1d", "in_proj", "out_proj")) or "norm" not in children:
        return None
    conv_w = children["conv1d"].weight  # [C, 1, K] depthwise
    if conv_w.dim() != 3 or conv_w.shape[1] != 1:
        return None
    conv_dim, kernel = conv_w.shape[0], conv_w.shape[2]
    d_inner = children["out_proj"].weight.shape[1]
    groups = int(getattr(m, "n_groups", 0) or 0)
    if groups <= 0 or (conv_dim - d_inner) % (2 * groups) != 0:
        return None
    state = (conv_dim - d_inner) // (2 * groups)
    if children["in_proj"].weight.shape[0] != d_inner + conv_dim + heads or d_inner % heads != 0:
        return None
    norm_w = getattr(children["norm"], "weight", None)
    if norm_w is not None and tuple(norm_w.shape) != (d_inner,):
        return None
    return dict(heads=heads, head_dim=d_inner // heads, d_inner=d_inner, groups=groups, state=state,
                conv_dim=conv_dim, kernel=kernel)


def is_mamba2_mixer(m: nn.Module) -> bool:
    return mamba2_dims(m) is not None


def _named_param(m: nn.Module, name: str, depth: int = 2) -> torch.Tensor | None:
    """Parameter ``name`` of ``m`` or of a submodule at most ``depth`` levels down (Kimi keeps its decay
    parameters in a forget-gate child)."""
    for path, t in m.named_parameters():
        parts = path.split(".")
        if parts[-1] == name and len(parts) <= depth + 1:
            return t
    return None


def is_delta_mixer(m: nn.Module) -> bool:
    """A gated delta-rule mixer (Gated DeltaNet, Kimi Delta Attention): a depthwise short conv over q/k/v, a decay
    parametrised by ``A_log`` and ``dt_bias`` (on the mixer or a gate submodule), and no per-head ``D`` skip, which
    every Mamba2 mixer has (it holds ``A_log``, ``dt_bias``, a conv and a gated norm too)."""
    conv = getattr(m, "conv1d", None)
    if not isinstance(conv, nn.Conv1d) or conv.groups != conv.in_channels or conv.in_channels < 3:
        return False
    if "D" in _direct_params(m) or is_mamba1_mixer(m):
        return False
    return _named_param(m, "A_log") is not None and _named_param(m, "dt_bias") is not None


def classify(m: nn.Module | None) -> str | None:
    """The region kind a module is a candidate for ("mla", "ssm", "delta", "moe") or None."""
    if m is None:
        return None
    if is_mla_attention(m):
        return MLA
    if is_mamba1_mixer(m) or is_mamba2_mixer(m):
        return SSM
    if is_delta_mixer(m):
        return DELTA
    if is_moe_block(m):
        return MOE
    return None


def param_placeholders(gm: fx.GraphModule, example_inputs) -> dict[int, fx.Node]:
    """id(parameter or buffer tensor) -> the graph node that carries it (placeholder or get_attr)."""
    out: dict[int, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor):
            out.setdefault(id(value), node)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                value = gm.get_parameter(node.target) if "." in node.target else getattr(gm, node.target)
            except AttributeError:
                continue
            if isinstance(value, torch.Tensor):
                out.setdefault(id(value), node)
    return out
