"""Plain torch references for the gated delta rule: the CPU path of the ``hybrid::`` delta-rule ops and the oracle.

The recurrence, per value head, with the state S [K, V] (fp32):
    S <- exp(g_t) * S                      (g_t [] per head: Gated DeltaNet; g_t [K] per key channel: Kimi DA)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T (scale * q_t)
q and k are optionally L2-normalised first (x * rsqrt(sum(x^2) + 1e-6), in fp32); q / k heads serve
HV / HK consecutive value heads (grouped value attention). Layout follows Hugging Face and
flash-linear-attention: q, k [B, T, HK, K], v [B, T, HV, V], g [B, T, HV] or [B, T, HV, K] (log decay, <= 0),
beta [B, T, HV], states [N, HV, K, V]. With ``cu_seqlens`` [N + 1] the batch holds N packed sequences (B = 1).

``delta_rule_recurrent`` is the token-by-token oracle. ``delta_rule_chunked`` computes the same in chunks of C
(the UT / WY form the Triton kernels use): inside a chunk, L = strict_lower(beta_i k_i.k_j exp(G_i - G_j)) with
G the in-chunk cumulative decay; u = (I + L)^-1 (beta v), w = (I + L)^-1 (beta k exp(G)); then per chunk
v' = u - w S, o = (q exp(G)) S + tril(q_i.k_j exp(G_i - G_j)) v', S <- exp(G_last) S + (k exp(G_last - G))^T v'.
"""
from __future__ import annotations

import torch

EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + EPS)


def _segments(cu_seqlens: torch.Tensor | None, batch: int, length: int) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    if batch != 1:
        raise ValueError(f"cu_seqlens packs sequences along T: the batch must be 1, got {batch}")
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _prepare(q, k, v, g, beta, scale, use_l2norm):
    hk, hv = k.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"{hv} value heads are not a multiple of {hk} key heads")
    q, k = (l2norm(x) if use_l2norm else x.float() for x in (q, k))
    rep = hv // hk
    q, k = (x.repeat_interleave(rep, dim=2) if rep > 1 else x for x in (q, k))
    g = g.float()
    if g.dim() == 3:
        g = g.unsqueeze(-1)  # [B, T, HV, 1]: one decay for every key channel
    return q * scale, k, v.float(), g, beta.float()


def delta_rule_recurrent(q, k, v, g, beta, scale: float, initial_state=None, cu_seqlens=None,
                         use_l2norm: bool = True):
    """-> (o [B, T, HV, V] in v's dtype, final states [N, HV, K, V] fp32), one token at a time."""
    B, T, HV, V = v.shape
    K = k.shape[-1]
    qs, ks, vs, gs, bs = _prepare(q, k, v, g, beta, scale, use_l2norm)
    segs = _segments(cu_seqlens, B, T)
    out = torch.zeros(B, T, HV, V, dtype=torch.float32, device=v.device)
    finals = []
    for n, (b, start, end) in enumerate(segs):
        S = (torch.zeros(HV, K, V, dtype=torch.float32, device=v.device) if initial_state is None
             else initial_state[n].float().clone())
        for t in range(start, end):
            S = S * gs[b, t].exp().unsqueeze(-1)
            kt = ks[b, t]
            delta = bs[b, t].unsqueeze(-1) * (vs[b, t] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
            out[b, t] = torch.einsum("hkv,hk->hv", S, qs[b, t])
        finals.append(S)
    return out.to(v.dtype), torch.stack(finals)


def delta_rule_chunked(q, k, v, g, beta, scale: float, initial_state=None, cu_seqlens=None,
                       use_l2norm: bool = True, chunk: int = 64):
    """Same result as ``delta_rule_recurrent``, vectorised over chunks of ``chunk`` tokens (loops over chunks only)."""
    B, T, HV, V = v.shape
    K = k.shape[-1]
    qs, ks, vs, gs, bs = _prepare(q, k, v, g, beta, scale, use_l2norm)
    out = torch.zeros(B, T, HV, V, dtype=torch.float32, device=v.device)
    finals = []
    tri = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device)
    strict, lower = tri.tril(-1), tri.tril()
    for n, (b, start, end) in enumerate(_segments(cu_seqlens, B, T)):
        S = (torch.zeros(HV, K, V, dtype=torch.float32, device=v.device) if initial_state is None
             else initial_state[n].float().clone())
        for c0 in range(start, end, chunk):
            c1 = min(c0 + chunk, end)
            pad = chunk - (c1 - c0)

            def take(x):  # [HV, C, D], zero rows past the sequence's end
                x = x[b, c0:c1].transpose(0, 1)
                return torch.nn.functional.pad(x, (0, 0, 0, pad))
            qc, kc, vc, gc = take(qs), take(ks), take(vs), take(gs.expand(-1, -1, -1, gs.shape[-1]))
            bc = torch.nn.functional.pad(bs[b, c0:c1].transpose(0, 1), (0, pad))  # [HV, C]
            G = gc.cumsum(1)  # [HV, C, 1 or K]
            # pairwise decay exp(G_i - G_j) per channel, only where j <= i (the exponent is <= 0 there)
            diff = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~lower[None, :, :, None], float("-inf")).exp()
            L = (bc[:, :, None, None] * kc.unsqueeze(2) * kc.unsqueeze(1) * diff).sum(-1) * strict
            Aqk = (qc.unsqueeze(2) * kc.unsqueeze(1) * diff).sum(-1) * lower
            eye = torch.eye(chunk, device=v.device).expand(HV, -1, -1)
            Tinv = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)
            u = Tinv @ (vc * bc.unsqueeze(-1))
            w = Tinv @ (kc * bc.unsqueeze(-1) * G.exp())
            v_new = u - w @ S
            o = (qc * G.exp()) @ S + Aqk @ v_new
            out[b, c0:c1] = o[:, : c1 - c0].transpose(0, 1)
            last = G[:, c1 - c0 - 1 : c1 - c0]  # [HV, 1, 1 or K]
            kd = kc * (last - G).exp() * (torch.arange(chunk, device=v.device) < c1 - c0)[None, :, None]
            S = S * last.transpose(1, 2).exp() + kd.transpose(1, 2) @ v_new
        finals.append(S)
    return out.to(v.dtype), torch.stack(finals)


def delta_rule_step_ref(q, k, v, g, beta, scale: float, state, state_indices=None, use_l2norm: bool = True):
    """Decode: q, k [B, T, HK, K] ... over T tokens (usually 1) of each batch row; state [S, HV, K, V] fp32 is
    updated in place at each row's slot (``state_indices`` [B], -1 = pad row: no state write). -> o."""
    B = v.shape[0]
    slots = torch.arange(B, device=v.device) if state_indices is None else state_indices.long()
    valid = slots >= 0
    init = state.index_select(0, slots.clamp(min=0))
    out, final = delta_rule_recurrent(q, k, v, g, beta, scale, init, None, use_l2norm)
    for b in range(B):  # reference: a loop over the batch is fine
        if bool(valid[b]):
            state[int(slots[b])] = final[b].to(state.dtype)
    return out
