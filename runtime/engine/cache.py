"""The engine's caches, as an HF ``Cache`` the unmodified model writes into.

- Attention and MLA layers: one paged buffer per layer, ``[num_blocks * block_size, heads, Dv + Dk]``
  (for MLA: heads = 1, kv_lora_rank + rope dim = 576 values per token, rows ``[latent | rope]`` when the
  engine decodes them paged); ``update`` writes the step's tokens at ``write_slots`` and returns the
  keys/values gathered by ``gather_idx`` ([B, S] flat rows; padding rows point at the reserved block 0 and are
  masked out). On a paged decode step it returns instead the buffer itself (MHA/GQA, see ``attention.py``)
  or, for MLA layers, the gather as ``hybrid::paged_gather`` with the step's block table and lengths
  (``hybrid_kernels/mla/ops.py``). On a packed step it returns the buffer (MHA/GQA) or, for MLA layers, the first
  new token's latents only: the packed attention reads the pages itself (``attention.py``).
- SSM layers: conv and ssm state buffers ``[num_state_rows, ...]``. Running sequences own rows 0..n-1;
  a decode step binds prefix views (HF updates them in place), a first prefill chunk binds nothing and HF
  creates fresh states, which the runner then copies into the new sequence's row; a later chunk binds that
  row (HF continues from it in place; only for mixers that do, ``chunking_problem``). On a packed step nothing is
  bound for HF: the mixers' engine forward reads the step's maps and the buffers (``packed_states.py``).
All buffers and step metadata are tensors held by the cache object, so under ``torch.compile`` they are
graph inputs, never Python globals. Buffers (and the decode views of state buffers, made once per batch
size) are marked as static addresses: CUDA graphs read and update them in place instead of copying them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, LinearAttentionLayer

from hybrid_kernels.mla.ops import write_rows

from .features import Unsupported, cache_layer_kind


@dataclass
class LayerSpec:
    kind: str  # "attention" | "ssm" | "attention+ssm" (both in one layer) | "none" (a layer that caches nothing)
    heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    conv_shape: tuple = ()  # () when the layer keeps no conv state
    ssm_shape: tuple = ()   # () when it keeps no recurrent state
    conv_dtype: torch.dtype = torch.float32
    ssm_dtype: torch.dtype = torch.float32
    #: sliding-window attention: the window HF's cache keeps (the attention function applies it, attention.py)
    window: int | None = None
    #: HF's cache keeps only ``window`` keys but the layer's attention call passes no window: HF's cached generate
    #: then differs from the model's own forward once a sequence is longer than the window (engine.py caps lengths)
    window_unapplied: bool = False

    @property
    def keys(self) -> bool:
        return self.kind in ("attention", "attention+ssm")

    @property
    def states(self) -> bool:
        return self.kind in ("ssm", "attention+ssm")

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.heads * (self.k_dim + self.v_dim) * dtype.itemsize if self.keys else 0

    def bytes_per_state_row(self) -> int:
        if not self.states:
            return 0
        n = lambda s: int(torch.tensor(s).prod().item()) if s else 0  # noqa: E731
        return n(self.conv_shape) * self.conv_dtype.itemsize + n(self.ssm_shape) * self.ssm_dtype.itemsize


class _windows_passed:
    """Records, per layer index, whether the model's attention call passed a ``sliding_window`` (through HF's
    attention interface for the model's implementation; models calling their own code are not seen)."""

    def __init__(self, model):
        self.impl = getattr(model.config.get_text_config(), "_attn_implementation", None)

    def __enter__(self) -> dict[int, bool]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns
        self.passed: dict[int, bool] = {}
        self.fns, self.saved = fns, fns._local_mapping.get(self.impl)
        inner = fns.get(self.impl) if self.impl else None
        if inner is not None:
            def recording(module, *args, sliding_window=None, **kwargs):
                idx = getattr(module, "layer_idx", None)
                if isinstance(idx, int):
                    self.passed[idx] = self.passed.get(idx, False) or bool(sliding_window)
                return inner(module, *args, sliding_window=sliding_window, **kwargs)
            fns._local_mapping[self.impl] = recording
        return self.passed

    def __exit__(self, *exc):
        if self.saved is not None:
            self.fns._local_mapping[self.impl] = self.saved
        else:
            self.fns._local_mapping.pop(self.impl, None)


def discover_layers(model, kwarg: str) -> list[LayerSpec]:
    """Run a 2-token prefill with HF's own DynamicCache and read what every layer cached (features.py says which
    cache layers the engine runs; others raise ``Unsupported``)."""
    from transformers import DynamicCache
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad(), _windows_passed(model) as passed:
            model(torch.tensor([[1, 2]], device=device), use_cache=True, **{kwarg: cache})
    except Exception as e:  # noqa: BLE001  (the model keeps a cache of its own kind)
        raise Unsupported(f"{type(model).__name__}'s cache: a prefill with HF's DynamicCache failed "
                          f"({' '.join(f'{type(e).__name__}: {e}'.split())[:200]})") from e
    specs = []
    for layer in cache.layers:
        kind = cache_layer_kind(layer)
        spec = LayerSpec(kind)
        if spec.states:
            conv, ssm = layer.conv_states.get(0), layer.recurrent_states.get(0)
            spec.conv_shape = tuple(conv.shape[1:]) if conv is not None else ()
            spec.ssm_shape = tuple(ssm.shape[1:]) if ssm is not None else ()
            spec.conv_dtype = conv.dtype if conv is not None else torch.float32
            spec.ssm_dtype = ssm.dtype if ssm is not None else torch.float32
        if spec.keys:
            k, v = layer.keys, layer.values
            spec.window = getattr(layer, "sliding_window", None)
            i = len(specs)
            if spec.window and i in passed and not passed[i]:
                spec.window_unapplied = True  # HF's cache drops keys its attention call would still have used
            if k.shape[-2] != 2 and not spec.window:  # a window shorter than 2 may keep fewer rows
                raise Unsupported(f"a model that caches {k.shape[-2]} key rows for a 2-token prompt (it adds tokens "
                                  "of its own, e.g. a learned prompt); the engine writes one cache row per token")
            spec.heads, spec.k_dim, spec.v_dim = k.shape[1], k.shape[-1], v.shape[-1]
        specs.append(spec)
    if not any(s.keys or s.states for s in specs):
        raise Unsupported(f"{type(model).__name__}: a prompt left HF's DynamicCache empty (the model keeps its state "
                          "some other way)")
    return specs


def chunking_problem(model, num_state_layers: int) -> str | None:
    """None when every state-layer mixer in ``model`` (SSM or gated delta rule) continues a multi-token call from
    HF's cached states as one call over all the tokens would (then the engine may prefill in chunks), else why not.

    Probed on a CPU copy of one mixer per class, 13 random tokens as 6 + 7, against one call over all 13. HF's
    scans run in fp32 whatever the copy's dtype: an exact continuation differs by fp32 rounding (1e-8 to 1e-5
    relative, growing with the width); HF's Mamba1 scan, which restarts from a zero state on every multi-token
    call, by ~1e-3 on the tiny zoo model. State layers of other kinds (no mixer hybrid recognises) are not probed:
    no chunking."""
    import copy

    from transformers import DynamicCache

    from graphs.modules import DELTA, SSM, classify
    mixers = [m for m in model.modules() if classify(m) in (SSM, DELTA)]
    if len(mixers) != num_state_layers:
        return (f"{num_state_layers} state layers but {len(mixers)} SSM / delta-rule mixers hybrid can probe: prompts "
                "are prefilled whole")
    first = lambda y: y[0] if isinstance(y, tuple) else y  # noqa: E731  (mixers may return (out, ...))
    width = model.config.get_text_config().hidden_size
    seen = set()
    for mod in mixers:
        if type(mod) in seen:
            continue
        seen.add(type(mod))
        # a CPU copy without a second copy on the device (the caches may already hold most of its memory)
        memo = {id(t): torch.nn.Parameter(t.detach().to("cpu", torch.float64), requires_grad=False)
                for t in mod.parameters()}
        memo.update({id(t): t.detach().to("cpu", torch.float64 if t.is_floating_point() else t.dtype)
                     for t in mod.buffers()})
        try:
            probe = copy.deepcopy(mod, memo)
            x = torch.randn(1, 13, width, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
            with torch.no_grad():
                whole = first(probe(x))
                cache = DynamicCache(config=model.config)
                first(probe(x[:, :6], cache=cache))
                rest = first(probe(x[:, 6:], cache=cache))
        except Exception as e:  # noqa: BLE001  (a mixer the probe cannot run: no chunking, and say why)
            return f"probing {type(mod).__name__} failed ({type(e).__name__}: {e}): prompts are prefilled whole"
        err = ((rest - whole[:, 6:]).abs().max() / whole.abs().max().clamp_min(1e-30)).item()
        if not err < 1e-4:
            return (f"HF's {type(mod).__name__} does not continue a multi-token call from the cached states (relative "
                    f"error {err:.1e} against one call over all tokens): prompts are prefilled whole")
    return None


class PagedAttentionLayer(CacheLayerMixin):
    is_compileable = True
    is_sliding = False

    def __init__(self, num_rows: int, heads: int, k_dim: int, v_dim: int, dtype, device, latent: bool = False,
                 block_size: int = 1):
        super().__init__()
        self.k_dim, self.v_dim = k_dim, v_dim
        # rows are [v | k] (attention.py reads v as the "latent" of hybrid::mla_decode), or for MLA layers
        # (latent=True) [k | v] = [latent | rope], the page layout of hybrid::mla_decode (one row per page for the write)
        self.latent, self.block_size = latent, block_size
        self.buf = torch.zeros(num_rows, heads, v_dim + k_dim, dtype=dtype, device=device)
        torch._dynamo.mark_static_address(self.buf)
        # its shape never changes: no size symbols, so dynamo cannot duck-size them with per-step sizes (on
        # the H200 a graph guarded kv_heads == position_ids.storage_offset() and recompiled at B=64)
        torch._dynamo.mark_static(self.buf)
        self.write_slots = torch.zeros(1, dtype=torch.long, device=device)
        self.gather_idx = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.block_table = self.seq_lens = None  # paged MLA decode steps: [B, W] int32 blocks, [B] int32
        self.paged = False  # decode step read in place (attention.py; MLA: hybrid_kernels/mla/ops.py)
        self.packed = False  # a packed step (several sequences' tokens on one axis; attention.py reads the pages)
        self.fresh = True  # a prefill of prompts with nothing cached yet
        self.contiguous = False  # gathered keys / values returned contiguous (a model's own attention views them)
        self.is_initialized = True
        # HF's layers hold their cached keys / values here and models test them (Mllama asks every layer whether it
        # holds anything): the buffer stands for both; attention reads the step's rows through update()
        self.keys = self.values = self.buf

    def lazy_initialization(self, key_states, value_states):  # buffers exist from the start
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value [B, H, T, D] -> cached keys/values [B, H, S, D] for the step's gather map (or, on a paged
        decode step, the whole buffer for the paged attention function, or for MLA layers the gather as
        ``hybrid::paged_gather``, which the MLA pass replaces by attention over the pages in place)."""
        b, h, t, _ = key_states.shape
        if self.latent:  # [latent | rope] rows through the MLA cache write (the form passes/mla_step.py fuses)
            write_rows(self.buf, self.write_slots, key_states, value_states)
        else:
            rows = torch.cat([value_states, key_states], dim=-1).transpose(1, 2).reshape(b * t, h, -1)
            self.buf.index_copy_(0, self.write_slots, rows.to(self.buf.dtype))
        if self.packed and self.latent:  # attention.py attends over the pages from the absorbed query; HF's
            # expand_kv gets one token's latents to expand (its reshape needs one), which nothing reads
            return key_states[:, :, :1], value_states[:, :, :1]
        if self.paged and self.latent:
            return torch.ops.hybrid.paged_gather(self.buf, self.gather_idx, self.block_table, self.seq_lens,
                                                 self.k_dim, self.block_size)
        if self.paged:
            return self.buf, self.buf
        kv = self.buf[self.gather_idx].transpose(1, 2)  # [B, H, S, Dv + Dk]
        if self.latent:
            return kv[..., :self.k_dim], kv[..., self.k_dim:]
        if self.contiguous:
            return kv[..., self.v_dim:].contiguous(), kv[..., :self.v_dim].contiguous()
        return kv[..., self.v_dim:], kv[..., :self.v_dim]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.gather_idx.shape[1], 0

    def get_seq_length(self) -> int:
        """Keys cached before the step, as HF's models read it ("is this the first call?"): 0 on a prefill of
        fresh prompts, else the step's key width less its queries per row (its rows' longest cached context,
        rounded up to the key width: sizes, no per-step value). ``fresh`` is a Python bool, so a graph that reads
        this specialises on it: fresh and continuing prefills compile apart (an engine directory's programs do
        not tell them apart: the engine passes positions and masks, which HF's models read before this)."""
        if self.fresh:
            return 0
        return self.gather_idx.shape[1] - self.write_slots.shape[0] // self.gather_idx.shape[0]

    def get_max_length(self) -> int:
        return -1


def state_rows(slots: list[int], device) -> "slice | torch.Tensor":
    """The buffer rows of a prefill's sequences: a slice where they are consecutive (as the rows of prompts admitted
    together are), else an index tensor on ``device``."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return torch.tensor(slots, device=device)


class SlotStateLayer(LinearAttentionLayer):
    """HF's linear-attention layer, re-bound every step to the engine's state buffers (a conv state, a recurrent
    state, or both: a buffer is None where the layer keeps no such state)."""

    def __init__(self, num_rows: int, spec: LayerSpec, device):
        super().__init__()
        self.conv_buf = torch.zeros(num_rows, *spec.conv_shape, dtype=spec.conv_dtype, device=device) \
            if spec.conv_shape else None
        self.ssm_buf = torch.zeros(num_rows, *spec.ssm_shape, dtype=spec.ssm_dtype, device=device) \
            if spec.ssm_shape else None
        self._views: dict[int, tuple] = {}
        self.packed = False  # a packed step: the mixer's engine forward reads packed_maps (packed_states.py)
        #: a packed step's (chunks [S, 4] on the host, decode token indices, decode rows) (``packed_states.state_maps``)
        self.packed_maps: tuple | None = None
        # what HF's lazy initialisation would set on the first prefill: set now, so every prefill traces alike
        self.dtype = spec.conv_dtype if spec.conv_shape else spec.ssm_dtype
        self.device = self.buffers[0].device
        self.conv_kernel_size[0] = spec.conv_shape[-1] if spec.conv_shape else None

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [b for b in (self.conv_buf, self.ssm_buf) if b is not None]

    def _rows(self, lo: int, hi: int) -> tuple:
        return tuple(None if b is None else b[lo:hi] for b in (self.conv_buf, self.ssm_buf))

    def bind_decode(self, n: int) -> None:
        if n not in self._views:  # one view object per batch size: stable inputs for compiled graphs
            views = self._rows(0, n)
            for v in views:
                if v is not None:
                    torch._dynamo.mark_static_address(v)
            self._views[n] = views
        self._bind_states(*self._views[n])

    def bind_continue(self, rows: "slice | torch.Tensor") -> None:
        """Prefill chunks after the first (``state_rows``): HF continues from those rows' states. Consecutive rows
        are bound as views, which HF updates in place; others as gathered copies, stored back after the step
        (``store_prefill``)."""
        if isinstance(rows, slice):
            self._bind_states(*self._rows(rows.start, rows.stop))
        else:
            self._bind_states(*(None if b is None else b.index_select(0, rows) for b in (self.conv_buf, self.ssm_buf)))

    def _bind_states(self, conv: torch.Tensor | None, ssm: torch.Tensor | None) -> None:
        self.conv_states[0], self.recurrent_states[0] = conv, ssm
        self.is_conv_states_initialized[0] = conv is not None
        self.is_recurrent_states_initialized[0] = ssm is not None
        self.has_previous_state[0] = True
        if conv is not None:
            self.conv_kernel_size[0] = self.conv_buf.shape[-1]

    def bind_prefill(self) -> None:
        self.conv_states[0] = self.recurrent_states[0] = None
        self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = False
        self.has_previous_state[0] = False

    def store_prefill(self, rows: "slice | torch.Tensor") -> None:
        """Copy the fresh states HF created during a prefill (one per prompt of the step) into ``rows`` of the
        buffers (``state_rows``)."""
        for buf, state in ((self.conv_buf, self.conv_states[0]), (self.ssm_buf, self.recurrent_states[0])):
            if buf is None:
                continue
            if isinstance(rows, slice):
                buf[rows].copy_(state)
            else:
                buf.index_copy_(0, rows, state.to(buf.dtype))

    def move_row(self, src: int, dst: int) -> None:
        for buf in self.buffers:
            buf[dst].copy_(buf[src])

    def snapshot(self, n: int) -> list[torch.Tensor]:
        """Copies of rows 0..n-1 of every buffer (``restore`` puts them back)."""
        return [b[:n].clone() for b in self.buffers]

    def restore(self, n: int, saved: list[torch.Tensor]) -> None:
        for buf, rows in zip(self.buffers, saved):
            buf[:n].copy_(rows)


class PagedAttentionAndStateLayer(SlotStateLayer, PagedAttentionLayer):
    """A layer whose attention and SSM mixer run side by side (HF's ``LinearAttentionAndFullAttentionLayer``):
    paged keys/values and state rows in one cache layer. HF's code calls the attention methods (``update``,
    ``get_mask_sizes``, ``get_seq_length``) and the state methods on the same object; each half is bound per step
    like its single-kind layer."""
    is_compileable = True
    is_sliding = False
    update = PagedAttentionLayer.update
    get_mask_sizes = PagedAttentionLayer.get_mask_sizes
    get_seq_length = PagedAttentionLayer.get_seq_length
    get_max_length = PagedAttentionLayer.get_max_length

    def __init__(self, num_rows: int, num_state_rows: int, spec: LayerSpec, dtype, device, latent: bool = False,
                 block_size: int = 1):
        PagedAttentionLayer.__init__(self, num_rows, spec.heads, spec.k_dim, spec.v_dim, dtype, device, latent,
                                     block_size)
        SlotStateLayer.__init__(self, num_state_rows, spec, device)


class UnusedLayer(DummyLayer):
    """A layer that caches nothing on the engine's steps (its HF layer was never written by the prefill): not
    initialised, as HF's own was, so that a model asking whether it holds anything (Mllama's cross-attention layers
    on a text-only prompt) sees it empty."""

    def __init__(self):
        super().__init__()
        self.is_initialized = False


class PagedCache(Cache):
    def __init__(self, specs: list[LayerSpec], num_rows: int, num_state_rows: int, dtype, device,
                 latent: bool = False, block_size: int = 1, contiguous: bool = False):
        def layer(s: LayerSpec):
            if s.kind == "attention+ssm":
                return PagedAttentionAndStateLayer(num_rows, num_state_rows, s, dtype, device, latent, block_size)
            if s.keys:
                return PagedAttentionLayer(num_rows, s.heads, s.k_dim, s.v_dim, dtype, device, latent, block_size)
            return SlotStateLayer(num_state_rows, s, device) if s.states else UnusedLayer()
        layers = [layer(s) for s in specs]
        super().__init__(layers=layers)
        self.attention = [l for l in layers if isinstance(l, PagedAttentionLayer)]
        for l in self.attention:  # attention code of the model's own that views the keys (features.own_attention)
            l.contiguous = contiguous
        self.states = [l for l in layers if isinstance(l, SlotStateLayer)]

    def bind(self, write_slots: torch.Tensor, gather_idx: torch.Tensor, decode_rows: int | None,
             paged: bool = False, block_table: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
             state_row: "slice | torch.Tensor | None" = None, fresh: bool = False, packed: bool = False,
             state_maps: tuple | None = None) -> None:
        """``decode_rows``: a decode step over state rows 0..n-1; else a prefill, fresh (``state_row`` None) or
        continuing from the states of rows ``state_row`` (``state_rows``). ``fresh``: a prefill whose prompts have
        nothing cached. ``packed``: a packed step (``ModelRunner._launch_packed``), the state layers' maps
        ``state_maps`` (``packed_states.state_maps``)."""
        for layer in self.attention:
            layer.write_slots, layer.gather_idx, layer.paged, layer.fresh = write_slots, gather_idx, paged, fresh
            layer.packed = packed
            layer.block_table, layer.seq_lens = block_table, seq_lens
        for layer in self.states:
            layer.packed, layer.packed_maps = packed, state_maps
            if packed:
                continue
            if decode_rows is not None:
                layer.bind_decode(decode_rows)
            elif state_row is not None:
                layer.bind_continue(state_row)
            else:
                layer.bind_prefill()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached before the step (the attention layers' key count; a model with state layers only has no key
        axis: 0, HF's own count being undefined there)."""
        return self.attention[0].get_seq_length() if self.attention else 0

    def nbytes(self) -> int:
        return sum(l.buf.numel() * l.buf.element_size() for l in self.attention) + sum(
            b.numel() * b.element_size() for l in self.states for b in l.buffers)
