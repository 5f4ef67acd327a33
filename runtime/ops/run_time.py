"""Run-time twins of the hybrid ops whose launch configs depend on the token count.

``hybrid::moe_block``, ``hybrid::moe_experts``, ``hybrid::mla_attention``, ``hybrid::mla_attention_paged``,
``hybrid::mla_decode_step`` and ``hybrid::selective_scan`` are triton_ops: torch.compile traces their bodies, so
each launch-config choice (MoE token bucket, MLA split count, absorbed vs expanded path, the scan's chunking) is
made on the symbolic size and becomes a guard. A graph with a dynamic batch then recompiles whenever the batch crosses
a bucket boundary (10-30 s on the H200 for the realistic-width zoo models).

Each twin ``hybrid::<name>_rt`` has the same schema, a shape-only fake implementation (no branch on sizes,
so no guard) and a real implementation that calls the traced op eagerly: the config is picked from the
concrete shapes of each call. Inductor sees an opaque call; CUDA graphs record it like any other kernel
launch. The engine asks for them (``options={"run_time_configs": True}``); the default keeps the traced ops,
which AOT packages need. hybrid's HF experts implementation (passes/moe_eager.py) always calls
``hybrid::moe_experts_rt``, and its wrapper of HF's Mamba1 scan (passes/ssm_scan.py)
``hybrid::selective_scan_rt``: they run inside the model code, so dynamo would trace the traced op's body
(and guard on the token count or length) before any pass could retarget it.
"""
from __future__ import annotations

import torch

from .library import NAMESPACE

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
#: traced op overload -> its run-time twin
TWINS: dict = {}


def _define_twin(op, fake) -> None:
    name = op._schema.name.split("::", 1)[1] + "_rt"
    signature = str(op._schema).split("(", 1)[1]
    _lib.define(f"{name}({signature}")

    def impl(*args):
        # contiguous: the fake promises fresh contiguous tensors (SDPA may return a transposed layout)
        out = op(*args)
        return tuple(t.contiguous() for t in out) if isinstance(out, (tuple, list)) else out.contiguous()

    for key in ("CPU", "CUDA"):
        _lib.impl(name, impl, key)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_lib)
    TWINS[op] = getattr(getattr(torch.ops, NAMESPACE), name).default


def _same_as_x_fake(x, *args):
    return x.new_empty(x.shape)


def _mla_attention_fake(q_nope, q_rope, latent, k_rope, kv_b_weight, *args):
    b, h, t, p = q_nope.shape
    v = kv_b_weight.shape[0] // h - p
    return q_nope.new_empty((b, h, t, v))


def _mla_attention_paged_fake(q_nope, q_rope, buf, block_table, seq_lens, kv_b_weight, *args):
    return _mla_attention_fake(q_nope, q_rope, None, None, kv_b_weight)


def _mla_decode_step_fake(q_nope, q_rope, kv, norm_weight, k_rope, buf, write_slots, block_table, seq_lens,
                          kv_b_weight, *args):
    return _mla_attention_fake(q_nope, q_rope, None, None, kv_b_weight)


def _selective_scan_fake(u, delta, A, *args):
    b, d, _ = u.shape
    return u.new_empty(u.shape), u.new_empty((b, d, A.shape[-1]), dtype=torch.float32)


def register() -> None:
    from .mla import dropin, paged  # noqa: F401  (registers the traced ops)
    from .moe import block  # noqa: F401
    from .ssm import ops  # noqa: F401
    if TWINS:
        return
    _define_twin(torch.ops.hybrid.moe_block.default, _same_as_x_fake)
    _define_twin(torch.ops.hybrid.moe_experts.default, _same_as_x_fake)
    _define_twin(torch.ops.hybrid.mla_attention.default, _mla_attention_fake)
    _define_twin(torch.ops.hybrid.mla_attention_paged.default, _mla_attention_paged_fake)
    _define_twin(torch.ops.hybrid.mla_decode_step.default, _mla_decode_step_fake)
    _define_twin(torch.ops.hybrid.selective_scan.default, _selective_scan_fake)
