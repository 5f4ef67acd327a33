"""hybrid::moe*: Triton kernels vs the torch reference, the reference vs a per-token loop and vs the real HF blocks,
the ops through torch.library / torch.compile. CPU: Triton runs in the interpreter (conftest), fp32 (+ fp16)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from hybrid_kernels.moe import ops, reference
from hybrid_kernels.moe.spec import ExpertsSpec, MoESpec, MoEWeights, RouteSpec
from hybrid_kernels.moe import triton_common as common, triton_experts as experts, triton_routing as routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[2]


def randn(*shape, scale=1.0, dtype=torch.float32, device=DEV):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def random_ids(T, k, E, pattern="random", device=DEV):
    """[T, k] distinct expert ids per token. "unused": only experts 1, 3, 4 (+5 when k > 3); "one": k=1, all on 3."""
    if pattern == "one":
        assert k == 1
        return torch.full((T, 1), 3, dtype=torch.int32, device=device)
    pool = list(range(E)) if pattern == "random" else [1, 3, 4, 5][:max(3, k)]
    rows = [torch.tensor(pool)[torch.randperm(len(pool))[:k]] for _ in range(T)]
    return torch.stack(rows).to(device=device, dtype=torch.int32)


def sort_pairs(weights, ids):
    ids, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids


# ---------------------------------------------------------------------------------------------- routing
ROUTE_CASES = [  # T, E, top_k, n_group, topk_group, renormalize, scale
    (1, 6, 2, 2, 1, True, 1.0),
    (37, 10, 3, 5, 2, False, 2.5),
    (37, 6, 2, 3, 2, True, 1.5),
]


@pytest.mark.parametrize("method", [m for m in reference.METHODS if m != "sparsemixer"])
@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-g{c[3]}/{c[4]}")
def test_route_triton_matches_reference(method, case):
    T, E, k, n_group, topk_group, renorm, scale = case
    logits = randn(T, E, scale=2.0)
    bias = randn(E, scale=0.1)
    kw = dict(method=method, top_k=k, renormalize=renorm, scale=scale, n_group=n_group, topk_group=topk_group)
    ref_w, ref_i = sort_pairs(*reference.route(logits, bias, **kw))
    tri_w, tri_i = sort_pairs(*routing.route_triton(logits, bias, **kw))
    assert torch.equal(ref_i, tri_i)
    torch.testing.assert_close(tri_w, ref_w, rtol=1e-5, atol=1e-6)


def test_route_sqrtsoftplus_over_the_whole_softplus_range():
    """sqrt(softplus) scores from logits far below zero (where log1p matters) to above softplus's threshold (20)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.rand(41, 16, generator=g) * 70 - 40).to(DEV)
    kw = dict(method="sqrtsoftplus_bias_topk", top_k=4, renormalize=True, scale=1.5)
    ref_w, ref_i = sort_pairs(*reference.route(logits, None, **kw))
    tri_w, tri_i = sort_pairs(*routing.route_triton(logits, None, **kw))
    assert torch.equal(ref_i, tri_i)
    torch.testing.assert_close(tri_w, ref_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("T,E,offset,spread,eps", [(1, 16, 0.0, 2.0, 0.01), (37, 16, 8.0, 0.1, 0.01),
                                                  (70, 10, -3.0, 0.05, 0.01), (19, 6, 0.0, 1.0, 0.0)])
def test_sparsemixer_matches_hf(T, E, offset, spread, eps):
    """Phi-3.5-MoE's sparse-mixer selection (eval): HF's own function is the oracle of the reference and the Triton
    routing, and the launch that also aligns; logits near one common value put the relative gaps on both sides of
    the threshold; a zero logit at a zero maximum (0 / 0) is kept, as in HF."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer
    torch.manual_seed(T)
    logits = randn(T, E, scale=spread) + offset
    logits[0, :3] = 0.0
    logits[0, 3:] = -1.0
    hf_w, hf_i = sparsemixer(logits.cpu(), eps, False)
    kw = dict(method="sparsemixer", top_k=2, renormalize=False, scale=1.0, jitter_eps=eps)
    for w, i in (reference.route(logits, None, **kw), routing.route_triton(logits, None, **kw),
                 routing.route_align_triton(logits, None, **kw, n_group=1, topk_group=1, block_m=16)[:2]):
        assert torch.equal(i.long().cpu(), hf_i)
        torch.testing.assert_close(w.cpu(), hf_w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="sparsemixer selects 2 experts"):
        reference.route(logits, None, **{**kw, "top_k": 3})


def test_route_triton_bf16_logits_without_bias():
    logits = randn(5, 8, scale=2.0, dtype=torch.float16)
    kw = dict(method="sigmoid_group_topk", top_k=2, renormalize=True, scale=1.0, n_group=4, topk_group=2)
    ref = sort_pairs(*reference.route(logits, None, **kw))
    tri = sort_pairs(*routing.route_triton(logits, None, **kw))
    assert torch.equal(ref[1], tri[1])
    torch.testing.assert_close(tri[0], ref[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,wdtype,router_fp32", [(torch.float32, torch.float32, True),
                                                     (torch.bfloat16, torch.bfloat16, True),
                                                     (torch.bfloat16, torch.bfloat16, False),
                                                     (torch.bfloat16, torch.float32, True)])
@pytest.mark.parametrize("T,E,H", [(1, 64, 200), (3, 10, 600), (37, 10, 50), (17, 6, 130), (70, 10, 50)])
def test_router_logits_triton_matches_reference(T, E, H, dtype, wdtype, router_fp32, monkeypatch):
    """The router GEMM in Triton = reference.router_logits: fp32 logits, or rounded to x's dtype (one step of
    that dtype apart at most: another summation order). H crosses the K tiles, E is not a multiple of 16; T <= 4
    takes the matrix-vector kernel, and so do up to 64 tokens where the dot is exact fp32 (an fp32 model, or
    transformers 5.24's fp32 router weight under a bf16 model)."""
    launched = []
    launch = common.launch
    monkeypatch.setattr(common, "launch", lambda k: launched.append(k.fn.__name__) or launch(k))
    x = randn(T, H, dtype=dtype)
    w = randn(E, H, scale=H ** -0.5, dtype=wdtype)
    got = routing.router_logits_triton(x, w, router_fp32)
    fp32_dot = router_fp32 and (dtype == torch.float32 or wdtype != dtype)
    assert launched == ["_router_gemv_kernel" if T <= 4 or (fp32_dot and T <= 64) else "_router_gemm_kernel"]
    want = reference.router_logits(x, w, router_fp32)
    assert got.dtype == torch.float32 and got.shape == (T, E)
    tol = dict(rtol=1e-5, atol=1e-5) if router_fp32 else dict(rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    if not router_fp32:  # the values are x.dtype values
        assert torch.equal(got, got.to(dtype).float())
    assert routing.use_router_gemm(1, 64, 2048) and not routing.use_router_gemm(4096, 64, 2048)
    assert not routing.use_router_gemm(1, 256, 7168)  # DeepSeek-V3's router (3.7 MB) keeps cuBLAS


# ---------------------------------------------------------------------------------------------- alignment
ALIGN_CASES = [  # T, k, E, block_m, pattern, path
    (1, 2, 6, 16, "random", None),
    (37, 2, 6, 16, "random", "single"),
    (37, 3, 10, 4, "unused", "single"),
    (37, 1, 6, 16, "one", None),
    (37, 1, 6, 4, "one", "multi"),
    (300, 2, 6, 16, "unused", "multi"),
    (1000, 2, 200, 16, "random", "multi"),  # many chunks, two passes of the offsets loop
]


@pytest.mark.parametrize("case", ALIGN_CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-bm{c[3]}-{c[4]}-{c[5]}")
def test_align_invariants(case):
    T, k, E, bm, pattern, path = case
    ids = random_ids(T, k, E, pattern)
    if T == 300:
        ids = ids.long()  # HF hands int64 ids
    check_layout(ids, E, bm, routing.align_triton(ids, E, bm, path=path))


def check_layout(ids, E, bm, layout):
    """align's contract: each pair once in its expert's segment (stable), segments padded to bm with the
    sentinel, block experts, -1 past the end."""
    sorted_ids, block_expert, num_post = layout
    N = ids.numel()
    max_padded = N + E * (bm - 1)
    assert sorted_ids.shape == (max_padded,) and sorted_ids.dtype == torch.int32
    assert block_expert.shape == (math.ceil(max_padded / bm),) and num_post.shape == (1,)
    sorted_ids, block_expert, num_post = sorted_ids.cpu(), block_expert.cpu(), int(num_post.item())
    flat = ids.reshape(-1).long().cpu()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + bm - 1) // bm * bm
    starts = padded.cumsum(0) - padded
    assert num_post == padded.sum().item()
    for e in range(E):
        segment = sorted_ids[starts[e]:starts[e] + padded[e]].long()
        assert torch.equal(segment[:counts[e]], (flat == e).nonzero().flatten())  # each pair once, stable order
        assert (segment[counts[e]:] == N).all()  # padding = sentinel
    assert (sorted_ids[num_post:] == N).all()
    for b in range(block_expert.numel()):
        if b * bm < num_post:
            e = block_expert[b].item()
            assert starts[e] <= b * bm < starts[e] + padded[e]
        else:
            assert block_expert[b].item() == -1


@pytest.mark.parametrize("method", reference.METHODS)
@pytest.mark.parametrize("T, E, k, bm", [(1, 6, 2, 16), (1, 64, 6, 16), (1, 10, 3, 4), (37, 10, 3, 4),
                                         (300, 6, 2, 16)])
def test_route_align_in_one_launch_equals_route_then_align(method, T, E, k, bm):
    """One program routes every row (several row blocks at T=37, 300) and aligns every pair (several chunks at
    T=300): the same weights and ids as route_triton, the same layout as align_triton. At T=1 the layout comes from
    the ids in registers (ONE_ROW), without the counting pass."""
    kw = dict(method=method, top_k=k, renormalize=True, scale=1.5, n_group=2, topk_group=1)
    if method == "sparsemixer":  # two picks, always
        kw.update(top_k=2, jitter_eps=0.01)
    logits, bias = randn(T, E), randn(E) if method == "sigmoid_group_topk" else None
    weights, ids, layout = routing.route_align_triton(logits, bias, **kw, block_m=bm)
    ref_w, ref_i = routing.route_triton(logits, bias, **kw)
    assert torch.equal(ids, ref_i) and torch.equal(weights, ref_w)
    check_layout(ids, E, bm, layout)
    for got, want in zip(layout, routing.align_triton(ref_i, E, bm)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- experts
SPLIT_CFG = dict(BM=16, up=dict(BN=32, BK=32, GROUP_M=1, warps=4, stages=2),
                 down=dict(BN=32, BK=16, GROUP_M=2, warps=4, stages=2, SPLIT_K=2))
EXPERT_CASES = [  # T, E, H, I, k, gated, interleaved, activation, dtype, config, pattern
    (1, 6, 48, 40, 2, True, False, "silu", torch.float32, None, "random"),
    (37, 6, 48, 40, 2, True, False, "silu", torch.float32, None, "random"),
    (37, 6, 48, 40, 2, True, True, "gelu", torch.float32, None, "unused"),
    (37, 6, 48, 40, 2, False, False, "gelu_tanh", torch.float32, None, "random"),
    (21, 6, 48, 40, 2, False, False, "relu2", torch.float32, None, "random"),
    (37, 6, 48, 40, 3, True, True, "relu", torch.float32, SPLIT_CFG, "unused"),
    (37, 6, 48, 40, 1, True, False, "silu", torch.float32, SPLIT_CFG, "one"),
    (37, 6, 48, 40, 2, True, False, "silu", torch.float16, SPLIT_CFG, "random"),
    (300, 6, 48, 40, 2, True, False, "silu", torch.float32, None, "random"),
    (37, 6, 48, 40, 2, True, False, "swiglu_softcap", torch.float32, None, "random"),
    (37, 6, 48, 40, 2, True, True, "swiglu_limit", torch.float32, None, "random"),
]


@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: "-".join(map(str, c[:8])) + f"-{c[8]}-"
                         + ("split" if c[9] else "auto") + f"-{c[10]}")
def test_experts_triton_matches_reference(case):
    T, E, H, I, k, gated, interleaved, act, dtype, cfg, pattern = case
    x = randn(T, H + 5, dtype=dtype)[:, 3:H + 3]  # a strided view: the kernels take strides
    w13 = randn(E, 2 * I if gated else I, H, scale=H ** -0.5, dtype=dtype)
    w2 = randn(E, H, I, scale=I ** -0.5, dtype=dtype)
    ids = random_ids(T, k, E, pattern)
    weights = torch.rand(T, k, device=DEV) + 0.1
    kw = dict(gated=gated, interleaved=interleaved, activation=act)
    if act == "swiglu_softcap":  # caps that bind: |gate|, |up| reach a few units here
        kw.update(alpha=0.7, limit=1.5)
    if act == "swiglu_limit":
        kw.update(limit=0.8)
    out = experts.experts_triton(x, w13, w2, weights, ids, config=cfg, **kw)
    ref = reference.experts(x, w13, w2, weights, ids, **kw)
    assert out.dtype == dtype and out.shape == (T, H)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def _experts_loop(x, w13, w2, weights, ids, gated, interleaved, activation):
    """The oracle's oracle: token by token, slot by slot, float64."""
    act = reference.activation_fn(activation)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            if gated:
                I = h.shape[0] // 2
                gate, up = (h[0::2], h[1::2]) if interleaved else (h[:I], h[I:])
                a = act(gate) * up
            else:
                a = act(h)
            out[t] += float(weights[t, j]) * (w2[e].double() @ a)
    return out


@pytest.mark.parametrize("gated,interleaved,activation", [(True, False, "silu"), (True, True, "gelu_tanh"),
                                                           (False, False, "relu"), (True, False, "gelu"),
                                                           (False, False, "relu2")])
def test_reference_experts_matches_token_loop(gated, interleaved, activation):
    T, E, H, I, k = 9, 5, 24, 20, 2
    x = randn(T, H, device="cpu")
    w13 = randn(E, 2 * I if gated else I, H, scale=H ** -0.5, device="cpu")
    w2 = randn(E, H, I, scale=I ** -0.5, device="cpu")
    ids = random_ids(T, k, E, device="cpu")
    weights = torch.rand(T, k)
    ref = reference.experts(x, w13, w2, weights, ids, gated=gated, interleaved=interleaved, activation=activation)
    loop = _experts_loop(x, w13, w2, weights, ids, gated, interleaved, activation)
    torch.testing.assert_close(ref.double(), loop, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- vs real HF blocks
def _hf(kind):
    """(block, router, routed-output fn, kwargs of reference.moe) for a tiny HF MoE block with random weights."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3
    from transformers.models.jamba import modeling_jamba as jamba
    from transformers.models.mixtral import modeling_mixtral as mixtral
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3

    attn = dict(num_attention_heads=4, num_key_value_heads=4)
    common = dict(n_group=1, topk_group=1, gated=True, interleaved=False, activation="silu", scale=1.0)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=48, intermediate_size=40, num_local_experts=6,
                                         num_experts_per_tok=2, **attn)
        block, kw = mixtral.MixtralSparseMoeBlock(cfg), dict(method="softmax_topk", top_k=2, renormalize=True,
                                                             router_fp32=False)
    elif kind.startswith("qwen3"):
        norm = kind.endswith("norm")
        cfg = transformers.Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=40, num_experts=6,
                                          num_experts_per_tok=2, norm_topk_prob=norm,
                                          hidden_act="silu" if norm else "gelu", head_dim=12, **attn)
        block = qwen3.Qwen3MoeSparseMoeBlock(cfg)
        kw = dict(method="softmax_topk", top_k=2, renormalize=norm, router_fp32=False,
                  activation="silu" if norm else "gelu")
    elif kind == "jamba":
        cfg = transformers.JambaConfig(hidden_size=48, intermediate_size=40, num_experts=6, num_experts_per_tok=2,
                                       hidden_act="gelu_pytorch_tanh", **attn)
        block = jamba.JambaSparseMoeBlock(cfg)
        kw = dict(method="softmax_topk", top_k=2, renormalize=False, router_fp32=False, activation="gelu_tanh")
    elif kind.startswith("deepseek_v2"):
        grouped = kind.endswith("group")
        cfg = transformers.DeepseekV2Config(
            hidden_size=48, moe_intermediate_size=40, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
            routed_scaling_factor=1.5, topk_method="group_limited_greedy" if grouped else "greedy",
            n_group=3 if grouped else None, topk_group=2 if grouped else None, **attn)
        block = ds2.DeepseekV2Moe(cfg)
        kw = dict(method="softmax_group_topk" if grouped else "softmax_topk", top_k=2, renormalize=False,
                  router_fp32=True, scale=1.5, n_group=3 if grouped else 1, topk_group=2 if grouped else 1)
    elif kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(hidden_size=48, moe_intermediate_size=40, n_routed_experts=8,
                                            num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
                                            routed_scaling_factor=2.5, n_shared_experts=1, **attn)
        block = ds3.DeepseekV3MoE(cfg)
        kw = dict(method="sigmoid_group_topk", top_k=3, renormalize=True, router_fp32=True, scale=2.5,
                  n_group=4, topk_group=2)
    else:
        raise KeyError(kind)
    cfg._experts_implementation = "eager"
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in block.named_buffers():
            if "bias" in name:  # zero-initialised router correction bias
                b.copy_(torch.randn_like(b) * 0.1)
    router = block.router if hasattr(block, "router") else block.gate
    shared = getattr(block, "shared_experts", None)

    def routed(x3):
        out = block(x3)
        return out - shared(x3) if shared is not None else out

    return block, router, routed, {**common, **kw}


HF_KINDS = ["mixtral", "qwen3_moe_norm", "qwen3_moe", "jamba", "deepseek_v2", "deepseek_v2_group", "deepseek_v3"]


@pytest.mark.parametrize("kind", HF_KINDS)
@torch.no_grad()
def test_reference_matches_hf_block(kind):
    block, router, routed, kw = _hf(kind)
    x3 = torch.randn(2, 9, 48)
    x = x3.view(-1, 48)
    bias = getattr(router, "e_score_correction_bias", None)
    route_kw = {n: kw[n] for n in ("method", "top_k", "renormalize", "scale", "n_group", "topk_group")}
    expert_kw = {n: kw[n] for n in ("gated", "interleaved", "activation")}
    # routing: same experts, same weights
    routed_out = router(x)
    if isinstance(routed_out, tuple):
        hf_logits, hf_w, hf_i = routed_out
    else:  # transformers 5.1x Jamba: the router is a plain Linear, the block routes
        hf_logits = routed_out
        hf_i, hf_w = block.route_tokens_to_experts(x, hf_logits)
    w, i = reference.route(hf_logits.float(), bias, **route_kw)
    torch.testing.assert_close(sort_pairs(w, i)[0], sort_pairs(hf_w.float(), hf_i)[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(sort_pairs(w, i)[1], sort_pairs(hf_w, hf_i)[1])
    # experts fed with HF's routing
    experts = block.experts
    w13 = experts.gate_up_proj if expert_kw["gated"] else experts.up_proj
    out = reference.experts(x, w13, experts.down_proj, hf_w, hf_i, **expert_kw)
    torch.testing.assert_close(out, experts(x, hf_i, hf_w), rtol=1e-5, atol=1e-5)
    # the whole routed part
    out = reference.moe(x, router.weight, bias, w13, experts.down_proj, **kw)
    torch.testing.assert_close(out.view_as(x3), routed(x3), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- ops
def _op_inputs(T=7, E=6, H=48, I=40, device=DEV):
    return (randn(T, H, device=device), randn(E, H, scale=H ** -0.5, device=device),
            randn(E, scale=0.1, device=device), randn(E, 2 * I, H, scale=H ** -0.5, device=device),
            randn(E, H, I, scale=I ** -0.5, device=device))


OP_KW = dict(method="sigmoid_group_topk", top_k=2, renormalize=True, scale=2.5, n_group=3, topk_group=2, gated=True,
             interleaved=False, activation="silu", router_fp32=True)
OP_SPEC = MoESpec(RouteSpec("sigmoid_group_topk", 2, True, 2.5, 3, 2, True), ExpertsSpec(True, False, "silu"))


def _weights(rw, b, w13, w2, **kw) -> MoEWeights:
    return MoEWeights(rw, router_bias=b, w13=w13, w2=w2, **kw)


@pytest.mark.parametrize("triton_on_cpu", [False, True])
def test_ops_match_reference(triton_on_cpu, monkeypatch):
    if triton_on_cpu:
        if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs the Triton interpreter")
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    x, rw, b, w13, w2 = _op_inputs()
    torch.testing.assert_close(ops.moe(x, _weights(rw, b, w13, w2), OP_SPEC), reference.moe(x, rw, b, w13, w2, **OP_KW),
                               rtol=1e-5, atol=1e-5)
    logits = reference.router_logits(x, rw, True)
    route_kw = {n: OP_KW[n] for n in ("method", "top_k", "renormalize", "scale", "n_group", "topk_group")}
    w, i = ops.moe_route(logits, b, **route_kw)
    ref_w, ref_i = reference.route(logits, b, **route_kw)
    assert w.dtype == torch.float32 and i.dtype == torch.int32
    assert torch.equal(sort_pairs(w, i)[1], sort_pairs(ref_w, ref_i)[1])
    out = ops.moe_experts(x, w13, w2, ref_w, ref_i, ExpertsSpec(True, False, "silu"))
    ref = reference.experts(x, w13, w2, ref_w, ref_i, gated=True, interleaved=False, activation="silu")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", ["none", "plain", "gated"])
def test_moe_block_adds_the_shared_expert_in_the_combine(shared, monkeypatch):
    """hybrid::moe_block on the Triton path (the shared add inside the combine kernel) vs the routed experts'
    reference plus the (gated) shared output; leading dims [2, 3] flattened, T=1 (route + align in one launch)."""
    if DEV == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs the Triton interpreter")
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    from hybrid_kernels.moe.ops import moe_block
    for lead in ((2, 3), (1,)):
        x, rw, b, w13, w2 = _op_inputs(T=math.prod(lead))
        x = x.view(*lead, -1)
        sh = randn(*x.shape) if shared != "none" else None
        gate = randn(*lead, 1) if shared == "gated" else None
        out = moe_block(x, _weights(rw, b, w13, w2), OP_SPEC, sh, gate)
        ref = reference.moe(x.view(-1, x.shape[-1]), rw, b, w13, w2, **OP_KW).view(x.shape)
        if sh is not None:
            ref = ref + (sh if gate is None else torch.sigmoid(gate) * sh)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_opcheck():
    x, rw, b, w13, w2 = _op_inputs(T=5, E=4)
    spec = MoESpec(RouteSpec("sigmoid_group_topk", 2, True, 2.5, 2, 1, True), ExpertsSpec(True, False, "silu"))
    torch.library.opcheck(torch.ops.hybrid.moe.default, spec.moe_args(x, _weights(rw, b, w13, w2)))


def test_torch_compile_matches_reference():
    x, rw, b, w13, w2 = _op_inputs(T=5, E=4)
    kw = dict(OP_KW, n_group=2, topk_group=1)
    spec = MoESpec(RouteSpec("sigmoid_group_topk", 2, True, 2.5, 2, 1, True), OP_SPEC.experts)
    assert spec.kwargs() == dict(kw, alpha=1.0, limit=float("inf"), jitter_eps=0.0)

    def f(x, rw, b, w13, w2):
        return ops.moe(x, _weights(rw, b, w13, w2), spec) * 2.0

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True)(x, rw, b, w13, w2)
    torch.testing.assert_close(out, reference.moe(x, rw, b, w13, w2, **kw) * 2.0, rtol=1e-5, atol=1e-5)


_TRACE_SCRIPT = r"""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from hybrid_kernels.moe import triton_experts as experts
E, H, I = 6, 48, 40
kw = dict(method="softmax_topk", top_k=2, renormalize=True, scale=1.0, n_group=1, topk_group=1, gated=True,
          interleaved=False, activation="silu", router_fp32=False)
for T in (3, 3000):
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.randn(T, H, dtype=torch.bfloat16), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    ws = [mode.from_tensor(torch.randn(*s, dtype=torch.bfloat16)) for s in ((E, H), (E, 2 * I, H), (E, H, I))]
    with mode:
        gm = make_fx(lambda x, rw, w13, w2: experts.moe_triton(x, rw, None, w13, w2, **kw))(x, *ws)
    n = sum(1 for node in gm.graph.nodes if "triton_kernel_wrapper" in str(node.target))
    assert n >= 5, gm.code
print("ok")
"""


def test_triton_path_traces_with_symbolic_tokens():
    """The Triton branch is the fake impl under torch.compile on CUDA: it must trace on fake tensors with a
    symbolic T (no data-dependent sizes, no host sync). Needs compiled (not interpreted) kernels: subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _TRACE_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_kernels_compile_for_sm90_offline(tmp_path):
    """Compile every kernel of the Mixtral-shape pipeline (T=1 and T=4096 configs) for sm_90 on this machine
    (Triton's bundled ptxas, no GPU): catches GPU-only compile errors the interpreter cannot, and checks that the
    GEMM K loops are software-pipelined and nothing spills."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    out = tmp_path / "compile_check.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "bench/moe.py", "--compile-check", "--shapes", "mixtral",
                          "--tokens", "1,4096", "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    reports = json.loads(out.read_text())
    names = {r["kernel"] for r in reports}
    assert {"_route_align_kernel", "_route_kernel", "_align_scatter_kernel", "_gate_up_kernel", "_down_kernel",
            "_combine_kernel"} <= names
    for r in reports:
        if r["kernel"] in ("_gate_up_kernel", "_down_kernel"):
            assert r["pipelined"], r
        assert not r.get("spill_bytes"), r


@pytest.mark.parametrize("triton_on_cpu", [False, True])
def test_gpt_oss_style_experts(triton_on_cpu, monkeypatch):
    """Transposed expert weights ([E, H, 2I], [E, I, H]), interleaved gate / up, biases before the activation and the
    routing weight, the clamped SwiGLU, and a router whose linear has a bias: the op (reference and Triton) against
    the dense reference on the weights laid out [E, out, in]; T = 1 (route + align in one launch) and T = 37."""
    if triton_on_cpu:
        if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs the Triton interpreter")
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    E, H, I = 5, 48, 24
    spec = MoESpec(RouteSpec("topk_softmax", 2), ExpertsSpec(True, True, "swiglu_clamp", True, 1.702, 2.0))
    w = MoEWeights(randn(E, H, scale=H ** -0.5), randn(E, scale=0.5), None, randn(E, H, 2 * I, scale=H ** -0.5),
                   randn(E, I, H, scale=I ** -0.5), randn(E, 2 * I, scale=0.5), randn(E, H, scale=0.5))
    for T in (1, 37):
        x = randn(T, H)
        got = ops.moe(x, w, spec)
        want = reference.moe(x, w.router_w, None, w.w13.transpose(1, 2), w.w2.transpose(1, 2), **spec.kwargs(),
                             router_logit_bias=w.router_logit_bias, b13=w.b13, b2=w.b2)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    h = randn(7, 2 * I) * 3  # the clamped SwiGLU itself against gpt-oss's formula
    g, u = h[..., ::2].clamp(max=2.0), h[..., 1::2].clamp(-2.0, 2.0)
    torch.testing.assert_close(reference.glu(h[..., ::2], h[..., 1::2], "swiglu_clamp", 1.702, 2.0),
                               (u + 1) * g * torch.sigmoid(g * 1.702))


@pytest.mark.parametrize("split", [None, "split"])
def test_experts_triton_biases_with_split_k(split):
    """Biases with the down projection split along K: the down bias is added once per pair, not per split."""
    T, E, H, I, k = 9, 4, 48, 64, 2
    x, w13, w2 = randn(T, H), randn(E, 2 * I, H, scale=H ** -0.5), randn(E, H, I, scale=I ** -0.5)
    b13, b2 = randn(E, 2 * I), randn(E, H)
    ids, weights = random_ids(T, k, E, "random"), torch.rand(T, k, device=DEV) + 0.1
    kw = dict(gated=True, interleaved=False, activation="silu", b13=b13, b2=b2)
    out = experts.experts_triton(x, w13, w2, weights, ids, config=SPLIT_CFG if split else None, **kw)
    torch.testing.assert_close(out, reference.experts(x, w13, w2, weights, ids, **kw), rtol=1e-4, atol=1e-4)
