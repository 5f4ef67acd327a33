"""Plain torch MLA (multi-head latent attention) with absorbed weights: the CPU path and the test oracle.

Notation: L = kv_lora_rank (512), R = qk_rope_head_dim (64), P = qk_nope_head_dim, V = v_head_dim,
H = heads. A cache row is ``[latent (L) | k_rope (R)]``. Absorbed attention is MQA over the latent:

    q_lat[h] = q_nope[h] @ W_UK[h]                     # [P] -> [L]
    s_j      = (q_lat . latent_j + q_rope . krope_j) * scale
    o_lat    = softmax(s) @ latent                     # values = the latent itself
    out[h]   = o_lat[h] @ W_UV[h].T                    # [L] -> [V]

Every function here is shape-static (no ``.item()``, no data-dependent shapes), computes in fp32 and
returns the query dtype. Rows with no key to attend (seq_len 0, fully masked) give zeros, not NaN.
"""
from __future__ import annotations

import torch
from torch import Tensor

from hybrid_kernels.linear.reference import add_rms_norm_ref


# ----------------------------------------------------------------------------------------------
# weight absorption helpers (used by tests, the bench and the graph pass)
# ----------------------------------------------------------------------------------------------
def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_dim: int, v_dim: int | None = None):
    """kv_b_proj.weight [H*(P+V), L] -> (W_UK [H, P, L], W_UV [H, V, L]) (views)."""
    w = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[-1])
    return w[:, :qk_nope_dim, :], w[:, qk_nope_dim:, :]


def per_head_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x [B, H, T, K] @ w [H, K, N] -> [B, H, T, N] (a view) as one batched matmul over heads. A plain matmul would
    broadcast w over B and copy it B times first (B*H*K*N elements: 134 MB per call at DeepSeek-V2-Lite widths and
    B=64); the op bodies use this too."""
    b, h, t, k = x.shape
    rows = x.transpose(0, 1).reshape(h, b * t, k)  # copies only the activations (small)
    return torch.bmm(rows, w).view(h, b, t, w.shape[-1]).transpose(0, 1)


def absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [..., H, P] x W_UK [H, P, L] -> q_lat [..., H, L]."""
    return torch.einsum("...hp,hpl->...hl", q_nope, w_uk)


def unabsorb_out(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [..., H, L] x W_UV [H, V, L] -> out [..., H, V]."""
    return torch.einsum("...hl,hvl->...hv", o_lat, w_uv)


def _safe_softmax_av(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(scores) @ values with rows of all -inf giving zeros (not NaN). fp32 in, fp32 out."""
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)
    return torch.matmul(p / denom, values)


# ----------------------------------------------------------------------------------------------
# 1. cache write
# ----------------------------------------------------------------------------------------------
def mla_cache_write_ref(cache: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """cache [NB, BS, L+R] (mutated); latent [N, L]; k_rope [N, R]; slot_mapping [N]; slot -1 skips.

    Shape-static: skipped rows are redirected to the target of a written row (the first valid one)
    with that row's value, so every index_put duplicate carries identical data (valid slots are unique);
    when no row is valid they rewrite slot 0 with its own content."""
    nb, bs, d = cache.shape
    flat = cache.view(nb * bs, d)
    rows = torch.cat([latent, k_rope], dim=-1).to(cache.dtype)                  # [N, L+R]
    slots = slot_mapping.long()
    valid = slots >= 0                                                          # [N]
    first = torch.argmax(valid.to(torch.int32)).reshape(1)                      # first valid row (or 0)
    any_valid = valid.index_select(0, first)                                    # [1]
    rep_slot = torch.where(any_valid, slots.index_select(0, first), torch.zeros_like(first))
    rep_row = torch.where(any_valid[:, None], rows.index_select(0, first), flat[:1])   # [1, L+R]
    idx = torch.where(valid, slots, rep_slot)
    val = torch.where(valid[:, None], rows, rep_row)
    flat.index_put_((idx,), val)


# ----------------------------------------------------------------------------------------------
# 2. paged decode (one query token per sequence)
# ----------------------------------------------------------------------------------------------
def _gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [NB, BS, D], block_table [B, MB] -> [B, MB*BS, D] (entries past a sequence's end may be
    anything: they are clamped to a valid block and masked by the caller)."""
    nb, bs, d = cache.shape
    bt = block_table.long().clamp(0, nb - 1)
    return cache[bt].reshape(bt.shape[0], bt.shape[1] * bs, d)


def mla_decode_ref(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                   num_splits: int = 0) -> torch.Tensor:
    """q_lat [B, H, L], q_rope [B, H, R] -> o_lat [B, H, L]; attends cached tokens [0, seq_lens[b]).
    ``num_splits`` only changes the kernel's schedule, not the math; it is ignored here."""
    L = q_lat.shape[-1]
    kv = _gather_pages(cache, block_table).float()                               # [B, S, L+R]
    s = (torch.einsum("bhl,bsl->bhs", q_lat.float(), kv[..., :L])
         + torch.einsum("bhr,bsr->bhs", q_rope.float(), kv[..., L:])) * scale
    pos = torch.arange(kv.shape[1], device=kv.device)
    keep = pos[None, :] < seq_lens.long()[:, None]                              # [B, S]
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    return _safe_softmax_av(s, kv[..., :L]).to(q_lat.dtype)


# ----------------------------------------------------------------------------------------------
# 3. paged ragged prefill (causal over the cached prefix + new tokens)
# ----------------------------------------------------------------------------------------------
def mla_prefill_ref(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q_lat [Tq, H, L], q_rope [Tq, H, R]; seq_lens [B] (incl. new tokens); query_start_loc [B+1].
    Query i of sequence b sits at position seq_lens[b] - q_len_b + i and attends positions <= it.

    Scores are taken against the keys of every sequence ([Tq, H, B*S]) and masked to the query's own
    sequence: shape-static, memory Tq*H*B*S floats (fine for tests and short CPU prompts)."""
    L = q_lat.shape[-1]
    Tq = q_lat.shape[0]
    kv = _gather_pages(cache, block_table).float()                               # [B, S, L+R]
    B, S, _ = kv.shape
    qsl = query_start_loc.long()
    tok = torch.arange(Tq, device=q_lat.device)
    seq_of = torch.searchsorted(qsl[1:].contiguous(), tok, right=True).clamp(max=B - 1)   # [Tq]
    q_len = qsl[1:] - qsl[:-1]
    qpos = seq_lens.long()[seq_of] - q_len[seq_of] + (tok - qsl[seq_of])         # [Tq]
    flat = kv.reshape(B * S, -1)
    s = (torch.einsum("thl,nl->thn", q_lat.float(), flat[:, :L])
         + torch.einsum("thr,nr->thn", q_rope.float(), flat[:, L:])) * scale      # [Tq, H, B*S]
    kb = torch.arange(B, device=kv.device).repeat_interleave(S)                  # key's sequence
    kp = torch.arange(S, device=kv.device).repeat(B)                             # key's position
    keep = (kb[None, :] == seq_of[:, None]) & (kp[None, :] <= qpos[:, None])     # [Tq, B*S]
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    return _safe_softmax_av(s, flat[:, :L]).to(q_lat.dtype)


# ----------------------------------------------------------------------------------------------
# 4. dense drop-in (HF cache layout)
# ----------------------------------------------------------------------------------------------
def dense_scores_mask(scores: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """Apply SDPA's mask semantics to scores [B, H, T, S] (already scaled): bool mask True = attend,
    float mask additive; is_causal: key j allowed for query i iff j <= i + S - T (bottom-right)."""
    T, S = scores.shape[-2:]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    if is_causal:
        i = torch.arange(T, device=scores.device)[:, None]
        j = torch.arange(S, device=scores.device)[None, :]
        scores = scores.masked_fill(j > i + (S - T), float("-inf"))
    return scores


def mla_attention_dense_ref(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                            k_rope: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                            scale: float) -> torch.Tensor:
    """q_lat [B, H, T, L], q_rope [B, H, T, R], latent [B, S, L], k_rope [B, S, R],
    attn_mask [B|1, 1, T, S] bool/float or None -> o_lat [B, H, T, L]. Rows with every key at -inf
    give zeros (SDPA gives NaN there)."""
    lat = latent.float()[:, None]                                               # [B, 1, S, L]
    s = (torch.matmul(q_lat.float(), lat.transpose(-1, -2))
         + torch.matmul(q_rope.float(), k_rope.float()[:, None].transpose(-1, -2))) * scale
    s = dense_scores_mask(s, attn_mask, is_causal)
    return _safe_softmax_av(s, lat).to(q_lat.dtype)


def expanded_attention_ref(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                           k_rope: torch.Tensor, kv_b_weight: torch.Tensor, v_dim: int,
                           attn_mask: torch.Tensor | None, is_causal: bool, scale: float) -> torch.Tensor:
    """HF's math, expanded (what DeepseekV2/V3Attention computes): keys = [kv_b(latent) nope part,
    k_rope], values = kv_b(latent) value part. q_nope [B, H, T, P], q_rope [B, H, T, R],
    latent [B, S, L], k_rope [B, S, R] -> out [B, H, T, V] (fp32)."""
    B, H, T, P = q_nope.shape
    S = latent.shape[1]
    kv = torch.nn.functional.linear(latent.float(), kv_b_weight.float())        # [B, S, H*(P+V)]
    kv = kv.view(B, S, H, P + v_dim).transpose(1, 2)                            # [B, H, S, P+V]
    k = torch.cat([kv[..., :P], k_rope.float()[:, None].expand(B, H, S, -1)], dim=-1)
    v = kv[..., P:]
    q = torch.cat([q_nope.float(), q_rope.float()], dim=-1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = dense_scores_mask(s, attn_mask, is_causal)
    return _safe_softmax_av(s, v)


def check_step_args(q_nope: Tensor, w_uk: Tensor, kv: Tensor, norm_weight: Tensor, k_rope: Tensor, buf: Tensor,
                    slots: Tensor) -> None:
    """The shapes ``mla_step_prep_ref`` / ``triton_step.mla_step_prep_triton`` take."""
    B, H, P = q_nope.shape
    L, R = kv.shape[-1], k_rope.shape[-1]
    assert w_uk.shape == (H, P, L) and kv.shape == (B, L) and k_rope.shape == (B, R) and slots.shape == (B,), \
        f"q_nope [B, H, P], w_uk [H, P, L], kv [B, L], k_rope [B, R], slots [B] disagree: {tuple(q_nope.shape)}, " \
        f"{tuple(w_uk.shape)}, {tuple(kv.shape)}, {tuple(k_rope.shape)}, {tuple(slots.shape)}"
    assert buf.dim() == 3 and buf.shape[1] == 1 and buf.shape[2] == L + R and buf.stride(2) == 1, \
        f"buf must be [rows, 1, {L + R}] with contiguous rows, got {tuple(buf.shape)}"
    assert norm_weight.shape == (L,), f"norm weight must be [{L}], got {tuple(norm_weight.shape)}"


def mla_step_prep_ref(q_nope: Tensor, w_uk: Tensor, kv: Tensor, norm_weight: Tensor, eps: float, k_rope: Tensor,
                      buf: Tensor, slots: Tensor) -> Tensor:
    """q_nope [B, H, P], w_uk [H, P, L], kv [B, L] (before the norm), norm_weight [L], k_rope [B, R], buf [rows, 1,
    L + R] (written at rows ``slots`` [B]) -> q_lat [B, H, L] in q's dtype. Plain torch."""
    check_step_args(q_nope, w_uk, kv, norm_weight, k_rope, buf, slots)
    normed = add_rms_norm_ref(kv, None, norm_weight, eps, kv.dtype != torch.float32, buf.dtype)[0]
    buf.index_copy_(0, slots, torch.cat([normed, k_rope.to(buf.dtype)], -1)[:, None])
    return per_head_matmul(q_nope[:, :, None], w_uk)[:, :, 0]
