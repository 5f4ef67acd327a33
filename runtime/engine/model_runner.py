"""The only part of the engine that touches tensors: turns a scheduled step into model inputs (token ids,
positions, the step's cache maps and masks), runs the (compiled) model and samples.

Decode batches are left-padded to the longest context, rounded up to a whole cache block; padding gathers
the reserved block 0 and is masked out. Prefills run one sequence at a time, unpadded. With CUDA graphs
(``compile="hybrid-cudagraphs"``) decode steps run a second compiled function in reduce-overhead mode,
with the batch padded to a bucket of ``DECODE_BUCKETS`` and the context width to a power of two, so a
handful of recorded graphs serve every step; prefills stay uncaptured.
"""
from __future__ import annotations

import inspect

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from compiler.hf import cache_kwarg

from .allocator import BlockAllocator
from .cache import PagedCache
from .sampler import sample
from .scheduler import Step


# cuDNN attention's meta function fails on symbolic shapes (dynamic=True graphs, torch 2.11 on the H200):
# SDPA inside the engine may pick flash, memory-efficient or math kernels
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def decode_bucket(n: int) -> int:
    """Batch size a decode step of ``n`` sequences is padded to under CUDA graphs."""
    return next((b for b in DECODE_BUCKETS if b >= n), n)


class ModelRunner:
    def __init__(self, model, cache: PagedCache, blocks: BlockAllocator | None, compile: str | None,
                 bucket_decode: bool):
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.device = next(model.parameters()).device
        self.kwarg = cache_kwarg(model)
        params = inspect.signature(model.forward).parameters
        self.keep_last = "logits_to_keep" in params
        self.cudagraphs = compile == "hybrid-cudagraphs"
        self.bucket_decode = bucket_decode  # pad decode batches / widths to buckets (required by CUDA graphs)
        self.forward, self.decode_forward = self._compiled(model, compile)
        self.bool_mask = getattr(model.config, "_attn_implementation", "sdpa") == "sdpa"
        self.mask_keys = self._mask_keys(model.config)

    @staticmethod
    def _compiled(model, compile: str | None):
        """(prefill forward, decode forward)."""
        if compile in (None, "none"):
            return model.forward, model.forward
        import compiler  # noqa: F401  (registers the backend for source checkouts)
        if compile == "hybrid":
            fwd = torch.compile(model.forward, backend="hybrid", dynamic=True)
            return fwd, fwd
        if compile == "hybrid-cudagraphs":
            return (torch.compile(model.forward, backend="hybrid", dynamic=True),
                    torch.compile(model.forward, backend="hybrid", dynamic=True, mode="reduce-overhead"))
        if compile == "hybrid-eager":  # our passes and reference ops, no Inductor (CPU tests)
            fwd = torch.compile(model.forward, backend="hybrid", dynamic=True, options={"inductor": False})
            return fwd, fwd
        raise ValueError(f"unknown compile mode {compile!r}: use None, 'hybrid', 'hybrid-cudagraphs' or 'hybrid-eager'")

    def _mask_keys(self, config) -> dict[str, bool] | None:
        """Hybrid models take a dict {layer type: mask}: attention types get the 4-D mask, SSM types None."""
        types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
        if not self.cache.states or not self.cache.attention or not types:
            return None
        kinds = {}
        for t, layer in zip(types, self.cache.layers):
            kinds[t] = kinds.get(t, False) or hasattr(layer, "buf")
        return kinds

    # ------------------------------------------------------------------------------------------------
    def apply_moves(self, moves: list[tuple[int, int]]) -> None:
        for src, dst in moves:
            for layer in self.cache.states:
                layer.move_row(src, dst)

    @torch.no_grad()
    def run(self, step: Step) -> list[int | None]:
        """Run one step; returns the sampled token per sequence (None for a prefill chunk that is not last)."""
        self.apply_moves(step.moves)
        if step.kind == "prefill":
            (seq,), (n,) = step.seqs, step.num_tokens
            start = seq.num_cached
            ids = torch.tensor([seq.tokens[start:start + n]], device=self.device)
            positions = torch.arange(start, start + n, device=self.device)[None]
            lengths = [start + n]
            pad, decode_rows = 0, None
        else:
            pad = decode_bucket(len(step.seqs)) - len(step.seqs) if self.bucket_decode else 0
            ids = torch.tensor([[s.tokens[-1]] for s in step.seqs] + [[0]] * pad, device=self.device)
            positions = torch.tensor([[len(s) - 1] for s in step.seqs] + [[0]] * pad, device=self.device)
            lengths = [len(s) for s in step.seqs]
            decode_rows = len(step.seqs) + pad
            if self.cache.states:
                rows = [s.state_slot for s in step.seqs]
                assert rows == list(range(len(rows))), f"decode batch must be state rows 0..n-1, got {rows}"
        mask = self._bind(step, ids.shape[1], lengths, pad, decode_rows)
        kwargs = {self.kwarg: self.cache, "use_cache": True, "position_ids": positions}
        if mask is not None:
            kwargs["attention_mask"] = mask
        if self.keep_last:
            kwargs["logits_to_keep"] = 1
        with sdpa_kernel(SDPA_BACKENDS):
            if step.kind == "decode":
                if self.cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                logits = self.decode_forward(ids, **kwargs).logits[:len(step.seqs), -1]
            else:
                logits = self.forward(ids, **kwargs).logits[:, -1]
        if step.kind == "prefill" and self.cache.states:
            for layer in self.cache.states:
                layer.store_prefill(step.seqs[0].state_slot)
        for seq, n in zip(step.seqs, step.num_tokens):
            seq.num_cached += n
        done = [s.num_uncached == 0 for s in step.seqs]
        sampled = sample(logits[[i for i, d in enumerate(done) if d]],
                         [s.params for s, d in zip(step.seqs, done) if d],
                         [s.generator for s, d in zip(step.seqs, done) if d])
        it = iter(sampled)
        return [next(it) if d else None for d in done]

    def _bind(self, step: Step, q_len: int, lengths: list[int], pad_rows: int, decode_rows: int | None):
        """Cache maps for the step and the attention mask the model gets (None when it has no attention).

        Row b of the step attends to ``width`` keys, left-padded: key j holds position j - pad[b]. Maps are
        built on the device from the block table, so a step costs a few small host-to-device copies whatever
        the context length. Padding rows (CUDA-graph buckets) see one key, in the reserved block 0.
        """
        if not self.cache.attention:
            self.cache.bind(None, None, decode_rows)
            return None
        bs = self.blocks.block_size
        width = -(-max(lengths) // bs) * bs  # keys per row, padded to whole blocks
        if self.bucket_decode and step.kind == "decode":
            width = max(bs, 1 << (width - 1).bit_length())  # power-of-two widths: few graph shapes
        nb = width // bs
        table = [s.blocks[:nb] + [0] * (nb - len(s.blocks[:nb])) for s in step.seqs] + [[0] * nb] * pad_rows
        pads = [width - n for n in lengths] + [width - 1] * pad_rows
        dev = self.device
        table_t, pad_t = torch.tensor(table, device=dev), torch.tensor(pads, device=dev)
        pos = torch.arange(width, device=dev)[None, :] - pad_t[:, None]  # [B, width]; < 0 is padding
        keep = pos >= 0
        pos = pos.clamp(min=0)
        gather_idx = torch.where(keep, table_t.gather(1, pos // bs) * bs + pos % bs, 0)
        writes = gather_idx[:, width - q_len:].reshape(-1)  # a row's own tokens are its last q_len keys
        self.cache.bind(writes, gather_idx, decode_rows)
        # query i of a row sits at key index width - q_len + i: causal within the step's own tokens
        q_idx = torch.arange(width - q_len, width, device=dev)[:, None]
        mask = keep[:, None, None, :] & (torch.arange(width, device=dev)[None, :] <= q_idx)[None, None]
        if not self.bool_mask:
            dtype = self.cache.attention[0].buf.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=dev).masked_fill(~mask, torch.finfo(dtype).min)
        if self.mask_keys is not None:
            return {t: (mask if is_attn else None) for t, is_attn in self.mask_keys.items()}
        return mask
