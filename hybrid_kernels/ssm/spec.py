"""What a Mamba mixer op needs besides its activations: the weights (one named tuple per mixer kind) and the
static sizes and constants (one frozen spec per mixer kind). A spec builds the positional arguments of every op of
its kind, in schema order, from whatever the weights are: live tensors (a probe, a test) or graph nodes (a pass).
The order is written here and in the op signatures in ops.py, nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class Mamba1Weights(NamedTuple):
    in_proj_w: Any
    in_proj_b: Any
    conv_w: Any
    conv_b: Any
    x_proj_w: Any
    dt_proj_w: Any
    dt_proj_b: Any
    A_log: Any
    D: Any
    out_proj_w: Any
    out_proj_b: Any
    dt_norm_w: Any = None  # scales of the RMSNorms of dt / B / C (Jamba style); None: unit scale
    b_norm_w: Any = None
    c_norm_w: Any = None


@dataclass(frozen=True)
class Mamba1Spec:
    """``hybrid::mamba_mixer`` (prefill) and ``hybrid::mamba_mixer_step`` (decode)."""
    norm_eps: float = 1e-6
    bcdt_norm: bool = False  # dt, B and C are RMS-normalised (Jamba, FalconMamba); Mamba1 itself has no norms

    def prefill_args(self, hidden, mask, w: Mamba1Weights, state_width: int) -> tuple:
        return (hidden, mask, *w, float(self.norm_eps), bool(self.bcdt_norm), int(state_width))

    def step_args(self, hidden, mask, w: Mamba1Weights, conv_state, ssm_state) -> tuple:
        return (hidden, mask, *w, float(self.norm_eps), bool(self.bcdt_norm), conv_state, ssm_state)


class Mamba2Weights(NamedTuple):
    in_proj_w: Any
    in_proj_b: Any
    conv_w: Any
    conv_b: Any
    dt_bias: Any
    A_log: Any
    D: Any
    norm_w: Any              # the gated RMSNorm's weight; None: no norm, the output is gated as y * silu(z)
    out_proj_w: Any
    out_proj_b: Any
    proj_mult: Any = None    # per-channel multipliers of the in projection's output (Falcon-H1's mup_vector)


@dataclass(frozen=True)
class Mamba2Spec:
    """``hybrid::mamba2_mixer`` (prefill), ``hybrid::mamba2_mixer_chunk`` (a prefill chunk continuing from cached
    states), ``hybrid::mamba2_mixer_step`` (decode) and ``hybrid::mamba2_mixer_packed`` (several sequences on one
    axis, each on its own state row: the engine's packed steps). ``norm_group``: the gated norm's group size; ``dt_min`` /
    ``dt_max``: the time-step limit the prefill clamps dt to (HF's decode does not clamp); ``in_mult``: a multiplier
    of the mixer's input (Falcon-H1's ssm_in_multiplier)."""
    head_dim: int
    groups: int
    chunk_size: int
    eps: float
    norm_group: int
    dt_min: float = 0.0
    dt_max: float = float("inf")
    in_mult: float = 1.0

    def _core(self) -> tuple:
        return int(self.head_dim), int(self.groups), float(self.in_mult)

    def prefill_args(self, hidden, mask, w: Mamba2Weights, state_width: int) -> tuple:
        return (hidden, mask, *w, *self._core(), int(self.chunk_size), float(self.eps), int(self.norm_group),
                float(self.dt_min), float(self.dt_max), int(state_width))

    def chunk_args(self, hidden, mask, w: Mamba2Weights, conv_state, ssm_state) -> tuple:
        return (hidden, mask, *w, *self._core(), int(self.chunk_size), float(self.eps), int(self.norm_group),
                float(self.dt_min), float(self.dt_max), conv_state, ssm_state)

    def step_args(self, hidden, mask, w: Mamba2Weights, conv_state, ssm_state) -> tuple:
        return (hidden, mask, *w, *self._core(), float(self.eps), int(self.norm_group), conv_state, ssm_state)

    def packed_args(self, hidden, w: Mamba2Weights, conv_buf, ssm_buf, seqs, dec_tokens, dec_rows) -> tuple:
        return (hidden, *w, *self._core(), int(self.chunk_size), float(self.eps), int(self.norm_group),
                float(self.dt_min), float(self.dt_max), conv_buf, ssm_buf, seqs, dec_tokens, dec_rows)
