"""Gated delta rule: the references against HF's torch paths (Qwen3-Next's Gated DeltaNet, Kimi Linear's KDA), the
Triton chunked prefill and recurrent step against the token-by-token reference on awkward shapes (T across chunk
edges, K / V not powers of two, grouped value heads, decay per head and per channel, packed sequences with a
one-token one, initial states), outputs and final states alike; strong decays and near-equal keys (where a
product-formula inverse of the UT system loses all precision); the step in place on slots with a pad row."""
import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen

from hybrid_kernels.delta import reference as ref
from hybrid_kernels.delta.triton_chunk import delta_rule_chunk_triton
from hybrid_kernels.delta.triton_step import delta_rule_step_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def close(a, b, tol=2e-5 if DEV == "cpu" else 1e-4):
    a, b = a.float().cpu(), b.float().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1.0))
    assert err <= tol, f"max error {err:.3e} (tol {tol:.0e})"


def inputs(B, T, HK, HV, K, V, per_channel, seed=0, decay=0.5, same_keys=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, HK, K), r(B, T, HK, K), r(B, T, HV, V)
    if same_keys:  # every key nearly the same direction: L's entries all near beta
        k = r(1, 1, HK, K).expand(B, T, HK, K) + 1e-3 * k
    g = -torch.rand(*((B, T, HV, K) if per_channel else (B, T, HV)), generator=gen) * decay
    beta = torch.rand(B, T, HV, generator=gen)
    return [x.to(DEV) for x in (q, k, v, g, beta)]


def _torch_path(fn):
    """HF's torch function itself: with flash-linear-attention installed the module-level name dispatches to it."""
    return getattr(fn, "__wrapped__", fn)


def test_references_equal_hf():
    q, k, v, g, beta = inputs(2, 150, 2, 4, 16, 24, False)
    s0 = torch.randn(2, 4, 16, 24, device=DEV)
    want = _torch_path(hf_qwen.torch_recurrent_gated_delta_rule)(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    for fn in (ref.delta_rule_recurrent, ref.delta_rule_chunked):
        o, s = fn(q, k, v, g, beta, 16 ** -0.5, s0)
        close(o, want[0]), close(s, want[1])
    q, k, v, g, beta = inputs(2, 100, 3, 3, 16, 8, True, decay=2.0)
    s0 = torch.randn(2, 3, 16, 8, device=DEV)
    want = _torch_path(hf_kimi.chunk_kimi_delta_attention)(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    o, s = ref.delta_rule_recurrent(q, k, v, g, beta, 16 ** -0.5, s0)
    close(o, want[0]), close(s, want[1])


CASES = [  # B, T, HK, HV, K, V, per_channel
    (2, 70, 1, 2, 16, 24, False),   # grouped value heads, T across a chunk edge
    (1, 129, 2, 2, 20, 16, False),  # K not a power of two, two chunk edges
    (2, 64, 2, 2, 16, 40, True),    # exactly one chunk, V over two state blocks
    (1, 77, 1, 1, 24, 16, True),    # per channel, K padded
] + ([(1, 300, 2, 4, 128, 128, False), (2, 100, 2, 2, 128, 128, True)] if DEV == "cuda" else [])  # model widths


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + ("-ch" if c[6] else "-head"))
def test_chunk_and_step_equal_recurrence(case):
    B, T, HK, HV, K, V, pc = case
    q, k, v, g, beta = inputs(B, T, HK, HV, K, V, pc, seed=T)
    s0 = torch.randn(B, HV, K, V, device=DEV)
    want_o, want_s = ref.delta_rule_recurrent(q, k, v, g, beta, K ** -0.5, s0)
    o, s = delta_rule_chunk_triton(q, k, v, g, beta, K ** -0.5, s0)
    close(o, want_o), close(s, want_s)
    o, s = delta_rule_chunk_triton(q, k, v, g, beta, K ** -0.5, None)  # from zero states
    want_o, want_s = ref.delta_rule_recurrent(q, k, v, g, beta, K ** -0.5, None)
    close(o, want_o), close(s, want_s)
    ht = torch.empty(B, HV, K, V, device=DEV)
    close(delta_rule_step_triton(q, k, v, g, beta, K ** -0.5, None, ht), want_o)
    close(ht, want_s)


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "x".join(map(str, c[:6])) + ("-ch" if c[6] else "-head"))
def test_prepare_in_two_launches_equals_one(case, monkeypatch):
    """CONFIG's ``split``: the pairwise products and the solve as two launches give what one launch gives."""
    from hybrid_kernels.delta.triton_config import CONFIG
    B, T, HK, HV, K, V, pc = case
    q, k, v, g, beta = inputs(B, T, HK, HV, K, V, pc, seed=T + 1)
    s0 = torch.randn(B, HV, K, V, device=DEV)
    monkeypatch.setitem(CONFIG, "chunk", {**CONFIG["chunk"], "split": False})
    one = delta_rule_chunk_triton(q, k, v, g, beta, K ** -0.5, s0)
    monkeypatch.setitem(CONFIG, "chunk", {**CONFIG["chunk"], "split": True})
    two = delta_rule_chunk_triton(q, k, v, g, beta, K ** -0.5, s0)
    close(two[0], one[0], 1e-6), close(two[1], one[1], 1e-6)
    want_o, want_s = ref.delta_rule_recurrent(q, k, v, g, beta, K ** -0.5, s0)
    close(two[0], want_o), close(two[1], want_s)


@pytest.mark.parametrize("pc", [False, True], ids=["head", "ch"])
def test_packed_sequences(pc):
    lens = [1, 64, 5, 90]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q, k, v, g, beta = inputs(1, sum(lens), 2, 2, 16, 16, pc, seed=3)
    s0 = torch.randn(len(lens), 2, 16, 16, device=DEV)
    want_o, want_s = ref.delta_rule_recurrent(q, k, v, g, beta, 0.3, s0, cu)
    o, s = delta_rule_chunk_triton(q, k, v, g, beta, 0.3, s0, cu)
    close(o, want_o), close(s, want_s)
    # each sequence alone gives the same as packed
    a = 0
    for n, L in enumerate(lens):
        one = [x[:, a:a + L] for x in (q, k, v, g, beta)]
        o1, s1 = delta_rule_chunk_triton(*one, 0.3, s0[n:n + 1])
        close(o1, o[:, a:a + L]), close(s1, s[n:n + 1])
        a += L


@pytest.mark.parametrize("pc", [False, True], ids=["head", "ch"])
def test_hard_numerics(pc):
    """Strong decays (per channel: e^-20 a step, far past fp32's range over a chunk) and near-equal keys with
    beta near 1: the kernel's sub-blocked decays and forward substitution stay exact."""
    q, k, v, g, beta = inputs(1, 130, 1, 1, 16, 16, pc, seed=5, decay=20.0)
    want = ref.delta_rule_recurrent(q, k, v, g, beta, 0.25)
    got = delta_rule_chunk_triton(q, k, v, g, beta, 0.25)
    close(got[0], want[0]), close(got[1], want[1])
    q, k, v, g, beta = inputs(1, 128, 1, 1, 16, 16, pc, seed=6, decay=1e-3, same_keys=True)
    beta = 0.5 + 0.5 * beta
    want = ref.delta_rule_recurrent(q, k, v, g, beta, 0.25)
    got = delta_rule_chunk_triton(q, k, v, g, beta, 0.25)
    close(got[0], want[0], 1e-4), close(got[1], want[1], 1e-4)
    assert torch.isfinite(got[0]).all()


def test_step_in_place_on_slots():
    q, k, v, g, beta = inputs(3, 1, 2, 4, 16, 24, False, seed=9)
    table = torch.randn(5, 4, 16, 24, device=DEV)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32, device=DEV)
    want_table = table.clone()
    want_o = ref.delta_rule_step_ref(q, k, v, g, beta, 0.25, want_table, idx)
    o = delta_rule_step_triton(q, k, v, g, beta, 0.25, table, table, idx)
    close(table, want_table)
    close(o[0], want_o[0]), close(o[2], want_o[2])
    assert (o[1] == 0).all()


def test_chunk_prefill_then_steps_equal_one_prefill():
    """Prefill 40 tokens, then decode 30 one by one from the state: the same as prefilling all 70."""
    q, k, v, g, beta = inputs(2, 70, 1, 2, 16, 16, True, seed=11)
    whole_o, whole_s = delta_rule_chunk_triton(q, k, v, g, beta, 0.25)
    o1, s = delta_rule_chunk_triton(*[x[:, :40] for x in (q, k, v, g, beta)], 0.25)
    outs = [o1]
    for t in range(40, 70):
        outs.append(delta_rule_step_triton(*[x[:, t:t + 1] for x in (q, k, v, g, beta)], 0.25, s, s))
    close(torch.cat(outs, 1), whole_o), close(s, whole_s)


def test_chunk_length_halves_where_shared_memory_is_short(monkeypatch):
    """A launch that overflows shared memory at one chunk length is retried at half of it (same result)."""
    import triton

    from hybrid_kernels.delta import triton_chunk
    seen = []
    real = triton_chunk._chunked

    def tight(*args):
        seen.append(args[-1])
        if args[-1] > 32:
            raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
        return real(*args)
    monkeypatch.setattr(triton_chunk, "_chunked", tight)
    monkeypatch.setattr(triton_chunk, "_CHUNK_FITS", {})
    q, k, v, g, beta = inputs(1, 40, 1, 1, 16, 16, False, seed=2)
    want = ref.delta_rule_recurrent(q, k, v, g, beta, 0.25)
    got = delta_rule_chunk_triton(q, k, v, g, beta, 0.25)
    close(got[0], want[0]), close(got[1], want[1])
    assert seen == [64, 32]
    delta_rule_chunk_triton(q, k, v, g, beta, 0.25)
    assert seen == [64, 32, 32]  # the length that fits is remembered


@pytest.mark.skipif(DEV != "cuda", reason="bf16 needs the GPU (the CPU interpreter computes bf16 wrongly)")
@pytest.mark.parametrize("pc", [False, True], ids=["head", "ch"])
@pytest.mark.parametrize("variant", [{}, {"split": False, "dot16": False, "pair_prec": "ieee", "state16": False},
                                     {"pair_prec": "tf32"}, {"C": 32, "prepare_warps": 8}],
                         ids=["default", "fp32-products", "pair-tf32", "C32-8warps"])
def test_bf16_inputs_keep_bf16_precision(pc, variant, monkeypatch):
    """16-bit inputs: scratch between the kernels in bf16, states and the UT system in fp32; the model's head sizes,
    three chunks and a partial one, an initial state: within bf16's precision of the fp32 recurrence, for every
    precision CONFIG offers, and with more warps than threads per tile row (a missing barrier shows there)."""
    from hybrid_kernels.delta.triton_config import CONFIG
    monkeypatch.setitem(CONFIG, "chunk", {**CONFIG["chunk"], **variant})
    q, k, v, g, beta = inputs(2, 200, 2, 4, 128, 128, pc, seed=13)
    s0 = torch.randn(2, 4, 128, 128, device=DEV) * 0.1
    want = ref.delta_rule_recurrent(q, k, v, g, beta, 128 ** -0.5, s0)
    got = delta_rule_chunk_triton(*[x.bfloat16() for x in (q, k, v)], g, beta.bfloat16(), 128 ** -0.5, s0)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    close(got[0], want[0], 2e-2), close(got[1], want[1], 2e-2)
