"""hybrid::varlen_attention: the Triton kernel against the torch reference, and the reference against plain
per-sequence causal attention over dense keys; packed batches mixing one-token rows (decodes) with chunks that
start mid-prompt, shuffled blocks, GQA / MHA / MQA, sliding windows, head dims that are not powers of two, learned
sinks and soft-capping, bf16 on the GPU. CPU: the Triton interpreter (fp32)."""
from __future__ import annotations

import itertools

import pytest
import torch

from hybrid_kernels.attention.ops import varlen_attention
from hybrid_kernels.attention.reference import varlen_attention_ref
from hybrid_kernels.attention.triton_varlen import launch_config, varlen_attention_triton
from hybrid_kernels.numerics import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def packed_case(queries, contexts, hq, hkv, dk, dv, bs, dtype, seed=0):
    """A paged buffer holding each sequence's keys in shuffled blocks, and the packed queries of the step."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [-(-c // bs) for c in contexts]
    perm = (torch.randperm(sum(blocks_per) + 3, generator=g) + 1).tolist()  # block 0 reserved, spare blocks unused
    nb = max(blocks_per)
    table = torch.zeros(len(contexts), nb, dtype=torch.int32)
    dense = []
    for s, c in enumerate(contexts):
        own = [perm.pop() for _ in range(blocks_per[s])]
        table[s, :len(own)] = torch.tensor(own, dtype=torch.int32)
        dense.append(own)
    rows = (max(max(o) for o in dense) + 1) * bs
    buf = torch.randn(rows, hkv, dv + dk, generator=g).to(dtype)
    q = torch.randn(sum(queries), hq, dk, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist(), dtype=torch.int32)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    return [t.to(DEV) for t in (q, buf, table, cu, ctx)]


def dense_attention(q, buf, table, cu, ctx, dv, bs, window, scale):
    """Each sequence alone: its keys gathered, a causal mask offset to its cached length, SDPA-style math."""
    out = []
    for s in range(ctx.shape[0]):
        lo, hi, c = int(cu[s]), int(cu[s + 1]), int(ctx[s])
        rows = torch.tensor([int(table[s, j // bs]) * bs + j % bs for j in range(c)], device=buf.device)
        kv = buf[rows].double()
        group = q.shape[1] // buf.shape[1]
        k = kv[..., dv:].repeat_interleave(group, 1).transpose(0, 1)
        v = kv[..., :dv].repeat_interleave(group, 1).transpose(0, 1)
        qs = q[lo:hi].double().transpose(0, 1)
        pos = torch.arange(c - (hi - lo), c, device=buf.device)[:, None]
        key = torch.arange(c, device=buf.device)[None, :]
        seen = (key <= pos) & ((pos - key < window) if window else True)
        w = (qs @ k.transpose(1, 2) * scale).masked_fill(~seen, float("-inf")).softmax(-1)
        out.append((w @ v).transpose(0, 1))
    return torch.cat(out)


CASES = [  # (queries per sequence, contexts, hq, hkv, dk, dv, block size, window)
    ([1, 1, 1], [1, 17, 40], 4, 2, 16, 16, 16, 0),               # decode rows only, one of a single key
    ([5, 1, 23, 1], [5, 33, 23, 70], 8, 2, 32, 32, 16, 0),       # fresh prompts, decodes, GQA 4
    ([7, 9, 1], [30, 9, 64], 6, 6, 24, 24, 8, 0),                # a chunk continuing mid-prompt, MHA, dim 24
    ([70, 1, 3], [100, 51, 3], 4, 1, 16, 8, 16, 0),              # MQA, dv != dk, a chunk longer than a tile
    ([12, 1, 20], [40, 50, 20], 4, 2, 16, 16, 4, 7),             # sliding window of 7, blocks of 4
    ([1], [1], 2, 2, 16, 16, 16, 3),
    ([33, 1, 2], [230, 130, 2], 4, 2, 16, 16, 16, 0),            # several key blocks seen whole before the diagonal
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}-ctx{c[1]}-h{c[2]}x{c[3]}-d{c[4]}-w{c[7]}")
def test_reference_equals_dense_per_sequence_attention(case):
    queries, contexts, hq, hkv, dk, dv, bs, window = case
    q, buf, table, cu, ctx = packed_case(queries, contexts, hq, hkv, dk, dv, bs, torch.float64)
    want = dense_attention(q, buf, table, cu, ctx, dv, bs, window, dk ** -0.5)
    got = varlen_attention_ref(q, buf, table, cu, ctx, dv, bs, window, dk ** -0.5)
    assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}-ctx{c[1]}-h{c[2]}x{c[3]}-d{c[4]}-w{c[7]}")
def test_triton_equals_reference_fp32(case):
    queries, contexts, hq, hkv, dk, dv, bs, window = case
    q, buf, table, cu, ctx = packed_case(queries, contexts, hq, hkv, dk, dv, bs, torch.float32, seed=1)
    want = varlen_attention_ref(q, buf, table, cu, ctx, dv, bs, window, 0.3)
    got = varlen_attention_triton(q, buf, table, cu, ctx, dv, bs, window, 0.3)
    assert rel_err(got, want) < 1e-5


LAUNCHES = sorted({tuple(launch_config(n, s, d, d).items()) for n, s, d in itertools.product((4, 64, 1024), (1, 4),
                                                                                               (64, 256))})


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda c: "-".join(str(v) for _, v in c))
def test_every_launch_of_the_rule(launch):
    """Each config ``launch_config`` picks for some step (decodes, long chunks, the steps between; wide heads) on a
    step with fresh prompts, decodes, a chunk continuing its prompt and a sliding window, MLA's widths (dk 40 / dv 24
    here: dk != dv, neither a power of two)."""
    for window, (dk, dv) in itertools.product((0, 9), ((32, 32), (40, 24))):
        q, buf, table, cu, ctx = packed_case([70, 1, 3, 20], [100, 51, 3, 20], 4, 2, dk, dv, 16, torch.float32, seed=3)
        want = varlen_attention_ref(q, buf, table, cu, ctx, dv, 16, window, 0.3)
        got = varlen_attention_triton(q, buf, table, cu, ctx, dv, 16, window, 0.3, config=dict(launch))
        assert rel_err(got, want) < 1e-5, (window, dk, dv)


@pytest.mark.parametrize("softcap,sinks,window", [(0.0, True, 0), (5.0, False, 0), (3.0, True, 6)],
                         ids=["sinks", "softcap", "both+window"])
def test_sinks_and_soft_capping(softcap, sinks, window):
    """gpt-oss's learned sinks (one logit per head in the softmax, no value) and Gemma 2's soft-capping of the scaled
    scores, as HF's eager attention computes them on dense keys (fp64); the Triton kernel against the reference
    (fp32), sinks large enough to take most of a row's probability."""
    queries, contexts, hq, hkv, dk, dv, bs = [5, 1, 23, 1], [5, 33, 23, 70], 8, 2, 16, 16, 4
    q, buf, table, cu, ctx = packed_case(queries, contexts, hq, hkv, dk, dv, bs, torch.float64, seed=4)
    q = q * 3  # scores past the cap
    sink = torch.linspace(-2.0, 6.0, hq, dtype=torch.float64, device=DEV) if sinks else None
    want = []
    for s in range(len(queries)):
        lo, hi, c = int(cu[s]), int(cu[s + 1]), int(ctx[s])
        rows = torch.tensor([int(table[s, j // bs]) * bs + j % bs for j in range(c)], device=DEV)
        k = buf[rows][..., dv:].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        v = buf[rows][..., :dv].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        w = q[lo:hi].transpose(0, 1) @ k.transpose(1, 2) * 0.3
        if softcap:
            w = torch.tanh(w / softcap) * softcap
        pos, key = torch.arange(c - (hi - lo), c, device=DEV)[:, None], torch.arange(c, device=DEV)[None, :]
        w = w.masked_fill(~((key <= pos) & ((pos - key < window) if window else True)), float("-inf"))
        if sinks:
            w = torch.cat([w, sink[:, None, None].expand(-1, hi - lo, 1)], -1)
            w = (w - w.max(-1, keepdim=True).values).softmax(-1)[..., :-1]
        else:
            w = w.softmax(-1)
        want.append((w @ v).transpose(0, 1))
    ref = varlen_attention_ref(q, buf, table, cu, ctx, dv, bs, window, 0.3, sink, softcap)
    assert rel_err(ref, torch.cat(want)) < 1e-12
    got = varlen_attention_triton(q.float(), buf.float(), table, cu, ctx, dv, bs, window, 0.3,
                                  None if sink is None else sink.float(), softcap)
    assert rel_err(got, ref) < 1e-5
    assert rel_err(varlen_attention(q.float(), buf.float(), table, cu, ctx, dv, bs, window, 0.3,
                                    None if sink is None else sink.float(), softcap), ref) < 1e-5


def test_strided_queries_and_the_op_dispatch():
    """Queries as HF hands them (a transposed [1, H, N, D] view) through the registered op."""
    q, buf, table, cu, ctx = packed_case([3, 1], [10, 20], 4, 2, 16, 16, 16, torch.float32, seed=2)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # [N, H, D] with a head-major layout
    want = varlen_attention_ref(q, buf, table, cu, ctx, 16, 16, 0, 0.25)
    assert rel_err(varlen_attention_triton(strided, buf, table, cu, ctx, 16, 16, 0, 0.25), want) < 1e-5
    assert rel_err(varlen_attention(strided, buf, table, cu, ctx, 16, 16, 0, 0.25), want) < 1e-5


@pytest.mark.skipif(DEV != "cuda", reason="bf16 kernels need the GPU (the interpreter computes bf16 unreliably)")
@pytest.mark.parametrize("case", [([1] * 64 + [512], [700] * 64 + [512], 32, 8, 128, 128, 16, 0),
                                  ([300, 1, 2000], [900, 4000, 2000], 16, 4, 64, 64, 16, 1024),
                                  ([100] * 7, [100, 200, 300, 400, 500, 600, 700], 28, 4, 128, 128, 16, 0)])
def test_triton_bf16_on_the_gpu(case):
    queries, contexts, hq, hkv, dk, dv, bs, window = case
    q, buf, table, cu, ctx = packed_case(queries, contexts, hq, hkv, dk, dv, bs, torch.bfloat16, seed=3)
    want = varlen_attention_ref(q, buf, table, cu, ctx, dv, bs, window, dk ** -0.5)
    got = varlen_attention_triton(q, buf, table, cu, ctx, dv, bs, window, dk ** -0.5)
    assert rel_err(got, want) < 2e-2
