"""``Engine``: generation over the compiled model with paged caches and continuous batching.

    engine = Engine.from_pretrained("deepseek_v3")            # zoo name or HF model directory
    outs = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=16))
    for event in engine.stream(["Hello"], SamplingParams(max_tokens=8, temperature=0.8, seed=0)): ...

``step()`` is the whole loop: schedule, run, postprocess.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from runtime.hf import cache_kwarg

from .allocator import BlockAllocator, SlotAllocator
from .cache import PagedCache, discover_layers, ssm_chunking_problem
from .model_runner import ModelRunner, decode_bucket
from .scheduler import Scheduler, Step
from .sequence import RequestOutput, SamplingParams, Sequence, Status, TokenEvent

DEFAULT_CPU_BUDGET = 256 << 20


class Engine:
    def __init__(self, model, *, tokenizer=None, cache_memory: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 32, max_prefill_tokens: int = 512, compile: str | None = "auto",
                 bucket_decode: bool | None = None, paged_decode: bool | None = None, overlap: bool = True,
                 freeze_weights: bool = False, compile_options: dict | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.config.vocab_size
        self.max_model_len = getattr(model.config, "max_position_embeddings", None)
        self.eos = self._eos_ids(model)
        specs = discover_layers(model, cache_kwarg(model))
        has_attn = any(s.kind == "attention" for s in specs)
        has_ssm = any(s.kind == "ssm" for s in specs)
        # long prompts are prefilled in chunks of max_prefill_tokens, except where an SSM mixer would not continue
        # a chunk from the cached states exactly (HF's Mamba1 scan; the reason is kept here). Probed before the
        # caches take the device's memory.
        num_state_layers = sum(s.kind == "ssm" for s in specs)
        self.prefill_note = ssm_chunking_problem(model, num_state_layers) if has_ssm else None
        if compile == "auto":
            compile = "hybrid-cudagraphs" if self.device.type == "cuda" else "hybrid-eager"
        if bucket_decode is None:  # CUDA graphs need repeating shapes: decode batches padded to buckets
            bucket_decode = compile == "hybrid-cudagraphs"
        elif not bucket_decode and compile == "hybrid-cudagraphs":
            raise ValueError("compile='hybrid-cudagraphs' needs bucket_decode=True (graphs are recorded per bucket)")
        # padding rows of a bucketed decode step need SSM state rows of their own
        state_rows = (decode_bucket(max_num_seqs) if bucket_decode else max_num_seqs) if has_ssm else 0
        num_blocks = self._plan_memory(specs, cache_memory, block_size, state_rows)
        mla = hasattr(model.config, "kv_lora_rank")
        if paged_decode is None:  # decode attention over the pages in place: MLA layers on any device once the
            # MLA pass rewrites them (kernels/mla/ops.py), MHA/GQA layers on the GPU (attention.py)
            paged_decode = has_attn and (mla or self.device.type == "cuda")
        self.cache = PagedCache(specs, num_blocks * block_size if has_attn else 1, state_rows, self.dtype,
                                self.device, latent=mla and paged_decode, block_size=block_size)
        self.blocks = BlockAllocator(num_blocks, block_size) if has_attn else None
        self.slots = SlotAllocator(max_num_seqs) if has_ssm else None
        self.scheduler = Scheduler(self.blocks, self.slots, max_num_seqs=max_num_seqs,
                                   max_prefill_tokens=max_prefill_tokens, chunked_prefill=self.prefill_note is None)
        self.runner = ModelRunner(model, self.cache, self.blocks, compile, bucket_decode, paged_decode, freeze_weights,
                                  compile_options)
        self._seqs: dict[int, Sequence] = {}
        self.stats = dict(steps=0, decode_steps=0, prefill_tokens=0, decode_tokens=0)
        self.overlap = overlap
        self._ahead = None  # (step, pending): a decode step launched before the previous one was read

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, *, device: str | None = None, dtype: torch.dtype | None = None,
                        **kwargs) -> "Engine":
        from runtime import zoo
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
        model = zoo.load(name_or_path, dtype=dtype, device=device)
        tokenizer = None
        path = Path(name_or_path)
        if path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer=tokenizer, **kwargs)

    @staticmethod
    def _eos_ids(model) -> set[int]:
        ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if ids is None:
            ids = getattr(model.config, "eos_token_id", None)
        if ids is None:
            return set()
        return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}

    def _plan_memory(self, specs, budget: int | None, block_size: int, state_rows: int) -> int:
        """Cache blocks that fit the budget (default: 90% of free GPU memory, or 256 MB) next to the SSM states."""
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.9)
            else:
                budget = DEFAULT_CPU_BUDGET
        state_bytes = state_rows * sum(s.bytes_per_state_row() for s in specs)
        token_bytes = sum(s.bytes_per_token(self.dtype) for s in specs)
        if not token_bytes:
            if state_bytes > budget:
                raise ValueError(f"the SSM states of {state_rows} sequences need {state_bytes} bytes, more than "
                                 f"the cache budget of {budget}: lower max_num_seqs or raise cache_memory")
            return 0
        num_blocks = (budget - state_bytes) // (block_size * token_bytes)
        if num_blocks < 2:
            raise ValueError(f"cache budget {budget} bytes leaves room for {max(num_blocks, 0)} blocks of "
                             f"{block_size} tokens ({block_size * token_bytes} bytes each; 2 needed): raise "
                             "cache_memory or lower max_num_seqs")
        return int(num_blocks)

    # -- requests ---------------------------------------------------------------------------------------
    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (no tokenizer files in its directory): pass token ids "
                                 "(--prompt-ids) instead of text")
            return self.tokenizer(prompt)["input_ids"]
        return [int(t) for t in prompt]

    def add_request(self, prompt: str | Iterable[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        ids = self._encode(prompt)
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if self.max_model_len is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                             f"maximum length of {self.max_model_len} tokens")
        seq = Sequence(ids, params)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        self.scheduler.add(seq)
        self._seqs[seq.request_id] = seq
        return seq.request_id

    # -- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Run one model step and return its tokens. A greedy decode step that the next one would repeat
        (same sequences, nothing waiting, nobody at max_tokens) launches that next step before reading its
        own tokens: the device runs step n+1 while the host finishes step n (its tokens stay on the device
        and feed step n+1 directly). A sequence that stops on EOS or a stop token then has one extra token
        computed and dropped."""
        if self._ahead is not None:
            step, pending = self._ahead
            self._ahead = None
        else:
            step = self.scheduler.schedule()
            if step is None:
                return []
            pending = self.runner.launch(step)
        if self.overlap and self._repeats(step, pending):
            nxt = Step("decode", list(step.seqs), [1] * len(step.seqs))
            self._ahead = (nxt, self.runner.launch(nxt, ahead=pending))
        tokens = self.runner.finish(pending)
        self.stats["steps"] += 1
        if step.kind == "prefill":
            self.stats["prefill_tokens"] += sum(step.num_tokens)
        events = []
        for seq, tok in zip(step.seqs, tokens):
            if tok is None or seq.status is Status.FINISHED:  # finished while this step ran ahead: dropped
                continue
            seq.output.append(tok)
            reason = self._stop_reason(seq, tok)
            if reason:
                self.scheduler.finish(seq, reason)
            events.append(TokenEvent(seq.request_id, tok, reason is not None, reason))
        if step.kind == "decode":  # tokens kept, not rows computed (a dropped token is not output)
            self.stats["decode_steps"] += 1
            self.stats["decode_tokens"] += len(events)
        return events

    def _repeats(self, step: Step, pending) -> bool:
        """Would the scheduler's next step decode exactly these sequences again? (and can it, cache-wise)"""
        sched = self.scheduler
        if step.kind != "decode" or pending.tokens is None:
            return False
        if sched.running != step.seqs or sched.would_prefill():
            return False
        for seq in step.seqs:  # after this step's token: still below max_tokens and the model's length
            if len(seq.output) + 1 >= seq.params.max_tokens:
                return False
            if self.max_model_len is not None and len(seq) + 1 >= self.max_model_len:
                return False
        return all(sched.reserve(seq, len(seq) + 1) for seq in step.seqs)

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        if not seq.params.ignore_eos and tok in self.eos:
            return "stop"
        if tok in seq.params.stop_token_ids:
            return "stop"
        if len(seq.output) >= seq.params.max_tokens:
            return "length"
        if self.max_model_len is not None and len(seq) >= self.max_model_len:
            return "length"
        return None

    def has_unfinished(self) -> bool:
        """Requests left, or a step still running ahead (its tokens may all be dropped)."""
        return self._ahead is not None or self.scheduler.has_work()

    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[TokenEvent]:
        for rid in self._add_all(prompts, params):
            pass
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress=None) -> list[RequestOutput]:
        ids = self._add_all(prompts, params)
        t0, n = time.perf_counter(), 0
        while self.has_unfinished():
            n += len(self.step())
            if progress is not None:
                progress(n, time.perf_counter() - t0)
        return [self.output(rid) for rid in ids]

    def _add_all(self, prompts, params) -> list[int]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        return [self.add_request(p, sp) for p, sp in zip(prompts, plist)]

    def output(self, request_id: int) -> RequestOutput:
        seq = self._seqs[request_id]
        text = self.tokenizer.decode(seq.output) if self.tokenizer is not None else None
        return RequestOutput(seq.request_id, seq.prompt, list(seq.output),
                             seq.finish_reason if seq.status is Status.FINISHED else None, text, seq.preemptions)
