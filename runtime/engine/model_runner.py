"""The only part of the engine that touches tensors: turns a scheduled step into model inputs (token ids,
positions, the step's cache maps and masks), runs the (compiled) model and samples.

Decode batches are left-padded to the longest context, rounded up to a whole cache block; padding gathers
the reserved block 0 and is masked out. A prefill of several sequences (fresh prompts of attention-only models,
``Scheduler``) is left-padded the same way, its rows' queries to the longest chunk; a chunk continuing a prompt
runs alone, unpadded. With CUDA graphs
(``compile="hybrid-cudagraphs"``) a decode step's batch is padded to a bucket of ``DECODE_BUCKETS`` and its
context width to a power of two, and the whole step (cache maps, masks, the compiled model) is recorded
as one CUDA graph per (bucket, width), replayed after a single host-to-device copy of the step's inputs,
as nano-vllm and vLLM do; prefills stay uncaptured.
"""
from __future__ import annotations

import array

import inspect
import time
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybrid_kernels.mla.ops import EXPANDED_MIN_QUERIES
from hybrid_kernels.mla.reference import per_head_matmul, split_kv_b
from hybrid_kernels.sampling.ops import greedy_ids
from runtime.hf import cache_kwarg

from . import attention, packed_states
from .allocator import BlockAllocator
from .cache import PagedCache, state_rows
from .sampler import sample
from .scheduler import Step
from .step_maps import device_step_maps, step_maps


# cuDNN attention's meta function fails on symbolic shapes (dynamic=True graphs, torch 2.11 on the H200):
# SDPA inside the engine may pick flash, memory-efficient or math kernels
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def decode_bucket(n: int) -> int:
    """Batch size a decode step of ``n`` sequences is padded to under CUDA graphs."""
    return next((b for b in DECODE_BUCKETS if b >= n), n)


@dataclass
class Pending:
    """A launched step: its sampled ids on the device (greedy) or its logits, until ``finish`` reads them."""
    step: Step
    done: list[bool]  # which sequences sample a token this step
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    logits: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model, cache: PagedCache, blocks: BlockAllocator | None, compile: str | None,
                 bucket_decode: bool, paged_decode: bool, freeze_weights: bool = False,
                 compile_options: dict | None = None):
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.device = next(model.parameters()).device
        self.kwarg = cache_kwarg(model)
        params = inspect.signature(model.forward).parameters
        self.keep_last = "logits_to_keep" in params
        self.bucket_decode = bucket_decode  # pad decode batches / widths to buckets (required by CUDA graphs)
        self.paged_decode = paged_decode
        self.paged_latent = paged_decode and all(layer.latent for layer in cache.attention)
        if cache.attention:  # every attention call through the engine's function (attention.py: windows, paging)
            attention.register(model.config)  # it takes the engine's boolean masks whatever the model's own takes
        if paged_decode and not self.paged_latent:  # decode attention reads the buffers in place (attention.py)
            heads = {layer.buf.shape[1] for layer in cache.attention}
            if len(heads) != 1:
                raise ValueError(f"paged decode needs one kv-head count across layers, got {sorted(heads)}")
            self.kv_heads = heads.pop()
        self.forward = self._compiled(model, compile, freeze_weights, compile_options)
        # the step's cache maps: a dozen small integer ops, one Triton kernel on the GPU (step_maps.py)
        self._maps = device_step_maps() if self.device.type == "cuda" else step_maps
        self.mask_keys = self._mask_keys(model.config.get_text_config())
        #: prefills of several prompts of several lengths on a model with state layers: left-padded rows, the state
        #: layers given HF's 2-D padding mask (set by the engine once a probe shows the padding leaves the states
        #: exact); only where the state layers can get a mask of their own (no attention, or masks per layer type)
        self.pad_states = False
        self.can_pad_states = bool(self.cache.states) and (not self.cache.attention or self.mask_keys is not None)
        self._staging: torch.Tensor | None = None  # pinned host buffer for the step's inputs (CUDA)
        self._copied: torch.cuda.Event | None = None
        self.graphs_enabled = compile == "hybrid-cudagraphs" and self.device.type == "cuda"
        #: (batch bucket, width) -> (static input, graph, (logits, greedy ids))
        self._graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.CUDAGraph, tuple]] = {}
        self._pool = None
        # pinned host buffers for sampled ids, used in turn (a step and the one running ahead of it)
        self._host_ids: list[torch.Tensor | None] = [None, None, None]
        self._ring = 0
        #: what the last replayed graph's static input holds now (``_replay_decode``), None after other steps
        self._advanced: tuple | None = None
        self.advanced_steps = 0  # decode steps replayed on inputs the previous replay left (no upload)
        self.wait_s = 0.0  # host time spent waiting for the device (events; sampled batches' reads are not counted)
        #: a packed step's attention_mask: HF's mask code returns a 4-D mask as it is; the packed attention reads
        #: the step's sequence boundaries instead (``_launch_packed``)
        self._packed_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        #: why this model cannot take packed steps (None: it can; the engine's construction probe then decides)
        self.pack_note = self._pack_note(model)

    def _pack_note(self, model) -> str | None:
        """Why this model cannot take packed steps, or None. State layers take them where each has an SSM or
        delta-rule mixer hybrid recognises (``packed_states``: the mixers get the engine forward here). MLA layers
        take them through the absorbed form of HF's ``expand_kv`` (``attention._packed_mla``), so each MLA attention module must have that method over a
        bias-free linear ``kv_b_proj`` that gives its keys and values (checked on random latents)."""
        cache = self.cache
        for why, bad in (("no attention or state layers", lambda: not cache.attention and not cache.states),
                         ("MLA without the engine's paged latent cache (paged_decode=False)",
                          lambda: hasattr(model.config.get_text_config(), "kv_lora_rank") and not self.paged_latent),
                         ("attention of the model's own", lambda: any(layer.contiguous for layer in cache.attention)),
                         ("the model's forward takes no logits_to_keep", lambda: not self.keep_last)):
            if bad():
                return why
        if cache.states:  # each sequence from its own state row (packed_states.py)
            found, why = packed_states.mixers(model, cache)
            if why:
                return why
            packed_states.install(model, cache, found)
        if self.paged_latent:
            mods = [m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "qk_nope_head_dim")]
            return _expand_kv_mismatch(mods, len(cache.attention))
        return None

    @staticmethod
    def _compiled(model, compile: str | None, freeze_weights: bool = False, compile_options: dict | None = None):
        if freeze_weights and compile not in ("hybrid", "hybrid-cudagraphs"):
            raise ValueError(f"freeze_weights=True needs Inductor: compile='hybrid' or 'hybrid-cudagraphs', got "
                             f"{compile!r}")
        if getattr(model, "engine_plan", None) is not None:  # an engine directory's programs (exported.py)
            return model.forward
        if compile in (None, "none"):
            if compile_options:
                raise ValueError(f"compile_options {compile_options} need a hybrid compile mode, got compile={compile!r}")
            return model.forward
        import compiler  # noqa: F401  (registers the backend for source checkouts)
        from passes.prepare import prepare_model
        prepare_model(model)  # e.g. HF's Mamba1 scan as an opaque op from the first trace: no retrace
        # run_time_configs: ops pick launch configs per call, so the batch size never causes a recompile
        if compile in ("hybrid", "hybrid-cudagraphs"):  # cudagraphs: the runner records decode steps (_capture)
            compiled = _recompiles_allowed(torch.compile(model.forward, backend="hybrid", dynamic=True,
                                                         options={**(compile_options or {}), "run_time_configs": True}))
            return _frozen(compiled) if freeze_weights else compiled
        if compile == "hybrid-eager":  # our passes and reference ops, no Inductor (CPU tests)
            return _recompiles_allowed(torch.compile(model.forward, backend="hybrid", dynamic=True, options={
                **(compile_options or {}), "inductor": False, "run_time_configs": True}))
        raise ValueError(f"unknown compile mode {compile!r}: use None, 'hybrid', 'hybrid-cudagraphs' or 'hybrid-eager'")

    def _mask_keys(self, config) -> dict[str, bool] | None:
        """Hybrid models take a dict {layer type: mask}: attention types get the 4-D mask, SSM types None. The
        keys are the config's layer types and HF's two standard ones, "full_attention" and "linear_attention"
        (models whose layers run both side by side name their masks so, whatever their layer types)."""
        types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
        if not self.cache.states or not self.cache.attention or not types:
            return None
        kinds = {}
        for t, layer in zip(types, self.cache.layers):
            kinds[t] = kinds.get(t, False) or hasattr(layer, "buf")
        kinds.setdefault("full_attention", True)
        kinds.setdefault("linear_attention", False)
        return kinds

    # ------------------------------------------------------------------------------------------------
    def apply_moves(self, moves: list[tuple[int, int]]) -> None:
        for src, dst in moves:
            for layer in self.cache.states:
                layer.move_row(src, dst)

    def _upload(self, lists: "list[list[int] | torch.Tensor]", device_ids: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The step's small integer inputs in one host-to-device copy (pinned staging buffer on CUDA, so the
        copy is asynchronous: a pageable copy per tensor would synchronise the stream several times a step);
        into ``out`` (a graph's static input buffer) when given. ``device_ids`` (the ids a step running ahead
        takes from the step before, still on the device) then replace the first ids."""
        sizes = [len(x) for x in lists]
        parts = [x if isinstance(x, torch.Tensor) else _long_tensor(x) for x in lists]
        host = torch.cat(parts) if len(parts) > 1 else parts[0]
        if self.device.type != "cuda":
            return self._with_ids(list(host.split(sizes)), device_ids)
        if self._copied is not None:
            t0 = time.perf_counter()
            self._copied.synchronize()  # the previous step's copy has left the staging buffer
            self.wait_s += time.perf_counter() - t0
        if self._staging is None or self._staging.numel() < host.numel():
            self._staging = torch.empty(max(host.numel(), 4096), dtype=torch.long, pin_memory=True)
        staged = self._staging[:host.numel()]
        staged.copy_(host)
        if out is not None:
            dev = out.copy_(staged, non_blocking=True)
        else:
            dev = staged.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return self._with_ids(list(dev.split(sizes)), device_ids)

    @staticmethod
    def _with_ids(parts: list[torch.Tensor], device_ids: torch.Tensor | None) -> list[torch.Tensor]:
        if device_ids is not None:
            parts[0][:device_ids.numel()].copy_(device_ids)
        return parts

    @torch.no_grad()
    def launch(self, step: Step, ahead: "Pending | None" = None) -> "Pending":
        """Start one step on the device; ``finish`` returns its tokens. With ``ahead`` (a decode step of the
        same sequences, not finished yet) the step runs one token ahead of the host: each sequence's input is
        the token ``ahead`` sampled, still on the device, at the position after it."""
        self.apply_moves(step.moves)
        if step.kind == "packed":
            return self._launch_packed(step)
        n, state_row, graphed = len(step.seqs), None, True
        if step.kind == "prefill":
            assert ahead is None, "only decode steps run ahead"
            ids, positions, lengths, q_len = self._prefill_rows(step)
            pad, rows = 0, None
            # chunks after the first continue from their sequences' state rows (all at one point, unpadded)
            start = step.seqs[0].num_cached
            srows = state_rows([s.state_slot for s in step.seqs], self.device) if self.cache.states else None
            state_row = srows if start else None
            assert not start or (all(s.num_cached == start for s in step.seqs) and len(set(step.num_tokens)) == 1), \
                "chunks that continue prompts share a step only at one point of their prompts, with one length"
            assert len(step.seqs) == 1 or not self.cache.states or self.pad_states or len(set(step.num_tokens)) == 1, \
                "with state layers only prompts of equal length prefill together (pad_states is off)"
        else:
            shift = 0 if ahead is None else 1
            pad = decode_bucket(n) - n if self.bucket_decode else 0
            # padding rows of a decode step update state rows n.. in place: where another sequence (a prompt between
            # its chunks) holds one of them, the step runs unpadded and unrecorded instead
            graphed = not (self.cache.states and pad and step.rows_in_use > n)
            pad = pad if graphed else 0
            lengths, rows, q_len = [len(s) + shift for s in step.seqs], n + pad, 1
            if self.cache.states:
                slots = [s.state_slot for s in step.seqs]
                assert slots == list(range(n)), f"decode batch must be state rows 0..n-1, got {slots}"
        batch = rows or n
        width = self._width(step.kind, lengths) if self.cache.attention else 0
        greedy = None
        if step.kind == "decode" and self.graphs_enabled and graphed:
            logits, greedy = self._replay_decode(step, ahead, batch, width, lengths, pad)
        else:
            self._advanced = None
            if step.kind == "decode":
                ids, positions = self._decode_ids(step, lengths, pad)
            inputs = self._upload(self._host_inputs(step, width, lengths, pad, ids, positions),
                                  None if ahead is None else ahead.tokens)
            logits = self._forward(step.kind, q_len, width, batch, rows, inputs, state_row,
                                   fresh=step.kind == "prefill" and not any(s.num_cached for s in step.seqs),
                                   padded=step.kind == "prefill" and bool(self.cache.states)
                                   and len(set(step.num_tokens)) > 1)
        if step.kind == "prefill" and self.cache.states and not isinstance(state_row, slice):
            for layer in self.cache.states:  # fresh states, or gathered ones (bind_continue)
                layer.store_prefill(srows)
        for seq, k in zip(step.seqs, step.num_tokens):
            seq.num_cached += k
        done = [step.kind == "decode" or s.num_uncached == 0 for s in step.seqs]
        return self._sample_async(Pending(step, done), logits, greedy)

    def _launch_packed(self, step: Step) -> "Pending":
        """A packed step: every sequence's tokens of the step on one axis ([1, N], no padding), each at its own
        positions, written to its own cache rows, attending to its own keys in the pages (``attention.py``'s packed
        path, ``hybrid::varlen_attention``); logits only at each sequence's last token. Uncaptured: the token count
        changes every step."""
        self._advanced = None
        bs = self.blocks.block_size if self.blocks is not None else 1  # no blocks: a model of state layers only
        starts = [s.num_cached for s in step.seqs]
        ends = [a + k for a, k in zip(starts, step.num_tokens)]
        nb = -(-max(ends) // bs) if self.blocks is not None else 0
        ids, table = [], []
        for seq, start, end in zip(step.seqs, starts, ends):
            ids += seq.tokens[start:end]
            table += seq.blocks[:nb] + [0] * (nb - min(nb, len(seq.blocks)))
        # positions and cache rows of every token, vectorised on the host (a step holds up to thousands of tokens)
        counts = torch.tensor(step.num_tokens)
        cu = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        owner = torch.repeat_interleave(torch.arange(len(step.seqs)), counts)
        positions = torch.tensor(starts)[owner] + torch.arange(len(ids)) - cu[owner]
        host_table = torch.tensor(table, dtype=torch.long).view(len(step.seqs), nb)
        writes = host_table[owner, positions // bs] * bs + positions % bs if nb else positions.new_zeros(0)
        split = self._mla_split(counts, owner, host_table, torch.tensor(ends), bs) if self.paged_latent else {}
        chunks, dec_tokens, dec_rows = packed_states.state_maps(starts, step.num_tokens,
                                                                [s.state_slot for s in step.seqs]) \
            if self.cache.states else (None, [], [])
        ids, positions, writes, table, cu, ctx, dec_tokens, dec_rows, *maps = self._upload(
            [ids, positions, writes, host_table.view(-1), cu, ends, dec_tokens, dec_rows, *split.values()])
        n = ids.shape[0]
        state_maps = (chunks, dec_tokens, dec_rows.to(torch.int32)) if dec_tokens.shape[0] else (chunks, None, None)
        self.cache.bind(writes, writes.view(1, -1), None, paged=True, packed=True, state_maps=state_maps)
        mask = self._packed_mask if self.cache.attention else None
        if self.mask_keys is not None:  # attention layer types get the packed mask, state layer types none
            mask = {t: (mask if is_attn else None) for t, is_attn in self.mask_keys.items()}
        kwargs = {self.kwarg: self.cache, "use_cache": True, "position_ids": positions.view(1, n),
                  "attention_mask": mask, "logits_to_keep": cu[1:] - 1}
        if self.cache.attention:  # the packed attention's maps (attention.py)
            kwargs.update({"hybrid_cu_q": cu.to(torch.int32), "hybrid_ctx": ctx.to(torch.int32),
                           "hybrid_packed_table": table.view(len(step.seqs), nb).to(torch.int32),
                           "hybrid_block_size": bs})
        if self.paged_latent:  # MLA layers read their latent pages (attention.py), found by the module's layer_idx
            kwargs["hybrid_latent_pages"] = tuple(getattr(layer, "buf", None) for layer in self.cache.layers)
            if split:
                kwargs["hybrid_mla_split"] = mla_split_arg(dict(zip(split, maps)))
        packed_states.PACKED_STEP[0] = True
        try:
            logits = self.forward(ids.view(1, n), **kwargs).logits
        finally:
            packed_states.PACKED_STEP[0] = False
        for seq, k in zip(step.seqs, step.num_tokens):
            seq.num_cached += k
        done = [s.num_uncached == 0 for s in step.seqs]
        return self._sample_async(Pending(step, done), logits[0][:, None], None)

    @staticmethod
    def _mla_split(counts: torch.Tensor, owner: torch.Tensor, table: torch.Tensor, ends: torch.Tensor,
                   bs: int) -> dict[str, torch.Tensor]:
        """A packed MLA step's sequences of at least ``EXPANDED_MIN_QUERIES`` tokens attend in the expanded form
        (``attention._packed_mla``: their contexts' latents gathered page by page and expanded through kv_b_proj),
        the others in the absorbed form. Host maps of both groups (token rows, query offsets, key counts, block
        tables; for the long ones the gathered rows and their tables of consecutive pages), flattened for the
        upload; {} when no sequence is long (the whole step absorbed)."""
        long = counts >= EXPANDED_MIN_QUERIES
        if not bool(long.any()):
            return {}
        maps = {}
        for name, group in (("short", ~long), ("long", long)):
            seqs = torch.nonzero(group).flatten()
            c = counts[seqs]
            maps[f"{name}_rows"] = torch.nonzero(group[owner]).flatten()
            maps[f"{name}_cu"] = torch.cat([c.new_zeros(1), c.cumsum(0)])
            maps[f"{name}_ctx"] = ends[seqs]
            maps[f"{name}_table"] = table[seqs]
        seqs = torch.nonzero(long).flatten()
        blocks = -(-ends[seqs] // bs)  # pages holding each long sequence's keys
        first = torch.cat([blocks.new_zeros(1), blocks.cumsum(0)[:-1]])
        width = int(blocks.max())
        pages = table[seqs, :width]
        keep = torch.arange(width)[None, :] < blocks[:, None]
        maps["long_gather"] = (pages[keep][:, None] * bs + torch.arange(bs)[None, :]).flatten()
        maps["long_table"] = torch.where(keep, first[:, None] + torch.arange(width)[None, :], 0)
        return {k: v.reshape(-1) for k, v in maps.items()}

    @staticmethod
    def _prefill_rows(step: Step) -> tuple[list[int], list[int], list[int], int]:
        """(ids, positions, cached lengths after the step, query length) of a prefill. Rows are left-padded to the
        longest chunk: a row's tokens are its last queries, padding queries take id 0 at position 0 and write to
        the reserved block 0 (the step maps' padding keys)."""
        q_len = max(step.num_tokens)
        ids, positions, lengths = [], [], []
        for seq, k in zip(step.seqs, step.num_tokens):
            start, pad = seq.num_cached, q_len - k
            ids += [0] * pad + seq.tokens[start:start + k]
            positions += [0] * pad + list(range(start, start + k))
            lengths.append(start + k)
        return ids, positions, lengths, q_len

    @staticmethod
    def _decode_ids(step: Step, lengths: list[int], pad: int) -> tuple[list[int], list[int]]:
        """(ids, positions) of a decode step's rows; ids are placeholders when they come from a step ahead."""
        return [s.last_token for s in step.seqs] + [0] * pad, [x - 1 for x in lengths] + [0] * pad

    def _host_inputs(self, step: Step, width: int, lengths: list[int], pad: int, ids: list[int],
                     positions: list[int]) -> list[list[int]]:
        """The step's integer inputs as host lists: ids, positions and, with attention layers, the flat block
        table and left padding per row (``_layout``)."""
        if not self.cache.attention:
            return [ids, positions]
        return [ids, positions, *self._layout(step, width, lengths, pad)]

    def _sample_async(self, pending: "Pending", logits: torch.Tensor, ids: torch.Tensor | None) -> "Pending":
        """Greedy batches: argmax on the device (``ids``: already taken inside a recorded step) and an
        asynchronous copy of the ids to pinned host memory (nothing waits until ``finish``). Other batches
        keep their logits for ``sample`` in ``finish``. ``logits`` and ``ids`` may hold padding rows."""
        if not any(pending.done):
            return pending
        n = len(pending.step.seqs)
        if not all(pending.done) or any(s.params.temperature != 0.0 for s in pending.step.seqs):
            pending.logits = logits[:n, -1]
            return pending
        pending.tokens = greedy_ids(logits[:n, -1]) if ids is None else ids[:n]
        if self.device.type == "cuda":
            self._ring = (self._ring + 1) % len(self._host_ids)
            host = self._host_ids[self._ring]
            if host is None or host.numel() < pending.tokens.numel():
                host = self._host_ids[self._ring] = torch.empty(max(256, pending.tokens.numel()), dtype=torch.long,
                                                                pin_memory=True)
            pending.host = host[:pending.tokens.numel()]
            pending.host.copy_(pending.tokens, non_blocking=True)
            pending.event = torch.cuda.Event()
            pending.event.record()
        return pending

    def finish(self, pending: "Pending") -> list[int | None]:
        """The step's sampled token per sequence (None for a prefill chunk that is not the last); waits for the
        device only here."""
        if pending.tokens is not None:
            if pending.event is not None:
                t0 = time.perf_counter()
                pending.event.synchronize()
                self.wait_s += time.perf_counter() - t0
                values = pending.host.tolist()
            else:
                values = pending.tokens.tolist()
        elif pending.logits is not None:
            rows = [i for i, d in enumerate(pending.done) if d]
            seqs = [pending.step.seqs[i] for i in rows]
            values = sample(pending.logits[rows], [s.params for s in seqs], [s.generator for s in seqs])
        else:
            values = []
        it = iter(values)
        return [next(it) if d else None for d in pending.done]

    def _forward(self, kind: str, q_len: int, width: int, batch: int, rows: int | None,
                 inputs: list[torch.Tensor], state_row: "slice | torch.Tensor | None" = None, fresh: bool = False,
                 padded: bool = False) -> torch.Tensor:
        """Bind the step's cache maps and run the model: all a recorded decode graph contains. ``state_row``:
        prefill chunks continuing from those state rows (``state_rows``); ``fresh``: a prefill of prompts with nothing cached;
        ``padded``: a prefill of rows of several lengths on a model with state layers (``pad_states``)."""
        positions = inputs[1].view(batch, q_len)
        if self.cache.attention:
            mask, extra = self._bind(kind, q_len, width, inputs[2].view(batch, -1), inputs[3], rows, state_row,
                                     fresh)
        else:
            mask, extra = None, {}
            self.cache.bind(None, None, rows, state_row=state_row)
        if padded:  # the state layers' mask (HF's 2-D one): a recurrence over the padding must not move the states
            rec = padding_mask(positions)
            mask = rec if mask is None else {t: (m if self.mask_keys[t] else rec) for t, m in mask.items()}
        kwargs = {self.kwarg: self.cache, "use_cache": True, "position_ids": positions, **extra}
        if mask is not None:
            kwargs["attention_mask"] = mask
        if self.keep_last:
            kwargs["logits_to_keep"] = 1
        with sdpa_kernel(SDPA_BACKENDS):
            return self.forward(inputs[0].view(batch, q_len), **kwargs).logits

    # -- CUDA graphs of decode steps ------------------------------------------------------------------
    def _replay_decode(self, step: Step, ahead: "Pending | None", batch: int, width: int, lengths: list[int],
                       pad: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step as a CUDA graph replay, recorded on first use of a (batch bucket, width): (logits,
        greedy ids, both taken in the graph).

        A recorded step ends by advancing its own static inputs to the step after it: ids <- the greedy ids,
        positions + 1 and left padding - 1 on the real rows. A step running ahead of the previous replay of the
        same graph, with the same sequences and the same blocks (hence the same block table), finds its inputs
        already there and is a bare ``replay()``: no host-to-device copy. Any other step uploads its inputs."""
        key = (batch, width)
        state = (key, tuple(s.request_id for s in step.seqs), tuple(lengths),
                 tuple(len(s.blocks) for s in step.seqs) if self.cache.attention else ())
        entry = self._graphs.get(key)
        if entry is not None and ahead is not None and self._advanced == state:
            self.advanced_steps += 1
        else:
            host = self._host_inputs(step, width, lengths, pad, *self._decode_ids(step, lengths, pad))
            host.append([1] * len(step.seqs) + [0] * pad)
            device_ids = None if ahead is None else ahead.tokens
            if entry is None:
                try:
                    entry = self._capture(batch, width, host, device_ids)
                except Exception as e:  # noqa: BLE001  (uncapturable model: run it uncaptured, say why)
                    import warnings
                    warnings.warn(f"hybrid engine: CUDA graph capture failed ({type(e).__name__}: {e}); decode "
                                  "steps run without CUDA graphs", stacklevel=2)
                    self.graphs_enabled = False
                    self._advanced = None
                    return self._forward("decode", 1, width, batch, batch, self._upload(host, device_ids)), None
            self._upload(host, device_ids, out=entry[0])
        static_in, graph, out = entry
        graph.replay()
        self._advanced = (key, state[1], tuple(x + 1 for x in lengths), state[3])
        return out

    def record_idle(self, batch: int, width: int) -> bool:
        """Record the decode graph of (``batch`` bucket, ``width`` keys) ahead of use, over padding rows only (they
        read and write the reserved block 0, as a bucket's padding rows do); False when it exists already. The
        engine must have no decode running: the warm-up runs use state rows 0..batch-1 (restored afterwards)."""
        if (batch, width) in self._graphs:
            return False
        host = [[0] * batch, [0] * batch]
        if self.cache.attention:
            host += [[0] * (batch * width // self.blocks.block_size), [width - 1] * batch]
        self._capture(batch, width, host + [[0] * batch])
        self._advanced = None
        return True

    def _capture(self, batch: int, width: int, host: list[list[int]], device_ids: torch.Tensor | None = None):
        sizes = [len(x) for x in host]
        static_in = torch.zeros(sum(sizes), dtype=torch.long, device=self.device)
        inputs = list(static_in.split(sizes))
        advance = inputs.pop()  # 1 on real rows, 0 on padding rows

        def body():  # ends by moving the inputs to the next step, should it run ahead (``_replay_decode``)
            logits = self._forward("decode", 1, width, batch, batch, inputs)
            pads = inputs[3] if self.cache.attention else None
            return logits, greedy_ids(logits[:, -1], (inputs[0], inputs[1], pads, advance))
        # warm-up runs (compilation happens here) update SSM states in place: put them back afterwards
        saved = [layer.snapshot(batch) for layer in self.cache.states]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # each with the step's real inputs: the warm-up runs write the cache
                self._upload(host, device_ids, out=static_in)
                body()
        torch.cuda.current_stream().wait_stream(side)
        for layer, rows in zip(self.cache.states, saved):
            layer.restore(batch, rows)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        out = record(graph, self._pool, body)
        self._graphs[(batch, width)] = (static_in, graph, out)
        return static_in, graph, out

    def _width(self, kind: str, lengths: list[int]) -> int:
        """Keys per row of a step: the longest context in whole blocks (a power of two of them for a bucketed
        decode step: few graph shapes)."""
        bs = self.blocks.block_size
        width = -(-max(lengths) // bs) * bs
        if self.bucket_decode and kind == "decode":
            width = max(bs, 1 << (width - 1).bit_length())
        return width

    def _layout(self, step: Step, width: int, lengths: list[int], pad_rows: int) -> tuple[list[int], list[int]]:
        """(flat block table [rows x width/block], left padding per row) of a step whose rows attend to
        ``width`` keys, left-padded: key j holds position j - pad[b]. Padding rows (CUDA-graph buckets) see
        one key, in the reserved block 0."""
        nb = width // self.blocks.block_size
        table = []
        for s in step.seqs:
            own = s.blocks[:nb]
            table += own + [0] * (nb - len(own))
        table += [0] * (nb * pad_rows)
        return table, [width - n for n in lengths] + [width - 1] * pad_rows

    def _bind(self, kind: str, q_len: int, width: int, table: torch.Tensor, pads: torch.Tensor, rows: int | None,
              state_row: "slice | torch.Tensor | None" = None, fresh: bool = False):
        """Bind the step's cache maps, built on the device from the block table; returns the attention mask
        and extra forward kwargs (the paged-attention maps of a paged decode step)."""
        paged = self.paged_decode and kind == "decode"
        mha = paged and not self.paged_latent
        gather_idx, writes, keep, lengths, table32, mha_maps = self._maps(
            table, pads, width, q_len, self.blocks.block_size, self.kv_heads if mha else 0)
        if paged and self.paged_latent:  # MLA: the pages themselves (hybrid_kernels/mla/ops.py)
            self.cache.bind(writes, gather_idx, rows, paged, table32, lengths)
        else:
            self.cache.bind(writes, gather_idx, rows, paged, state_row=state_row, fresh=fresh)
        extra = {}
        if mha:  # the same positions, valid keys first, as rows of the per-head view (attention.py)
            extra["hybrid_block_table"], extra["hybrid_seq_lens"] = mha_maps
        mask = keep[:, None, None, :]
        if kind == "prefill":  # query i sits at key index width - q_len + i: causal within the step's tokens
            q_idx = torch.arange(width - q_len, width, device=self.device)[:, None]
            keys = torch.arange(width, device=self.device)[None, :]
            # a padding query of a batched prefill (left of a shorter row's tokens) sees its own key, so that no
            # softmax row is empty (NaN); nothing reads its output
            mask = (mask & (keys <= q_idx)[None, None]) | (keys == q_idx)[None, None]
        if self.mask_keys is not None:
            mask = {t: (mask if is_attn else None) for t, is_attn in self.mask_keys.items()}
        return mask, extra


@torch.no_grad()
def _expand_kv_mismatch(modules: list, layers: int) -> str | None:
    """None when every MLA attention module's ``expand_kv`` is the plain per-head split of a bias-free linear
    ``kv_b_proj`` (checked on random latents), else why not."""
    if len(modules) != layers:
        return f"MLA attention modules ({len(modules)}) other than the latent cache layers ({layers})"
    for m in modules:
        proj = m.kv_b_proj
        if not callable(getattr(m, "expand_kv", None)) or not isinstance(proj, torch.nn.Linear) \
                or proj.bias is not None:
            return f"MLA attention {type(m).__name__} without HF's expand_kv over a bias-free kv_b_proj"
        try:
            agrees = _expand_kv_agrees(m, proj.weight)
        except Exception as e:  # noqa: BLE001  (a method of another signature or contract: no packed steps)
            return f"MLA attention {type(m).__name__}'s expand_kv failed on latents ({type(e).__name__}: {e})"
        if not agrees:
            return f"MLA attention {type(m).__name__} whose expand_kv is not the per-head split of kv_b_proj"
    return None


def _expand_kv_agrees(m, w: torch.Tensor) -> bool:
    """``m.expand_kv`` on random latents of 3 tokens against kv_b_proj's per-head split (keys: the nope part and
    the shared rope key; values), within the weight dtype's rounding relative to the largest value."""
    heads = w.shape[0] // (m.qk_nope_head_dim + m.v_head_dim)
    lat = torch.randn(1, 1, 3, w.shape[1], dtype=w.dtype, device=w.device)
    rot = torch.randn(1, 1, 3, m.qk_rope_head_dim, dtype=w.dtype, device=w.device)
    key, value = m.expand_kv(lat, rot)
    w_uk, w_uv = split_kv_b(w.float(), heads, m.qk_nope_head_dim)
    wide = lat.float().expand(1, heads, 3, -1)
    want_k = torch.cat([per_head_matmul(wide, w_uk.transpose(-1, -2)), rot.float().expand(1, heads, 3, -1)], dim=-1)
    want_v = per_head_matmul(wide, w_uv.transpose(-1, -2))
    tol = 1e-4 if w.dtype == torch.float32 else 2e-2
    return all(got.shape == want.shape and float((got.float() - want).abs().max()) <= tol * float(want.abs().max())
               for got, want in ((key, want_k), (value, want_v)))


def _long_tensor(values: list[int]) -> torch.Tensor:
    """A host int64 tensor of a list of ints. Long lists (a packed step's thousands of token ids) go through an
    ``array`` (one C conversion pass) rather than ``torch.tensor``, which converts element by element."""
    if len(values) < 256:
        return torch.tensor(values, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


def mla_split_arg(maps: dict[str, torch.Tensor]) -> tuple:
    """``ModelRunner._mla_split``'s maps (on the device) as the ``hybrid_mla_split`` kwarg: (short group or None,
    long group, the long contexts' rows); a group is (token rows, cu_q, keys per sequence, block table), the rows
    int64 for indexing, the rest int32 for the kernels."""
    groups = [(maps[f"{g}_rows"], maps[f"{g}_cu"].to(torch.int32), maps[f"{g}_ctx"].to(torch.int32),
               maps[f"{g}_table"].view(maps[f"{g}_ctx"].shape[0], -1).to(torch.int32))
              if maps[f"{g}_rows"].shape[0] else None for g in ("short", "long")]
    return (*groups, maps["long_gather"])


def padding_mask(positions: torch.Tensor) -> torch.Tensor:
    """HF's 2-D attention mask (1 = token, 0 = padding) of a prefill of fresh prompts left-padded to one length,
    from its positions: a row's last query sits at position k - 1 of its k tokens, so its first k - 1 - p columns
    are padding."""
    q_len = positions.shape[1]
    cols = torch.arange(q_len, device=positions.device)[None, :]
    return (cols >= q_len - 1 - positions[:, -1:]).long()


def record(graph, pool, body):
    """body() recorded into ``graph``. When it fails and dynamo compiled something meanwhile, the error says so: the
    compile is then the cause (the passes' probes copy host tensors to the device, which a capture forbids), not the
    step's own code."""
    from torch._dynamo.utils import counters
    frames = counters["frames"]["total"]
    try:
        with torch.cuda.graph(graph, pool=pool):
            return body()
    except Exception as e:
        if counters["frames"]["total"] > frames:
            raise RuntimeError(f"the model compiled again inside the capture call: a guard that held for the two "
                               f"warm-up runs failed (TORCH_LOGS=recompiles says which) [{e}]") from e
        raise


#: graphs the engine's forward may compile: prefill and decode, fresh and continuing prompts, padded rows, and dynamo's
#: specialisations of size 1 (one row, one cache block) of each; past dynamo's default limit (8) the forward would run
#: uncompiled, without hybrid's kernels
RECOMPILE_LIMIT = 64


def _recompiles_allowed(compiled):
    """``compiled`` called with dynamo's recompile limit raised to ``RECOMPILE_LIMIT`` and without duck shaping (for
    these calls only). Duck shaping gives sizes that happen to be equal at a graph's first call one symbol and guards
    on their equality: a packed step whose two block tables (MLA's short and long groups) first had one width would
    compile again at the first step where they differ, in the middle of serving."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    def run(*args, **kwargs):
        with dynamo_config.patch(recompile_limit=max(RECOMPILE_LIMIT, dynamo_config.recompile_limit)), \
                fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)
    return run


def _frozen(compiled):
    """Run ``compiled`` with Inductor's weight freezing: dynamo then traces the parameters as constants (it
    checks the flag while tracing, so every call sets it), and Inductor folds what depends on weights alone
    (Mamba's A = -exp(A_log), dtype casts) and concatenates linears that share an input on the GPU (DeepSeek's
    q_proj + kv_a_proj_with_mqa, the shared expert's gate + up): fewer kernels per decode step. The weights
    are constants of the compiled graphs: changing them after the engine is built has no effect.
    Opt-in (``Engine(freeze_weights=True)``): it is not faster on every model (bench/README.md)."""
    from torch._inductor import config as inductor_config

    def run(*args, **kwargs):
        with torch.no_grad(), inductor_config.patch(freezing=True):
            return compiled(*args, **kwargs)
    return run

