"""Causal conv1d (prefill + decode update): Triton vs reference on awkward shapes, reference vs HF's torch
path and cache, continuation (prefill then prefill, decode steps == prefill), slots and pad rows."""
import pytest
import torch
from transformers.cache_utils import LinearAttentionLayer
from transformers.models.mamba2 import modeling_mamba2 as hf2

from hybrid_kernels.ssm import reference as ref
from hybrid_kernels.ssm.triton_conv import causal_conv1d_triton, causal_conv1d_update_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rnd(*shape, dtype=torch.float32, g=None):
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


def close(a, b, tol=1e-5):
    a, b = a.float().cpu(), b.float().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1.0))
    assert err <= tol, f"max error {err:.3e} (tol {tol:.0e})"


def make_x(B, C, T, channel_last, g):
    if channel_last:  # as HF produces it: a split of in_proj's output, transposed
        return rnd(B, T, C + 5, g=g)[..., 2:C + 2].transpose(1, 2)
    return rnd(B, C, T, g=g)


@pytest.mark.parametrize("B,C,T,K,W,init,cl,act,bias", [
    (2, 40, 257, 4, 4, True, True, "silu", True),
    (1, 24, 63, 4, 4, False, False, "silu", True),
    (2, 24, 7, 4, 6, True, True, "none", False),  # W > K
    (1, 40, 1, 4, 4, True, False, "silu", True),  # T = 1
    (3, 3, 3, 4, 2, True, True, "silu", True),  # W < K-1: older history is zero; T < W + K
    (1, 24, 2, 3, 3, False, True, "silu", False),  # T < K-1
])
def test_conv_triton_vs_ref(B, C, T, K, W, init, cl, act, bias):
    g = torch.Generator().manual_seed(T * 7 + C)
    x = make_x(B, C, T, cl, g)
    w, b = rnd(C, K, g=g), (rnd(C, g=g) if bias else None)
    h0 = rnd(B, C, W, g=g) if init else None
    y, fs = causal_conv1d_triton(x, w, b, h0, act, W)
    y_ref, fs_ref = ref.causal_conv1d_ref(x, w, b, h0, act, W)
    close(y, y_ref)
    close(fs, fs_ref, 0)
    assert fs.shape == (B, C, W) and y.dtype == x.dtype


def _hf_prefill(layer, x, w, b, K):
    """Mamba2Mixer's prefill conv with a cache: update the cache, conv the returned states, keep T outputs."""
    full = layer.update_conv_state(x, conv_kernel_size=K)
    return hf2.causal_conv1d_fn(full, w, b, activation="silu")[:, :, -x.shape[-1]:]


@pytest.mark.parametrize("T1,T2", [(2, 9), (13, 5)])
def test_conv_ref_vs_hf_cache(T1, T2):
    """Ours with W = K reproduces HF's prefill conv, its cached conv state (zero-padded when T < K), and a
    second prefill that starts from that state."""
    g = torch.Generator().manual_seed(T1)
    B, C, K = 2, 24, 4
    w, b = rnd(C, K, g=g), rnd(C, g=g)
    x1, x2 = make_x(B, C, T1, True, g), make_x(B, C, T2, True, g)
    layer = LinearAttentionLayer()
    y1_hf = _hf_prefill(layer, x1, w, b, K)
    y1, s1 = ref.causal_conv1d_ref(x1, w, b, None, "silu", K)
    close(y1, y1_hf)
    close(s1, layer.conv_states[0], 0)
    close(causal_conv1d_triton(x1, w, b, None, "silu", K)[1], layer.conv_states[0], 0)
    y2_hf = _hf_prefill(layer, x2, w, b, K)
    y2, s2 = ref.causal_conv1d_ref(x2, w, b, s1, "silu", K)
    close(y2, y2_hf)
    close(s2, layer.conv_states[0], 0)


def test_conv_update_vs_hf():
    g = torch.Generator().manual_seed(1)
    B, C, K = 3, 40, 4
    w, b = rnd(C, K, g=g), rnd(C, g=g)
    state = rnd(B, C, K, g=g)
    x = rnd(B, C, g=g)
    s_hf, s_ref, s_tri = state.clone(), state.clone(), state.clone()
    y_hf = hf2.causal_conv1d_update(x[..., None], s_hf, w, b, activation="silu")[..., 0]
    close(ref.causal_conv1d_update_ref(x, s_ref, w, b, "silu", None), y_hf)
    close(causal_conv1d_update_triton(x, s_tri, w, b, "silu", None), y_hf)
    close(s_ref, s_hf, 0)
    close(s_tri, s_hf, 0)


@pytest.mark.parametrize("W,act,bias", [(4, "silu", True), (6, "none", False)])
def test_conv_update_slots(W, act, bias):
    """Permuted slots, a pad row (-1: no state write, y = 0), untouched slots unchanged, W > K."""
    g = torch.Generator().manual_seed(W)
    S, B, C, K = 6, 4, 40, 4
    w, b = rnd(C, K, g=g), (rnd(C, g=g) if bias else None)
    state = rnd(S, C, W, g=g)
    x = rnd(B, C, g=g)
    idx = torch.tensor([4, -1, 0, 2], dtype=torch.int32, device=DEV)
    s_ref, s_tri = state.clone(), state.clone()
    y_ref = ref.causal_conv1d_update_ref(x, s_ref, w, b, act, idx)
    y_tri = causal_conv1d_update_triton(x, s_tri, w, b, act, idx)
    close(y_tri, y_ref)
    close(s_tri, s_ref, 0)
    assert float(y_tri[1].abs().max()) == 0.0
    for untouched in (1, 3, 5):
        close(s_tri[untouched], state[untouched], 0)
    close(s_tri[4], torch.cat([state[4, :, 1:], x[0, :, None]], -1), 0)


def test_conv_ref_all_pad_rows():
    g = torch.Generator().manual_seed(3)
    state = rnd(3, 8, 4, g=g)
    s = state.clone()
    y = ref.causal_conv1d_update_ref(rnd(2, 8, g=g), s, rnd(8, 4, g=g), None, "silu",
                                     torch.tensor([-1, -1], dtype=torch.int32, device=DEV))
    close(s, state, 0)
    assert float(y.abs().max()) == 0.0


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_conv_continuation_and_decode(impl):
    """conv(T1) then conv(T2, initial_state) == conv(T1 + T2); T decode updates == one prefill."""
    conv = causal_conv1d_triton if impl == "triton" else ref.causal_conv1d_ref
    update = causal_conv1d_update_triton if impl == "triton" else ref.causal_conv1d_update_ref
    g = torch.Generator().manual_seed(5)
    B, C, K, W, T1, T2 = 2, 24, 4, 5, 19, 6
    w, b = rnd(C, K, g=g), rnd(C, g=g)
    x = make_x(B, C, T1 + T2, True, g)
    h0 = rnd(B, C, W, g=g)
    y_all, s_all = conv(x, w, b, h0, "silu", W)
    y1, s1 = conv(x[..., :T1], w, b, h0, "silu", W)
    y2, s2 = conv(x[..., T1:], w, b, s1, "silu", W)
    close(torch.cat([y1, y2], -1), y_all)
    close(s2, s_all, 0)
    state = s1.clone()
    ys = [update(x[..., t].contiguous(), state, w, b, "silu", None) for t in range(T1, T1 + T2)]
    close(torch.stack(ys, -1), y2)
    close(state, s_all, 0)
