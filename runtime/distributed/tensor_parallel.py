"""Tensor parallelism over ``torch.distributed``: an HF model's weights sharded in place over the ranks of a process
group, one all-reduce per attention and per MLP / MoE block.

Every rank holds the whole model first (it built or loaded it); ``shard_model`` keeps the rank's share:
- attention with HF's q/k/v/o projections: query and key/value heads split evenly (q/k/v output rows with their
  biases, o_proj input columns, o_proj's bias on rank 0 only, learned sinks by head); MLA (DeepSeek): q_proj or
  q_b_proj and kv_b_proj split by head, the latent projection and its norm replicated, so that every rank caches the
  whole latent and the engine's latent cache is replicated.
- dense MLPs (gate / up / down projections): the intermediate width split.
- MoE blocks (``graphs.modules.classify``): the router replicated, so every rank routes every token alike; each
  expert's intermediate width split (fused [E, 2I, H] or [E, H, 2I] gate-up weights with gate and up as halves or
  interleaved, per-expert MLP modules), shared experts split, a shared expert's gate replicated.
- Mamba2-style SSM mixers and Qwen3-Next's Gated DeltaNet: heads split (mixers.py), each rank caching its heads'
  states; other SSM / delta-rule mixers (Mamba1, Kimi's KDA) replicated (every rank runs the whole mixer and keeps
  its whole state).
With ``expert_parallel`` a MoE block's routed experts are split by index instead (each rank holds E / N whole experts,
``LocalExperts``; every rank still routes every token, as attention's heads are split and the tokens replicated, so
the combine is the same all-reduce and no all-to-all is needed).
The sharded module's output is then a partial sum: the module is wrapped in ``AllReduced``, which sums it over the
group with a functional collective (dynamo traces it; the region passes see the inner module whole and prove their
rewrites on its partial outputs). The token embedding and the LM head are split by vocabulary rows (plain
``nn.Embedding`` / ``nn.Linear`` only, one weight when tied): a masked lookup plus an all-reduce, and an all-gather of
the logits so that every rank samples from the whole vocabulary. Norms are replicated.

Nothing is sharded on faith. Each MLP, MoE, SSM and delta-rule block is probed before and after: the all-reduced output of the shards
on a random input, with uninitialised memory filled with NaN, must equal the whole block's, or the block stays replicated (an expert layout tried in turn); a
module of none of these shapes stays replicated too. At the end the whole model is probed on a short prompt; logits
that differ from the unsharded model's refuse the model (``TensorParallelError``). ``ShardReport`` lists what was split
and what was kept whole, and why.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_reduce, group_size
from .mixers import shard_gated_deltanet, shard_mamba2

#: relative tolerance of the probes, by the model's dtype (sums in another order than the unsharded model's)
PROBE_TOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 3e-2, torch.float16: 5e-3}


class TensorParallelError(ValueError):
    """A model that tensor parallelism cannot run exactly (the message names what and why)."""


@dataclass
class ShardReport:
    world: int
    split: list[str] = field(default_factory=list)     # "path: what"
    replicated: list[str] = field(default_factory=list)  # "path: why"

    def summary(self) -> str:
        return (f"tensor parallel over {self.world} ranks: {len(self.split)} modules split, "
                f"{len(self.replicated)} replicated")


class AllReduced(nn.Module):
    """``inner`` (a sharded attention, MLP or MoE block) with its output summed over ``group``; for a tuple output,
    its first element (HF attention returns (output, weights), some MoE blocks (output, router logits))."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if isinstance(out, tuple):
            return (all_reduce(out[0], self.group), *out[1:])
        return all_reduce(out, self.group)


# -- slicing ------------------------------------------------------------------------------------------------------
def _rows(lin: nn.Linear, idx: torch.Tensor) -> None:
    lin.weight = nn.Parameter(lin.weight.data[idx].clone(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias.data[idx].clone(), requires_grad=False)
    lin.out_features = len(idx)


def _cols(lin: nn.Linear, idx: torch.Tensor, rank: int) -> None:
    lin.weight = nn.Parameter(lin.weight.data[:, idx].clone(), requires_grad=False)
    if lin.bias is not None and rank != 0:  # a row-parallel bias is added once, by rank 0
        lin.bias = nn.Parameter(torch.zeros_like(lin.bias.data), requires_grad=False)
    lin.in_features = len(idx)


def _share(n: int, rank: int, world: int, unit: int = 1) -> torch.Tensor:
    """Indices of rank's contiguous share of n // unit units of ``unit`` elements."""
    per = n // unit // world
    return torch.arange(rank * per * unit, (rank + 1) * per * unit)


def _linear(m: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(m, name, None)
    return child if isinstance(child, nn.Linear) else None


# -- attention ----------------------------------------------------------------------------------------------------
def _attention_plan(m: nn.Module, world: int) -> tuple[str | None, str]:
    """("mha" | "mla" | None, why not) for a module with HF's attention projections."""
    o = _linear(m, "o_proj")
    if o is None:
        return None, ""
    if _linear(m, "kv_b_proj") is not None and (_linear(m, "q_proj") or _linear(m, "q_b_proj")):
        heads = getattr(m, "num_heads", None)
        if not isinstance(heads, int):
            return None, "an MLA attention without num_heads"
        return ("mla", "") if heads % world == 0 else (None, f"{heads} heads do not split over {world} ranks")
    q, k, v = (_linear(m, n) for n in ("q_proj", "k_proj", "v_proj"))
    hd = getattr(m, "head_dim", None)
    if q is None or k is None or v is None or not isinstance(hd, int):
        return None, "attention projections other than q/k/v/o_proj with a head_dim"
    heads, kv = q.out_features // hd, k.out_features // hd
    if heads * hd != q.out_features or kv * hd != k.out_features or v.out_features % kv:
        return None, "projection widths that are not whole heads"
    if heads % world or kv % world:
        return None, f"{heads} query / {kv} key-value heads do not split over {world} ranks"
    return "mha", ""


def _shard_attention(m: nn.Module, kind: str, rank: int, world: int) -> str:
    if kind == "mla":
        heads = m.num_heads
        q = _linear(m, "q_proj") or _linear(m, "q_b_proj")
        _rows(q, _share(q.out_features, rank, world, q.out_features // heads))
        kvb = m.kv_b_proj
        _rows(kvb, _share(kvb.out_features, rank, world, kvb.out_features // heads))
        _cols(m.o_proj, _share(m.o_proj.in_features, rank, world, m.o_proj.in_features // heads), rank)
        m.num_heads = heads // world
        return f"MLA, {heads // world} of {heads} heads per rank (latent replicated)"
    hd = m.head_dim
    heads, kv = m.q_proj.out_features // hd, m.k_proj.out_features // hd
    _rows(m.q_proj, _share(m.q_proj.out_features, rank, world, hd))
    for lin in (m.k_proj, m.v_proj):
        _rows(lin, _share(lin.out_features, rank, world, lin.out_features // kv))
    _cols(m.o_proj, _share(m.o_proj.in_features, rank, world, m.o_proj.in_features // heads), rank)
    sinks = getattr(m, "sinks", None)
    if isinstance(sinks, nn.Parameter) and sinks.shape[0] == heads:
        m.sinks = nn.Parameter(sinks.data[_share(heads, rank, world)].clone(), requires_grad=False)
    for attr, n in (("num_heads", heads), ("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if isinstance(getattr(m, attr, None), int):
            setattr(m, attr, n // world)
    return f"{heads // world} of {heads} query heads, {kv // world} of {kv} key-value heads per rank"


# -- MLPs and experts ---------------------------------------------------------------------------------------------
def _is_mlp(m: nn.Module) -> bool:
    return all(_linear(m, n) is not None for n in ("gate_proj", "up_proj", "down_proj"))


def _shard_mlp(m: nn.Module, rank: int, world: int) -> str:
    width = m.gate_proj.out_features
    if width % world or m.up_proj.out_features != width:
        raise ValueError(f"intermediate width {width} does not split over {world} ranks")
    idx = _share(width, rank, world)
    _rows(m.gate_proj, idx)
    _rows(m.up_proj, idx)
    _cols(m.down_proj, idx, rank)
    for attr in ("intermediate_size", "intermediate_dim"):
        if getattr(m, attr, None) == width:
            setattr(m, attr, width // world)
    return f"intermediate {width // world} of {width} per rank"


def _shard_fused_experts(m: nn.Module, layout: str, rank: int, world: int, hidden: int) -> str:
    """Experts as parameters gate_up_proj [E, 2I, H] (or [E, H, 2I]) and down_proj [E, H, I] (or [E, I, H])."""
    gu, down = m.gate_up_proj, m.down_proj
    # F.linear's layout, down [E, H, I] with gate-up [E, 2I, H], or its transpose, down [E, I, H] with [E, H, 2I]
    inner_last = down.shape[1] == hidden and gu.shape[2] == hidden
    width = down.shape[2] if inner_last else down.shape[1]
    gu_dim = 1 if inner_last else 2
    if width % world or gu.shape[gu_dim] != 2 * width:
        raise ValueError(f"expert width {width} does not split over {world} ranks")
    own = _share(width, rank, world)
    gu_idx = torch.cat([own, own + width]) if layout == "halves" else torch.stack([2 * own, 2 * own + 1], 1).view(-1)
    m.gate_up_proj = nn.Parameter(gu.data.index_select(gu_dim, gu_idx.to(gu.device)).clone(), requires_grad=False)
    bias = getattr(m, "gate_up_proj_bias", None)
    if isinstance(bias, nn.Parameter):
        m.gate_up_proj_bias = nn.Parameter(bias.data[:, gu_idx.to(bias.device)].clone(), requires_grad=False)
    m.down_proj = nn.Parameter(down.data.index_select(2 if inner_last else 1, own.to(down.device)).clone(), requires_grad=False)
    bias = getattr(m, "down_proj_bias", None)
    if isinstance(bias, nn.Parameter) and rank != 0:
        m.down_proj_bias = nn.Parameter(torch.zeros_like(bias.data), requires_grad=False)
    for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
        if getattr(m, attr, None) == width:
            setattr(m, attr, width // world)
    return f"{gu.shape[0]} experts, intermediate {width // world} of {width} per rank ({layout} gate-up)"


class LocalExperts(nn.Module):
    """Expert parallelism: this rank's slots of a fused experts module (HF's ``forward(hidden, top_k_index,
    top_k_weights)``), each ``(expert, replica, replicas)`` as balance.py places them: the rank computes the routes to
    a slot's expert from token rows ``t`` with ``t % replicas == replica``. Any other route becomes the index one past
    the local slots, which HF's expert loop skips (its one-hot has ``num_experts + 1`` classes), with weight 0; the
    block's all-reduce adds the other ranks' routes. ``routed`` counts the tokens routed to each expert (the same on
    every rank: the router is replicated), ``computed`` the routes this rank computed."""

    def __init__(self, inner: nn.Module, slots: list[tuple[int, int, int]], num_experts: int, block: str = ""):
        super().__init__()
        ids = torch.tensor([e for e, _, _ in slots], dtype=torch.long)
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            p = getattr(inner, name, None)
            if isinstance(p, nn.Parameter):  # an expert's biases belong to it: taken with it, not zeroed
                setattr(inner, name, nn.Parameter(p.data[ids.to(p.device)].clone(), requires_grad=False))
        inner.num_experts = len(slots)
        if hasattr(inner, "_is_expert_parallel"):  # HF's experts kernels (grouped_mm, ...) then mask the skipped
            inner._is_expert_parallel = True       # index's rows, which they otherwise leave uninitialised
        dev = inner.down_proj.device
        slot_of = torch.full((num_experts,), len(slots), dtype=torch.long)
        rep_j, rep_n = torch.zeros(num_experts, dtype=torch.long), torch.ones(num_experts, dtype=torch.long)
        for i, (e, j, n) in enumerate(slots):
            slot_of[e], rep_j[e], rep_n[e] = i, j, n
        self.register_buffer("slot_of", slot_of.to(dev), persistent=False)
        self.register_buffer("rep_j", rep_j.to(dev), persistent=False)
        self.register_buffer("rep_n", rep_n.to(dev), persistent=False)
        self.register_buffer("routed", torch.zeros(num_experts, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("computed", torch.zeros((), dtype=torch.long, device=dev), persistent=False)
        self.inner, self.slots, self.num_global, self.block = inner, list(slots), num_experts, block

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        n_local = len(self.slots)
        row = torch.arange(top_k_index.shape[0], device=top_k_index.device).view(-1, *[1] * (top_k_index.dim() - 1))
        slot = self.slot_of[top_k_index]
        local = (slot < n_local) & (row % self.rep_n[top_k_index] == self.rep_j[top_k_index])
        index = torch.where(local, slot, torch.full_like(slot, n_local)).to(top_k_index.dtype)
        weights = torch.where(local, top_k_weights, torch.zeros_like(top_k_weights))
        flat = top_k_index.reshape(-1).long()
        self.routed.index_add_(0, flat, torch.ones_like(flat))
        self.computed.add_(local.sum())
        return self.inner(hidden_states, index, weights, *args, **kwargs)


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of a token embedding: an id this rank holds looks up its row, any other gives zeros, and the
    all-reduce sums the one row each id has on some rank."""

    def __init__(self, weight: nn.Parameter, lo: int, hi: int, group):
        super().__init__()
        self.weight, self.lo, self.hi, self.group = weight, lo, hi, group
        self.num_embeddings = hi - lo  # this rank's; the whole vocabulary is the model config's
        self.embedding_dim = weight.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        rows = nn.functional.embedding(torch.where(mine, ids - self.lo, torch.zeros_like(ids)), self.weight)
        return all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype), self.group)


class VocabParallelHead(nn.Module):
    """Rows [lo, lo + per) of the LM head (zero rows past the vocabulary, so every rank's slice is ``per`` wide): each
    rank computes its logits, an all-gather puts the whole vocabulary on every rank (samplers see every logit)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, lo: int, per: int, vocab: int, group):
        super().__init__()
        self.weight, self.bias, self.lo, self.per, self.vocab, self.group = weight, bias, lo, per, vocab, group
        self.in_features, self.out_features = weight.shape[1], vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol
        local = nn.functional.linear(x, self.weight, self.bias)  # [..., per]
        world = group_size(self.group)
        if world == 1:
            return local[..., :self.vocab]
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the newer name where it exists
        parts = gather(local.reshape(1, -1, self.per).contiguous(), 0, self.group)  # [W, N, per]
        return parts.permute(1, 0, 2).reshape(*x.shape[:-1], world * self.per)[..., :self.vocab]


def _rows_padded(w: torch.Tensor, lo: int, per: int) -> torch.Tensor:
    """Rows [lo, lo + per) of ``w``, zero rows past its end."""
    out = w.new_zeros(per, *w.shape[1:])
    n = max(0, min(per, w.shape[0] - lo))
    out[:n] = w[lo:lo + n]
    return out


def _shard_vocab(model: nn.Module, rank: int, world: int, group) -> tuple[list[str], list[str]]:
    """The token embedding and the LM head split by vocabulary rows (one weight when they are tied): (split, kept)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    vocab = emb.num_embeddings if isinstance(emb, nn.Embedding) else None
    split, kept = [], []
    plain_emb = type(emb) is nn.Embedding and emb.max_norm is None and vocab is not None
    plain_head = type(head) is nn.Linear and vocab is not None and head.out_features == vocab
    tied = plain_head and head.weight is getattr(emb, "weight", None)
    if not plain_emb:
        kept.append(f"embeddings kept whole ({type(emb).__name__}: only a plain nn.Embedding is split)")
    if not plain_head:
        kept.append(f"LM head kept whole ({type(head).__name__}: only a plain nn.Linear over the embedding's "
                    "vocabulary is split)")
    if tied and not plain_emb:  # one weight for both: split both or neither
        return split, kept + ["LM head kept whole (tied to the embeddings, which stay whole)"]
    per = -(-vocab // world) if vocab else 0
    lo = rank * per
    shared = None
    if plain_emb:
        shared = nn.Parameter(_rows_padded(emb.weight.data, lo, per), requires_grad=False)
        model.set_input_embeddings(VocabParallelEmbedding(shared, lo, min(vocab, lo + per), group))
        split.append(f"embeddings: rows {lo}-{min(vocab, lo + per) - 1} of {vocab}")
    if plain_head:
        weight = shared if tied else nn.Parameter(_rows_padded(head.weight.data, lo, per), requires_grad=False)
        bias = None if head.bias is None else nn.Parameter(_rows_padded(head.bias.data, lo, per), requires_grad=False)
        model.set_output_embeddings(VocabParallelHead(weight, bias, lo, per, vocab, group))
        split.append(f"LM head: rows {lo}-{min(vocab, lo + per) - 1} of {vocab}" + (" (tied)" if tied else ""))
    return split, kept


def _fused_experts(m: nn.Module) -> bool:
    return isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and \
        isinstance(getattr(m, "down_proj", None), nn.Parameter)


def _shard_moe(block: nn.Module, layout: str, rank: int, world: int, hidden: int, path: str = "",
               placement: dict | None = None) -> str:
    """Every expert and shared expert of ``block`` (its router and gates untouched). ``layout`` "experts": expert
    parallelism (``LocalExperts``; ``placement[path]``: balance.py's slots per rank, else contiguous experts) for the
    routed experts, shared experts split by width."""
    from . import balance
    done = []
    for name, m in list(block.named_modules()):
        if _fused_experts(m) and layout == "experts":
            e = m.gate_up_proj.shape[0]
            if e % world or not name:
                raise ValueError(f"{e} experts do not split over {world} ranks")
            slots = (placement or {}).get(path) or balance.contiguous(e, world)
            balance.check_placement(slots, e, world, f" of {path}")
            _set_child(block, name, LocalExperts(m, slots[rank], e, path))
            own = slots[rank]
            if (placement or {}).get(path):
                done.append(f"{len(own)} slots of {e} experts on this rank (placed: experts "
                            f"{[x for x, _, _ in own]}, {sum(n > 1 for _, _, n in own)} of them replicas)")
            else:
                done.append(f"experts {own[0][0]}-{own[-1][0]} of {e} on this rank")
        elif _fused_experts(m):
            done.append(_shard_fused_experts(m, layout, rank, world, hidden))
        elif _is_mlp(m):
            done.append(f"{name}: {_shard_mlp(m, rank, world)}")
    if not done:
        raise ValueError("no experts of a known layout (gate_up_proj / down_proj parameters or gate/up/down MLPs)")
    return "; ".join(done[:2]) + (f"; ... ({len(done)} parts)" if len(done) > 2 else "")


# -- probes -------------------------------------------------------------------------------------------------------
def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def _probe_input(hidden: int, param: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)  # the same on every rank
    return torch.randn(1, 5, hidden, generator=g).to(param.device, param.dtype)


class _nan_filled_empties:
    """torch.empty and friends return NaN-filled memory inside (deterministic mode's fill_uninitialized_memory;
    warn_only, so no op is refused)."""

    def __enter__(self):
        import torch.utils.deterministic as det
        self.saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                      det.fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True, warn_only=True)
        det.fill_uninitialized_memory = True

    def __exit__(self, *exc):
        import torch.utils.deterministic as det
        torch.use_deterministic_algorithms(self.saved[0], warn_only=self.saved[1])
        det.fill_uninitialized_memory = self.saved[2]


@torch.no_grad()
def _try_block(block: nn.Module, shard, group, x: torch.Tensor, tol: float) -> tuple[nn.Module | None, str]:
    """Shard a copy of ``block`` with ``shard(copy)`` and wrap it; (the wrapped copy, what) when the all-reduced
    output of the shards equals the block's on ``x``, else (None, why)."""
    import copy
    ref = _first(block(x))
    trial = copy.deepcopy(block)
    try:
        what = shard(trial)
    except ValueError as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001  (a module unlike what the split expects: it stays whole)
        return None, f"the split fails: {type(e).__name__}: {str(e)[:120]}"
    wrapped = AllReduced(trial, group)
    try:
        with _nan_filled_empties():  # a shard that reads memory it never wrote fails here, not later by chance
            err = _rel_err(_first(wrapped(x)), ref)
    except Exception as e:  # noqa: BLE001  (the module's code assumes widths the shards no longer have)
        return None, f"the sharded block fails: {type(e).__name__}: {str(e)[:120]}"
    return (wrapped, what) if err <= tol else (None, f"the shards' sum differs from the block by {err:.1e}")


# -- the model ----------------------------------------------------------------------------------------------------
def _set_child(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


@torch.no_grad()
def shard_model(model: nn.Module, group=None, expert_parallel: bool = False,
                expert_placement: dict | None = None) -> ShardReport:
    """Shard ``model`` in place over ``group`` (default: the whole world), as the module docstring says; with
    ``expert_parallel`` MoE blocks split their routed experts by index first (``LocalExperts``), by width where that
    does not hold (``expert_placement``: balance.py's slots per MoE block path, replicas of hot experts included).
    Raises ``TensorParallelError`` when the sharded model's logits on a probe prompt differ from the
    unsharded model's."""
    from graphs.modules import DELTA, MOE, SSM, classify

    from . import balance
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    report = ShardReport(world)
    placement = dict(expert_placement or {})
    blocks = {p for p, m in model.named_modules() if classify(m) == MOE}
    if placement.keys() - blocks:
        raise ValueError(f"expert placement names {sorted(placement.keys() - blocks)[:3]}, which are not MoE blocks of "
                         f"{type(model).__name__} (its blocks: {sorted(blocks)[:3]}...)")
    config = model.config.get_text_config()
    hidden = config.hidden_size
    param = next(model.parameters())
    tol = PROBE_TOL.get(param.dtype, 1e-4)
    vocab = config.vocab_size
    prompt = (torch.arange(7, device=param.device)[None] * 37 + 3) % vocab
    want = model(prompt, use_cache=False).logits
    x = _probe_input(hidden, param)
    taken: list[str] = []
    for path, m in list(model.named_modules()):
        if not path or any(path.startswith(t + ".") for t in taken):
            continue
        if classify(m) == MOE:
            taken.append(path)
            why = ""
            if expert_parallel and path in placement:
                e = next((x.gate_up_proj.shape[0] for x in m.modules() if _fused_experts(x)), None)
                if e is None:
                    raise ValueError(f"expert placement names {path}, whose experts are not one fused module")
                balance.check_placement(placement[path], e, world, f" of {path}")
            for layout in (("experts",) if expert_parallel else ()) + ("halves", "interleaved"):
                wrapped, what = _try_block(m, lambda b, lay=layout: _shard_moe(b, lay, rank, world, hidden, path,
                                                                                        expert_placement), group,
                                           x, tol)
                if wrapped is not None:
                    _set_child(model, path, wrapped)
                    report.split.append(f"{path}: MoE, {what}" + (" (width: experts by index failed: "
                                                                   f"{why})" if why and expert_parallel else ""))
                    break
                why = why or what
            else:
                report.replicated.append(f"{path}: MoE block kept whole ({why})")
            continue
        def split_or_keep(shard, split: str, kept: str) -> None:
            """``m`` sharded by ``shard`` where the probe proves it, else kept whole; the report says which."""
            taken.append(path)
            wrapped, what = _try_block(m, shard, group, x, tol)
            if wrapped is not None:
                _set_child(model, path, wrapped)
                report.split.append(f"{path}: {split}, {what}")
            else:
                report.replicated.append(f"{path}: {kept} kept whole ({what})")
        if classify(m) == SSM:
            split_or_keep(lambda b: shard_mamba2(b, rank, world, group), "SSM mixer", "ssm mixer")
            continue
        if classify(m) == DELTA:
            split_or_keep(lambda b: shard_gated_deltanet(b, rank, world), "delta mixer", "delta mixer")
            continue
        kind, why = _attention_plan(m, world)
        if kind is not None:
            taken.append(path)
            what = _shard_attention(m, kind, rank, world)
            _set_child(model, path, AllReduced(m, group))
            report.split.append(f"{path}: attention, {what}")
        elif why:
            taken.append(path)
            report.replicated.append(f"{path}: attention kept whole ({why})")
        elif _is_mlp(m):
            split_or_keep(lambda b: _shard_mlp(b, rank, world), "MLP", "MLP")
    split, kept = _shard_vocab(model, rank, world, group)
    report.split += split
    report.replicated += kept
    got = model(prompt, use_cache=False).logits
    err = _rel_err(got, want)
    if not err <= tol:
        raise TensorParallelError(f"tensor_parallel={world}: {type(model).__name__}'s sharded logits differ from the "
                                  f"whole model's by {err:.1e} on a probe prompt (what was split: "
                                  f"{'; '.join(report.split[:3])}...); run it with tensor_parallel=1")
    return report
