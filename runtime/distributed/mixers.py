"""Tensor parallelism of SSM and delta-rule mixers: the heads split over the ranks (Mamba2-style mixers here; Qwen3-Next's
Gated DeltaNet in ``shard_gated_deltanet``).

A Mamba2 mixer (HF's Mamba2, Bamba, NemotronH, ...) projects the hidden state into
[z (I) | x (I) | B (G N) | C (G N) | dt (H)] with I = H * head_dim, runs a depthwise causal conv over [x | B | C], the
scan per head (dt_bias, A_log, D per head; B and C shared by the heads of a group), a gated RMSNorm over groups of
I / G channels and the out projection. ``shard_mamba2`` keeps rank r's heads: their rows of z, x and dt, their conv
channels and per-head parameters, their norm weights and out-projection columns; B and C by group when the G groups
split evenly over the ranks (a rank's heads are then exactly its groups' heads), else whole on every rank when G is 1.
The norm works on its groups locally when they split; one group over all I channels (G = 1) becomes
``ShardedGatedNorm``: the sum of squares all-reduced over the ranks. The mixer's output is a partial sum (the caller
wraps it in ``AllReduced``), and its cache holds the rank's heads only: conv and SSM states split with the heads.
A mixer holding tensors of its own beyond these (FalconH1's muP vector) or another norm stays whole, saying why.

Imports nothing of this folder but collectives.py; tensor_parallel.py calls it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import all_reduce


class ShardedGatedNorm(nn.Module):
    """HF's gated RMSNorm of one group over channels split across ranks: y = x * silu(gate), then
    y * rsqrt(mean over all ranks' channels of y^2 + eps) * weight (this rank's weights)."""

    def __init__(self, weight: torch.Tensor, eps: float, width: int, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps
        self.width = width  # the channels of every rank together
        self.group = group

    def forward(self, hidden_states, gate=None):
        dtype = hidden_states.dtype
        x = hidden_states.float()
        if gate is not None:
            x = x * F.silu(gate.float())
        variance = all_reduce(x.pow(2).sum(-1, keepdim=True), self.group) / self.width
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


def _param(t: torch.Tensor, idx: torch.Tensor, dim: int = 0) -> nn.Parameter:
    return nn.Parameter(t.data.index_select(dim, idx.to(t.device)).clone(), requires_grad=False)


def _only_known_tensors(m: nn.Module, known: tuple[str, ...]) -> None:
    """ValueError when the mixer holds a parameter or buffer of its own that the split does not slice."""
    other = [n for n, _ in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)] if n not in known]
    if other:
        raise ValueError(f"it holds {', '.join(other[:3])}, which the head split does not slice")


def shard_mamba2(m: nn.Module, rank: int, world: int, group) -> str:
    """Keep rank's heads of the Mamba2-style mixer ``m`` (in place); ValueError naming what does not split."""
    need = ("in_proj", "conv1d", "out_proj", "dt_bias", "A_log", "D", "norm", "num_heads", "head_dim", "n_groups",
            "ssm_state_size", "intermediate_size", "conv_dim")
    missing = [n for n in need if not hasattr(m, n)]
    if missing:
        raise ValueError(f"not a Mamba2-style mixer (no {', '.join(missing[:3])})")
    _only_known_tensors(m, ("dt_bias", "A_log", "D"))
    if not isinstance(getattr(m.norm, "weight", None), torch.Tensor) or m.norm.weight.dim() != 1:
        raise ValueError(f"its norm ({type(m.norm).__name__}) is not a gated RMSNorm with one weight per channel")
    H, P, G, N, I = m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size, m.intermediate_size
    if m.A_log.dim() != 1 or I != H * P or m.conv_dim != I + 2 * G * N:
        raise ValueError("widths unlike Mamba2's (I = heads x head_dim, conv over x, B, C; one A per head)")
    if m.in_proj.out_features != I + m.conv_dim + H:
        raise ValueError(f"in_proj gives {m.in_proj.out_features} rows, not z, x, B, C, dt ({I + m.conv_dim + H})")
    if H % world:
        raise ValueError(f"{H} heads do not split over {world} ranks")
    norm_groups = I // getattr(m.norm, "group_size", I)
    split_groups = G % world == 0 and norm_groups == G
    if not split_groups and not (G == 1 and norm_groups == 1):
        raise ValueError(f"{G} head groups (norm over {norm_groups}) neither split over {world} ranks nor are one")
    h = torch.arange(rank * H // world, (rank + 1) * H // world)
    chan = (h[:, None] * P + torch.arange(P)).flatten()  # the rank's channels of z / x / the norm / out_proj
    groups = torch.arange(rank * G // world, (rank + 1) * G // world) if split_groups else torch.arange(G)
    bc = (groups[:, None] * N + torch.arange(N)).flatten()
    conv_idx = torch.cat([chan, I + bc, I + G * N + bc])  # within [x | B | C]
    proj_idx = torch.cat([chan, I + conv_idx, I + m.conv_dim + h])
    m.in_proj.weight = _param(m.in_proj.weight, proj_idx)
    if m.in_proj.bias is not None:
        m.in_proj.bias = _param(m.in_proj.bias, proj_idx)
    m.in_proj.out_features = len(proj_idx)
    m.conv1d.weight = _param(m.conv1d.weight, conv_idx)
    if m.conv1d.bias is not None:
        m.conv1d.bias = _param(m.conv1d.bias, conv_idx)
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = len(conv_idx)
    for name in ("dt_bias", "A_log", "D"):
        setattr(m, name, _param(getattr(m, name), h))
    m.out_proj.weight = _param(m.out_proj.weight, chan, dim=1)
    if m.out_proj.bias is not None and rank != 0:  # added once, by rank 0: the ranks' outputs are summed
        m.out_proj.bias = nn.Parameter(torch.zeros_like(m.out_proj.bias.data), requires_grad=False)
    m.out_proj.in_features = len(chan)
    if split_groups:
        m.norm.weight = _param(m.norm.weight, chan)
        norm = "norm groups split"
    else:
        eps = float(getattr(m.norm, "variance_epsilon", getattr(m.norm, "eps", 1e-6)))
        m.norm = ShardedGatedNorm(m.norm.weight.data.index_select(0, chan.to(m.norm.weight.device)).clone(), eps, I,
                                  group)
        norm = "one norm group: its sum of squares all-reduced"
    m.num_heads, m.intermediate_size = len(h), len(chan)
    m.n_groups = len(groups)
    m.conv_dim = len(conv_idx)
    return (f"{len(h)} of {H} heads per rank, B / C {'by group' if split_groups else 'replicated'} ({G} groups), "
            f"{norm}")


def shard_gated_deltanet(m: nn.Module, rank: int, world: int) -> str:
    """Keep rank's key heads, with their value heads, of a Gated DeltaNet mixer (Qwen3-Next's layout: ``in_proj_qkvz``
    rows grouped per key head as [q | k | v of its value heads | z of them], ``in_proj_ba`` as [b | a] per key head,
    the conv over [q | k | v], ``A_log`` / ``dt_bias`` per value head, a gated norm per value head). ValueError
    naming what does not split."""
    need = ("in_proj_qkvz", "in_proj_ba", "conv1d", "out_proj", "A_log", "dt_bias", "num_k_heads", "num_v_heads",
            "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_dim")
    missing = [n for n in need if not hasattr(m, n)]
    if missing:
        raise ValueError(f"not a Gated DeltaNet mixer of Qwen3-Next's layout (no {', '.join(missing[:3])})")
    HK, HV, DK, DV = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    if HV % HK or m.key_dim != HK * DK or m.value_dim != HV * DV or m.conv_dim != 2 * m.key_dim + m.value_dim:
        raise ValueError("widths unlike Qwen3-Next's Gated DeltaNet")
    if m.in_proj_qkvz.out_features != 2 * m.key_dim + 2 * m.value_dim or m.in_proj_ba.out_features != 2 * HV:
        raise ValueError("in_proj_qkvz / in_proj_ba rows unlike [q | k | v | z] and [b | a] per key head")
    _only_known_tensors(m, ("A_log", "dt_bias"))
    if not isinstance(getattr(getattr(m, "norm", None), "weight", None), torch.Tensor) or m.norm.weight.numel() != DV:
        raise ValueError("its gated norm is not one per value head")
    if HK % world:
        raise ValueError(f"{HK} key heads do not split over {world} ranks")
    rep = HV // HK
    kh = torch.arange(rank * HK // world, (rank + 1) * HK // world)
    vh = (kh[:, None] * rep + torch.arange(rep)).flatten()
    per = 2 * DK + 2 * rep * DV  # rows of one key head in in_proj_qkvz
    qkvz = (kh[:, None] * per + torch.arange(per)).flatten()
    ba = (kh[:, None] * 2 * rep + torch.arange(2 * rep)).flatten()
    kc = (kh[:, None] * DK + torch.arange(DK)).flatten()
    vc = (vh[:, None] * DV + torch.arange(DV)).flatten()
    conv_idx = torch.cat([kc, m.key_dim + kc, 2 * m.key_dim + vc])
    for lin, idx in ((m.in_proj_qkvz, qkvz), (m.in_proj_ba, ba)):
        lin.weight = _param(lin.weight, idx)
        if lin.bias is not None:
            lin.bias = _param(lin.bias, idx)
        lin.out_features = len(idx)
    m.conv1d.weight = _param(m.conv1d.weight, conv_idx)
    if m.conv1d.bias is not None:
        m.conv1d.bias = _param(m.conv1d.bias, conv_idx)
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = len(conv_idx)
    m.A_log, m.dt_bias = _param(m.A_log, vh), _param(m.dt_bias, vh)
    m.out_proj.weight = _param(m.out_proj.weight, vc, dim=1)
    if m.out_proj.bias is not None and rank != 0:
        m.out_proj.bias = nn.Parameter(torch.zeros_like(m.out_proj.bias.data), requires_grad=False)
    m.out_proj.in_features = len(vc)
    m.num_k_heads, m.num_v_heads = len(kh), len(vh)
    m.key_dim, m.value_dim, m.conv_dim = len(kc), len(vc), len(conv_idx)
    return f"{len(kh)} of {HK} key heads ({len(vh)} of {HV} value heads) per rank"
