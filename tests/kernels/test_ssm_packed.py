"""hybrid::mamba2_mixer_packed (the engine's packed steps) against the per-sequence mixer ops it stands for: a fresh
prompt is ``hybrid::mamba2_mixer``, a chunk continuing a cached sequence ``hybrid::mamba2_mixer_chunk``, a single
token continuing one ``hybrid::mamba2_mixer_step``. Outputs and every state row, on rows out of order, a fresh
1-token prompt, chunks straddling SSD chunk boundaries, with and without the gated norm; chunks of several lengths
as one call of right-padded rows (dt not clamped), or one call per length (dt clamped)."""
import pytest
import torch

import hybrid_kernels.ssm  # noqa: F401  (registers torch.ops.hybrid.*)
from hybrid_kernels.ssm.spec import Mamba2Spec, Mamba2Weights

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rnd(*shape, g):
    return torch.randn(*shape, generator=g).to(DEV)


def close(a, b, tol):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1.0))
    assert err <= tol, f"max error {err:.3e} (tol {tol:.0e})"


# (tokens, state row, cached before the step: 0 = a fresh prompt); rows 5-6 and 7-8 hold chunks back to back that one
# call takes as views
SEQS = [(1, 3, 6), (1, 0, 9), (6, 5, 0), (6, 6, 0), (5, 1, 7), (1, 4, 0), (4, 7, 3), (4, 8, 5), (9, 2, 0), (1, 9, 2)]


@pytest.mark.parametrize("clamp", [True, False], ids=["dt_clamped", "dt_free"])
@pytest.mark.parametrize("norm", [True, False], ids=["gated_norm", "no_norm"])
@pytest.mark.parametrize("triton_path", [False, True], ids=["reference", "triton"])
def test_mamba2_packed_equals_the_per_sequence_ops(norm, triton_path, clamp, monkeypatch):
    if triton_path and DEV == "cpu":
        monkeypatch.setenv("HYBRID_TRITON_ON_CPU", "1")
    g = torch.Generator().manual_seed(11 + norm)
    Hd, H, P, G, N, K, R = 24, 4, 8, 2, 8, 4, 11
    d_inner, C = H * P, H * P + 2 * G * N
    w = Mamba2Weights(in_proj_w=rnd(d_inner + C + H, Hd, g=g) / Hd ** 0.5, in_proj_b=rnd(d_inner + C + H, g=g) * 0.1,
                      conv_w=rnd(C, 1, K, g=g), conv_b=rnd(C, g=g), dt_bias=rnd(H, g=g),
                      A_log=torch.rand(H, generator=g).to(DEV), D=rnd(H, g=g),
                      norm_w=1 + 0.1 * rnd(d_inner, g=g) if norm else None,
                      out_proj_w=rnd(Hd, d_inner, g=g) / d_inner ** 0.5, out_proj_b=None,
                      # Falcon-H1's mup_vector: per-channel multipliers of the in projection, kept [1, 1, width]
                      proj_mult=None if norm else 1 + 0.1 * rnd(1, 1, d_inner + C + H, g=g))
    # a time-step limit that clamps: the chunked form clamps dt, the decode form (HF's) does not
    limit = dict(dt_min=0.05, dt_max=0.9) if clamp else {}
    spec = Mamba2Spec(head_dim=P, groups=G, chunk_size=4, eps=1e-5, norm_group=d_inner // 2, **limit)
    conv_buf, ssm_buf = rnd(R, C, K, g=g), rnd(R, H, P, N, g=g)
    hidden = rnd(1, sum(t for t, _, _ in SEQS), Hd, g=g)

    want_conv, want_ssm, want = conv_buf.clone(), ssm_buf.clone(), []
    first, table, dec_tokens, dec_rows = 0, [], [], []
    for count, row, cached in SEQS:
        x = hidden[:, first:first + count]
        conv, ssm = want_conv[row:row + 1].clone(), want_ssm[row:row + 1].clone()
        if cached and count == 1:
            out = torch.ops.hybrid.mamba2_mixer_step(*spec.step_args(x, None, w, conv, ssm))
            dec_tokens.append(first)
            dec_rows.append(row)
        elif cached:
            out = torch.ops.hybrid.mamba2_mixer_chunk(*spec.chunk_args(x, None, w, conv, ssm))
            table.append([first, count, row, 1])
        else:
            out, conv, ssm = torch.ops.hybrid.mamba2_mixer(*spec.prefill_args(x, None, w, K))
            table.append([first, count, row, 0])
        want_conv[row], want_ssm[row] = conv[0], ssm[0]
        want.append(out)
        first += count

    got = torch.ops.hybrid.mamba2_mixer_packed(*spec.packed_args(
        hidden, w, conv_buf, ssm_buf, torch.tensor(table, dtype=torch.long),
        torch.tensor(dec_tokens, device=DEV), torch.tensor(dec_rows, dtype=torch.int32, device=DEV)))
    from hybrid_kernels.ssm.mixer import chunk_groups
    groups = chunk_groups(torch.tensor(table), pad=not clamp)
    if clamp:  # one call per length, each as views (the pairs lie back to back)
        assert sorted((len(g.rows), g.run is not None) for g in groups) == [(1, True)] * 3 + [(2, True)] * 2
    else:  # 35 tokens as 7 rows of 9: one call
        assert [(len(g.rows), g.length, g.padded) for g in groups] == [(7, 9, True)]
    close(got, torch.cat(want, dim=1), 1e-4)
    close(conv_buf, want_conv, 1e-5)
    close(ssm_buf, want_ssm, 1e-4)


def test_mamba2_packed_without_decodes_or_chunks():
    """A step of decodes only (no chunk rows) and one of chunks only (no decode indices: None)."""
    g = torch.Generator().manual_seed(3)
    Hd, H, P, G, N, K = 16, 2, 8, 1, 4, 4
    d_inner, C = H * P, H * P + 2 * G * N
    w = Mamba2Weights(rnd(d_inner + C + H, Hd, g=g) / 4, None, rnd(C, 1, K, g=g), None, rnd(H, g=g),
                      torch.rand(H, generator=g).to(DEV), rnd(H, g=g), None, rnd(Hd, d_inner, g=g) / 4, None)
    spec = Mamba2Spec(head_dim=P, groups=G, chunk_size=8, eps=1e-5, norm_group=d_inner)
    conv_buf, ssm_buf = rnd(3, C, K, g=g), rnd(3, H, P, N, g=g)
    x = rnd(1, 2, Hd, g=g)
    conv, ssm = conv_buf[[2, 0]].clone(), ssm_buf[[2, 0]].clone()
    want = torch.ops.hybrid.mamba2_mixer_step(*spec.step_args(x.transpose(0, 1), None, w, conv, ssm))
    got = torch.ops.hybrid.mamba2_mixer_packed(*spec.packed_args(
        x, w, conv_buf, ssm_buf, torch.zeros(0, 4, dtype=torch.long), torch.tensor([0, 1], device=DEV),
        torch.tensor([2, 0], dtype=torch.int32, device=DEV)))
    close(got[0], want[:, 0], 1e-4)
    close(ssm_buf[[2, 0]], ssm, 1e-4)
    x = rnd(1, 5, Hd, g=g)
    want, conv, ssm = torch.ops.hybrid.mamba2_mixer(*spec.prefill_args(x, None, w, K))
    got = torch.ops.hybrid.mamba2_mixer_packed(*spec.packed_args(
        x, w, conv_buf, ssm_buf, torch.tensor([[0, 5, 1, 0]]), None, None))
    close(got, want, 1e-4)
    close(conv_buf[1:2], conv, 1e-5)
    close(ssm_buf[1:2], ssm, 1e-4)


def test_chunk_groups_bound_the_padding(monkeypatch):
    """Longest first, a group grows while its padding stays within PAD_SLACK of its tokens (PAD_FREE 0 here); every
    chunk lands in exactly one group; without padding, one group per length."""
    from hybrid_kernels.ssm import mixer
    monkeypatch.setattr(mixer, "PAD_FREE", 0)
    mixer._groups.cache_clear()
    counts = [9, 100, 8, 90, 10, 100]
    table, first = [], 0
    for row, count in enumerate(counts):
        table.append([first, count, row, row % 2])
        first += count
    groups = mixer.chunk_groups(torch.tensor(table), pad=True)
    # 100, 100, 90, 10 (pad 110 <= 150), then 9, 8
    assert [sorted(g.counts, reverse=True) for g in groups] == [[100, 100, 90, 10], [9, 8]]
    assert sorted(f for g in groups for f in g.firsts) == [t[0] for t in table]
    assert [g.padded for g in groups] == [True, True]
    assert sorted(g.length for g in mixer.chunk_groups(torch.tensor(table), pad=False)) == [8, 9, 10, 90, 100]
    mixer._groups.cache_clear()
