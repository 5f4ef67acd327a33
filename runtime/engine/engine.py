"""``Engine``: generation over the compiled model with paged caches and continuous batching.

    engine = Engine.from_pretrained("deepseek_v3")            # zoo name or HF model directory
    outs = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=16))
    for event in engine.stream(["Hello"], SamplingParams(max_tokens=8, temperature=0.8, seed=0)): ...

``step()`` is the whole loop: schedule, run, postprocess. ``abort(request_id)`` ends a request at once; a step
that raises fails the requests it ran (``finish_reason="error"``) and leaves the engine ready for the next one,
except under tensor parallelism, where it stops the engine (``RankFailure``: the ranks would no longer agree).
"""
from __future__ import annotations

import contextlib
import logging
import numbers
import os
import time
from collections.abc import Iterable, Iterator

import torch

from runtime import distributed
from runtime.hf import cache_kwarg

from .allocator import BlockAllocator, SlotAllocator
from .cache import PagedCache, discover_layers, chunking_problem
from .features import Unsupported, batch_rope_limit, check_model, own_attention
from .model_runner import ModelRunner, decode_bucket
from .scheduler import Scheduler, Step
from .sequence import (RequestOutput, SamplingParams, Sequence, Status, TokenEvent, check_bool, check_int,
                       token_ids)

DEFAULT_CPU_BUDGET = 256 << 20
#: padded tokens of one prefill step of several prompts, unless ``max_num_batched_tokens`` says otherwise
DEFAULT_BATCHED_TOKENS = 8192
COMPILE_MODES = ("auto", "hybrid-cudagraphs", "hybrid", "hybrid-eager", None, "none")
log = logging.getLogger(__name__)


def _where(error: Exception) -> str:
    """An exception in one line: type, message (cut at 160 characters) and the file:line it was raised at."""
    import traceback
    frames = traceback.extract_tb(error.__traceback__)
    at = f" at {frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else ""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}{': ' + message[:160] if message else ''}{at}"


#: sequences decoded together when ``Engine(max_num_seqs=None)`` (an engine directory's --max-batch where lower)
DEFAULT_MAX_NUM_SEQS = 32


def check_options(opts: dict) -> None:
    """Type and range of ``Engine`` keyword options (TypeError / ValueError naming the option), before anything
    is built; unknown names are a TypeError."""
    for name, value in opts.items():
        where = f"Engine: {name}"
        if name in ("block_size", "max_num_seqs", "max_prefill_tokens", "cache_memory", "max_num_batched_tokens",
                    "tensor_parallel"):
            if value is not None or name not in ("cache_memory", "max_num_batched_tokens", "max_num_seqs"):  # None: default
                check_int(where, value, 1)
        elif name in ("bucket_decode", "paged_decode", "overlap", "freeze_weights", "expert_parallel", "packed_steps"):
            check_bool(where, value, none_ok=name in ("bucket_decode", "paged_decode", "packed_steps"))
        elif name == "expert_placement":
            if value is not None and not isinstance(value, (dict, str, os.PathLike)):
                raise TypeError(f"{where} must be a placement dict or the path of one (runtime.distributed.balance), "
                                f"got {type(value).__name__}")
            if value is not None and not opts.get("expert_parallel"):
                raise ValueError(f"{where} places experts over ranks: it needs expert_parallel=True")
        elif name == "compile":
            if not isinstance(value, (str, type(None))) or value not in COMPILE_MODES:
                raise ValueError(f"{where} must be one of {', '.join(map(repr, COMPILE_MODES))}, got {value!r}")
        elif name == "compile_options":
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"{where} must be a dict of hybrid backend options, got {type(value).__name__}")
            if value and opts.get("compile", "auto") in (None, "none"):
                raise ValueError(f"{where} {value} need a hybrid compile mode, got compile={opts['compile']!r}")
            if value:
                from compiler.options import Options
                try:
                    Options.parse(value)
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
        else:
            raise TypeError(f"Engine got an unknown option {name!r}")


def _exported_option(name: str, value, plan: dict):
    """An option an engine directory fixed at export: its value, or ValueError when asked for another."""
    if value is not None and value != plan[name] and not (name == "block_size" and value == 16):
        raise ValueError(f"Engine: {name}={value!r}, but the engine directory was exported with {plan[name]!r}: leave "
                         f"it unset, or export again with that {name}")
    return plan[name]


def _free_bytes(device: torch.device) -> int | None:
    """Memory free for the cache on ``device``: the GPU's free memory, or the host's MemAvailable (None where
    unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Engine:
    def __init__(self, model, *, tokenizer=None, cache_memory: int | None = None, block_size: int = 16,
                 max_num_seqs: int | None = None, max_prefill_tokens: int = 512, max_num_batched_tokens: int | None = None,
                 compile: str | None = "auto", bucket_decode: bool | None = None, paged_decode: bool | None = None,
                 overlap: bool = True, freeze_weights: bool = False, compile_options: dict | None = None,
                 tensor_parallel: int = 1, expert_parallel: bool = False, expert_placement=None,
                 packed_steps: bool | None = None):
        if not (isinstance(model, torch.nn.Module) and hasattr(model, "config")):
            raise TypeError(f"Engine: model must be a Hugging Face causal LM (a torch.nn.Module with a .config), got "
                            f"{type(model).__name__}; for a zoo name or a model directory use Engine.from_pretrained")
        check_options(dict(cache_memory=cache_memory, block_size=block_size, max_num_seqs=max_num_seqs,
                           max_prefill_tokens=max_prefill_tokens, max_num_batched_tokens=max_num_batched_tokens,
                           compile=compile, bucket_decode=bucket_decode,
                           paged_decode=paged_decode, overlap=overlap, freeze_weights=freeze_weights,
                           compile_options=compile_options, tensor_parallel=tensor_parallel,
                           expert_parallel=expert_parallel, expert_placement=expert_placement,
                           packed_steps=packed_steps))
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        text_config = model.config.get_text_config()  # a multimodal wrapper's language model config
        self.vocab_size = text_config.vocab_size
        self.max_model_len = getattr(text_config, "max_position_embeddings", None)
        #: why max_model_len is shorter than the model's own maximum, where it is (said when a request exceeds it)
        self.length_note = ""
        rope_limit = batch_rope_limit(text_config)
        if rope_limit is not None and (self.max_model_len is None or self.max_model_len > rope_limit):
            self.max_model_len = rope_limit
            self.length_note = (f" (its longrope RoPE picks one set of factors for a whole batch from its longest "
                                f"sequence past {rope_limit} positions, so the engine runs sequences up to there)")
            log.warning("hybrid engine: %s%s", type(model).__name__, self.length_note)
        self.eos = self._eos_ids(model)
        plan = getattr(model, "engine_plan", None)  # an engine directory's model (runtime/aot): found at export
        self.tp_group, self.shard_report = None, None
        self._rank_failure: str | None = None  # set when a tensor-parallel step fails: the engine is stopped
        if tensor_parallel > 1 and plan is not None:
            raise ValueError("Engine: tensor_parallel > 1 runs an HF model, not an engine directory (its programs "
                             "hold the whole model)")
        if plan is not None:
            specs, self.prefill_note = plan["specs"], plan["prefill_note"]
            block_size, paged_decode = _exported_option("block_size", block_size, plan), \
                _exported_option("paged_decode", paged_decode, plan)
            if max_num_seqs is None:
                max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, plan["max_batch"])
            if max_num_seqs > plan["max_batch"]:
                raise ValueError(f"Engine: max_num_seqs={max_num_seqs} is beyond the engine directory's --max-batch "
                                 f"{plan['max_batch']}: lower it, or export again with a larger --max-batch")
            if max_prefill_tokens > plan["max_prefill_tokens"]:
                max_prefill_tokens = plan["max_prefill_tokens"]  # the chunk lengths the programs were exported for
            if self.max_model_len is None or plan["max_seq_len"] < self.max_model_len:
                self.max_model_len = plan["max_seq_len"]
                self.length_note = (f" (the engine directory's --max-seq-len {plan['max_seq_len']}: export again with "
                                    "a larger --max-seq-len for longer requests)")
        else:
            max_num_seqs = DEFAULT_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs
            check_model(model)  # features the engine cannot run exactly: refused in one line (features.py)
            self._shard(model, tensor_parallel, expert_parallel, expert_placement)
            specs = discover_layers(model, cache_kwarg(model))
        unapplied = [s.window for s in specs if s.window_unapplied]
        if unapplied and (self.max_model_len is None or self.max_model_len > min(unapplied)):
            self.max_model_len = min(unapplied)
            self.length_note = " (its cache keeps a sliding window that its attention does not apply)"
            log.warning("hybrid engine: %s's cache keeps a sliding window of %d keys that its attention does not apply "
                        "(HF's generate with a cache and its own forward differ past it): sequences are limited to %d "
                        "tokens, where both agree", type(model).__name__, self.max_model_len, self.max_model_len)
        has_attn = any(s.keys for s in specs)
        has_ssm = any(s.states for s in specs)
        # long prompts are prefilled in chunks of max_prefill_tokens, except where an SSM mixer would not continue
        # a chunk from the cached states exactly (HF's Mamba1 scan; the reason is kept here). Probed before the
        # caches take the device's memory.
        num_state_layers = sum(s.states for s in specs)
        if plan is None:
            self.prefill_note = chunking_problem(model, num_state_layers) if has_ssm else None
        self._layer_specs = specs
        if compile == "auto":
            compile = "hybrid-cudagraphs" if self.device.type == "cuda" else "hybrid-eager"
        if compile == "hybrid-cudagraphs" and self.device.type != "cuda":
            raise ValueError(f"compile='hybrid-cudagraphs' records CUDA graphs and needs the model on a CUDA device, got "
                             f"{self.device}: use compile='hybrid' or 'auto'")
        if bucket_decode is None:  # CUDA graphs need repeating shapes: decode batches padded to buckets
            bucket_decode = compile == "hybrid-cudagraphs"
        elif not bucket_decode and compile == "hybrid-cudagraphs":
            raise ValueError("compile='hybrid-cudagraphs' needs bucket_decode=True (graphs are recorded per bucket)")
        # padding rows of a bucketed decode step need SSM state rows of their own
        state_rows = (decode_bucket(max_num_seqs) if bucket_decode else max_num_seqs) if has_ssm else 0
        num_blocks = self._plan_memory(specs, cache_memory, block_size, state_rows)
        if self.tp_group is not None:  # every rank schedules alike only with the same cache
            num_blocks = distributed.min_over_ranks(num_blocks, self.tp_group)
        mla = hasattr(text_config, "kv_lora_rank")
        if plan is not None:
            own = plan["own_attention"]
        else:
            own = own_attention(model) if has_attn and not mla else []
        self._own_attention = own
        if own and paged_decode:
            raise Unsupported(f"paged decode for attention that does not call HF's attention functions ({own[0]}); "
                              "leave paged_decode unset")
        if paged_decode is None:  # decode attention over the pages in place: MLA layers on any device once the
            # MLA pass rewrites them (hybrid_kernels/mla/ops.py), MHA/GQA layers on the GPU (attention.py)
            paged_decode = has_attn and not own and (mla or self.device.type == "cuda")
        self.cache = PagedCache(specs, num_blocks * block_size if has_attn else 1, state_rows, self.dtype,
                                self.device, latent=mla and paged_decode, block_size=block_size,
                                contiguous=bool(own))
        self.blocks = BlockAllocator(num_blocks, block_size) if has_attn else None
        self.slots = SlotAllocator(max_num_seqs) if has_ssm else None
        # several prompts per prefill step (left-padded rows) where every cached layer is attention read through the
        # engine's mask; with state layers (SSM, delta rule) only rows of equal length, since a recurrence would run
        # over the padding; attention of the model's own and engine directories exported for one prompt a step
        # (written before directories held batched prefills) take one. A directory's "equal": state layers, rows of
        # one length (the export's programs are unpadded)
        one = ("attention of the model's own: one prompt per prefill step" if own else
               "engine directory: one prompt per prefill step" if plan is not None
               and plan.get("prefill_seqs") not in ("several", "equal") else None)
        self.prefill_batch_note = one or ("state layers: prompts of equal length per prefill step" if has_ssm else None)
        self.scheduler = Scheduler(self.blocks, self.slots, max_num_seqs=max_num_seqs,
                                   max_prefill_tokens=max_prefill_tokens, chunked_prefill=self.prefill_note is None,
                                   max_num_batched_tokens=max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS,
                                                                                        max_prefill_tokens),
                                   max_prefill_seqs=1 if one else max_num_seqs, equal_lengths=has_ssm)
        self.runner = ModelRunner(model, self.cache, self.blocks, compile, bucket_decode, paged_decode, freeze_weights,
                                  compile_options)
        self._seqs: dict[int, Sequence] = {}
        self.stats = dict(steps=0, decode_steps=0, packed_steps=0, prefill_tokens=0, decode_tokens=0, failed_steps=0)
        self.overlap = overlap
        self._ahead = None  # (step, pending): a decode step launched before the previous one was read
        # events of the requests a stream / generate call waits on, kept per request until that call takes them:
        # any caller's step runs every request, so two open streams (or a generate inside a stream loop) each get
        # their own requests' events whichever of them stepped
        self._inbox: dict[int, list[TokenEvent]] = {}
        self._probe_errors: list[Exception] | None = None
        #: why steps that prefill are not packed (None when they are; ``_packed_probe``)
        self.packed_note: str | None = ("packed_steps=False" if packed_steps is False else
                                        "engine directory" if plan is not None else
                                        "tensor parallelism" if self.tp_group is not None else
                                        self.runner.pack_note)
        if plan is None and self.tp_group is None:
            self._probe(model)
        if packed_steps and not self.scheduler.packed:
            raise ValueError(f"Engine: packed_steps=True, but {type(model).__name__} takes no packed steps "
                             f"({self.packed_note}): leave packed_steps unset")

    def _probe(self, model) -> None:
        """Short requests through the engine's own steps (a batched prefill of prompts of two lengths, of two
        prompts of one length with state layers, then decodes), the HF forward run eagerly: a model whose code
        cannot run over the engine's cache (masks it builds from its own shapes, inputs it slices by the cache
        length) is refused here in one line, instead of failing every request later. A batched prefill that fails
        where single prompts run makes every prefill step take one prompt. With state layers, ``_padding_probe``
        decides whether prompts of several lengths may share a prefill step. Costs a few eager forwards of a few
        tokens; no compile, no CUDA graph."""
        n = min(7, (self.max_model_len or 9) - 2)
        if n < 4:
            return
        runner = self.runner
        ids = [i % self.vocab_size for i in range(1, n + 1)]
        padding = None
        try:
            with self._probing(model) as errors:
                outs = self.generate([ids[:3], ids, ids[1:] + ids[:1]], SamplingParams(max_tokens=2, ignore_eos=True))
                if runner.can_pad_states and self.scheduler.max_prefill_seqs > 1 and not errors:
                    padding = self._padding_probe(ids)
        except ValueError as e:  # the probe's requests do not fit this engine (a cache of a few blocks): no probe
            log.debug("hybrid engine: no construction probe (%s)", e)
            return
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed:
            raise Unsupported(f"{type(model).__name__}'s forward over the engine's cache: a probe request failed "
                              f"({_where(errors[-1]) if errors else failed[0].error})")
        if self.packed_note is None and not errors:
            self._packed_probe(model, [ids[:3], ids, ids[1:] + ids[:1]], [o.token_ids for o in outs])
        elif self.packed_note is None:
            self.packed_note = "a batched prefill failed"
        if errors:  # the batched prefill failed, each prompt alone ran
            self.prefill_batch_note = f"one prompt per prefill step (a batched prefill failed: {_where(errors[0])})"
            self.scheduler.max_prefill_seqs = 1
            log.warning("hybrid engine: %s", self.prefill_batch_note)
        elif padding == "":
            runner.pad_states, self.scheduler.equal_lengths, self.prefill_batch_note = True, False, None
        elif padding:
            self.prefill_batch_note = f"state layers: prompts of equal length per prefill step ({padding})"
            log.info("hybrid engine: %s", self.prefill_batch_note)

    @contextlib.contextmanager
    def _probing(self, model, **scheduler):
        """Probe requests through the engine's own steps, the HF forward run eagerly (no compile, no CUDA graph),
        with the ``scheduler`` settings given: yields the list that collects their steps' errors. Afterwards the
        runner, the statistics, those settings and the expert loads are as before, and no probe request is left."""
        runner, sched = self.runner, self.scheduler
        saved = runner.forward, runner.graphs_enabled, dict(self.stats), {k: getattr(sched, k) for k in scheduler}
        runner.forward, runner.graphs_enabled = model.forward, False
        for name, value in scheduler.items():
            setattr(sched, name, value)
        errors = self._probe_errors = []
        try:
            yield errors
        finally:
            runner.forward, runner.graphs_enabled, self.stats = saved[:3]
            for name, value in saved[3].items():
                setattr(sched, name, value)
            self._probe_errors = None
            self._seqs.clear()
            self.reset_expert_loads()

    def _packed_probe(self, model, prompts: list[list[int]], want: list[list[int]]) -> None:
        """Turn packed steps on (``Scheduler.packed``) where they give the tokens the padded steps gave: the probe's
        prompts again, in chunks of 4 within steps of 8 tokens, so that decodes share steps with chunks continuing
        prompts at several points; the HF forward run eagerly. Any error or other token leaves them off, and
        ``packed_note`` says why."""
        with self._probing(model, packed=True, max_prefill_tokens=4, max_num_batched_tokens=8) as errors:
            got = [o.token_ids for o in self.generate(prompts, SamplingParams(max_tokens=len(want[0]),
                                                                              ignore_eos=True))]
        if errors:
            self.packed_note = f"a packed step failed: {_where(errors[-1])}"
        elif got != want:
            self.packed_note = f"packed steps gave tokens {got} where padded steps gave {want}"
        self.scheduler.packed = self.packed_note is None
        if self.packed_note:
            log.info("hybrid engine: steps that prefill are padded, not packed (%s)", self.packed_note)

    def _padding_probe(self, ids: list[int]) -> str:
        """Whether left padding leaves the state layers exact: a 3-token prompt prefilled left-padded beside a longer
        one, the state layers given HF's 2-D padding mask (``ModelRunner.pad_states``), against the same prompt
        alone. '' when every state row (conv and recurrent) agrees within the dtype's rounding, else the reason
        (a model that runs its recurrence over the padding, a projection bias the mask does not cancel)."""
        runner, sched, errors = self.runner, self.scheduler, self._probe_errors
        short, params, before = ids[:3], SamplingParams(max_tokens=1, ignore_eos=True), len(errors)
        runner.pad_states, sched.equal_lengths = True, False
        try:
            self.generate([short, ids], params)  # one step: rows 0 (padded) and 1
        finally:
            runner.pad_states, sched.equal_lengths = False, True
        if len(errors) > before:
            reason = f"a padded prefill failed: {_where(errors[-1])}"
            del errors[before:]
            return reason
        padded = [b for layer in self.cache.states for b in layer.snapshot(1)]
        self.generate([short], params)
        alone = [b for layer in self.cache.states for b in layer.snapshot(1)]
        for i, (a, b) in enumerate(zip(padded, alone)):
            err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
            if err > (1e-4 if b.dtype == torch.float32 else 3e-2):
                return f"a padded prefill moved a state layer's states: relative error {err:.1e} in state buffer {i}"
        return ""

    # -- construction ---------------------------------------------------------------------------------
    def _shard(self, model, tensor_parallel: int, expert_parallel: bool, expert_placement) -> None:
        """Split the model over ``tensor_parallel`` ranks (runtime/distributed; ``expert_parallel``: MoE experts by
        index, placed as ``expert_placement`` says, a dict or a file of runtime.distributed.balance): every rank
        builds the same Engine over its shard, schedules the same steps and samples the same tokens (rank 0's,
        where they are random)."""
        if tensor_parallel == 1:
            if expert_parallel:
                raise ValueError("Engine: expert_parallel=True splits experts over the tensor_parallel ranks: give "
                                 "tensor_parallel > 1")
            return
        self.tp_group = distributed.check_group(tensor_parallel)
        if isinstance(expert_placement, (str, os.PathLike)):
            expert_placement = distributed.balance.load(expert_placement)
        self.shard_report = distributed.shard_model(model, self.tp_group, expert_parallel=expert_parallel,
                                                    expert_placement=expert_placement)
        self.reset_expert_loads()  # the probes' routes are not the workload's
        log.info("hybrid engine: %s", self.shard_report.summary())

    # -- expert load (expert parallelism) -------------------------------------------------------------------
    def _local_experts(self):
        return [m for m in self.model.modules() if isinstance(m, distributed.LocalExperts)]

    def expert_loads(self) -> dict[str, list[int]]:
        """Tokens routed to each expert of every expert-parallel MoE block (by the block's module path) since the
        engine started or ``reset_expert_loads``: the counts ``balance.plan_placement`` takes. Padding rows of
        bucketed decode steps count too (they are computed). Empty without expert parallelism."""
        return {m.block: m.routed.tolist() for m in self._local_experts()}

    def reset_expert_loads(self) -> None:
        for m in self._local_experts():
            m.routed.zero_()
            m.computed.zero_()

    def expert_balance(self) -> dict[str, dict]:
        """The load each rank measured, per expert-parallel MoE block: ``computed`` (routes computed, one entry per
        rank) and ``imbalance`` (max / mean over ranks). Every rank must call it (it gathers over the ranks)."""
        import torch.distributed as dist
        mine = {m.block: int(m.computed) for m in self._local_experts()}
        every = [None] * dist.get_world_size(self.tp_group) if mine else []
        if mine:
            dist.all_gather_object(every, mine, group=self.tp_group)
        out = {}
        for block in mine:
            loads = [d[block] for d in every]
            out[block] = dict(computed=loads, imbalance=distributed.balance.imbalance(loads))
        return out

    @classmethod
    def from_engine(cls, path, *, device: str | None = None, dtype: torch.dtype | None = None, **kwargs) -> "Engine":
        """An engine directory written by ``hybrid export`` (runtime/aot): its exported programs run without tracing
        or compiling, and without the model's modeling code. ``kwargs`` are ``Engine`` options (``block_size`` and
        ``paged_decode`` are the directory's; ``max_num_seqs`` at most its ``--max-batch``)."""
        from .exported import load_model
        check_options(kwargs)
        if kwargs.get("compile", "auto") != "auto" or kwargs.get("compile_options") or kwargs.get("freeze_weights"):
            raise ValueError("Engine.from_engine: an engine directory is compiled already: leave compile, "
                             "compile_options and freeze_weights unset (on the command line: leave out --compile)")
        model, tokenizer = load_model(path, device, dtype)
        return cls(model, tokenizer=tokenizer, **kwargs)

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, device: str | None = None, dtype: torch.dtype | None = None,
                        allow_missing_weights: bool = False, trust_remote_code: bool = False, **kwargs) -> "Engine":
        """A zoo name or an HF model directory (``runtime.zoo.load``: weights that do not match the config are an
        error unless ``allow_missing_weights``; a directory's own Python code runs only with ``trust_remote_code``).
        ``kwargs`` are ``Engine`` options, checked before the model loads."""
        from runtime import zoo
        from .exported import is_engine_dir
        if is_engine_dir(name_or_path):
            return cls.from_engine(name_or_path, device=device, dtype=dtype, **kwargs)
        check_options(kwargs)
        check_bool("Engine.from_pretrained: allow_missing_weights", allow_missing_weights)
        check_bool("Engine.from_pretrained: trust_remote_code", trust_remote_code)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"Engine.from_pretrained: dtype must be a floating torch.dtype (e.g. torch.bfloat16), got "
                            f"{dtype!r}")
        device = str(zoo.check_device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
        dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        model = zoo.load(name_or_path, dtype=dtype, device=device, allow_missing_weights=allow_missing_weights,
                         trust_remote_code=trust_remote_code)
        tokenizer = zoo.load_tokenizer(name_or_path, trust_remote_code)
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
        else:
            free = _free_bytes(self.device)
            if free is not None and budget > free:
                raise ValueError(f"cache_memory of {budget >> 20} MB is more than the {free >> 20} MB free on "
                                 f"{self.device}: lower it (hybrid: --cache-mb), or leave it unset for the default")
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
    def _encode(self, prompt, where: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: this model has no tokenizer (no tokenizer files in its directory): pass "
                                 "token ids instead of text (hybrid generate: --prompt-ids)")
            return list(self.tokenizer(prompt)["input_ids"])
        return token_ids(where, prompt)

    def _sequence(self, prompt, params: SamplingParams | None, where: str) -> Sequence:
        """A checked request, not queued yet (ValueError / TypeError naming ``where`` when it cannot run)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: params must be a SamplingParams, got {type(params).__name__}")
        ids = self._encode(prompt, where)
        if not ids:
            raise ValueError(f"{where}: empty prompt, give at least one token")
        for what, toks in (("token ids", ids), ("stop_token_ids", params.stop_token_ids)):
            if toks and (min(toks) < 0 or max(toks) >= self.vocab_size):
                bad = [t for t in toks if not 0 <= t < self.vocab_size]
                raise ValueError(f"{where}: {what} {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if self.max_model_len is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"{where}: {len(ids)} prompt tokens + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's maximum length of {self.max_model_len} tokens{self.length_note}")
        seq = Sequence(ids, params)
        self.scheduler.check(seq)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        return seq

    def _requests(self, prompts, params) -> list[Sequence]:
        """Every request of a batch, checked before any is queued. ``prompts``: a string, a list of token ids, a
        1-D tensor (one prompt), a 2-D tensor (one prompt per row) or a list of strings / id lists / 1-D tensors;
        ``params``: one SamplingParams (or None) for all, or a list with one per prompt."""
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() not in (1, 2):
                raise ValueError(f"prompts as a tensor must be 1-D (one prompt) or 2-D (one prompt per row), got shape "
                                 f"{tuple(prompts.shape)}")
            prompts = [prompts] if prompts.dim() == 1 else list(prompts)
        elif isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, (bytes, bytearray, dict, set)) or not hasattr(prompts, "__iter__"):
            raise TypeError(f"prompts must be a string, a list of token ids or a list of prompts, got "
                            f"{type(prompts).__name__}")
        else:
            prompts = list(prompts)
            if prompts and isinstance(prompts[0], numbers.Integral):
                prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
        elif isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts and {len(params)} SamplingParams: give one "
                                 "SamplingParams for all prompts or one per prompt")
            plist = list(params)
        else:
            raise TypeError(f"params must be a SamplingParams or a list of them (one per prompt), got "
                            f"{type(params).__name__}")
        many = len(prompts) > 1
        return [self._sequence(p, sp, f"prompt {i}" if many else "prompt")
                for i, (p, sp) in enumerate(zip(prompts, plist))]

    def _queue(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.scheduler.add(seq)
            self._seqs[seq.request_id] = seq

    def add_request(self, prompt: str | Iterable[int], params: SamplingParams | None = None) -> int:
        seq = self._sequence(prompt, params, "prompt")
        self._queue([seq])
        return seq.request_id

    def add_requests(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[int]:
        """Queue a batch (the forms ``generate`` takes), checked whole first: nothing is queued when any prompt is
        refused. Returns the request ids in order."""
        seqs = self._requests(prompts, params)
        self._queue(seqs)
        return [s.request_id for s in seqs]

    def abort(self, request_id: int) -> bool:
        """End a request now, waiting or running: its blocks and state row are free at once, its output keeps the
        tokens it had with ``finish_reason="abort"``. False when it had already finished. Call it from the thread
        that steps the engine (between steps, or inside a ``stream`` loop)."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise TypeError(f"abort: request_id must be an int (from add_request), got {type(request_id).__name__}")
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"no request {request_id!r} in this engine")
        if seq.status is Status.FINISHED:
            return False
        self.scheduler.finish(seq, "abort")  # a step running ahead drops its token (step)
        self._drop_idle_ahead()
        return True

    def _drop_idle_ahead(self) -> None:
        """Forget a step launched ahead whose sequences have all ended: its tokens would all be dropped (the device
        finishes it before any later launch, which is all that freed blocks and rows need)."""
        if self._ahead is not None and all(s.status is Status.FINISHED for s in self._ahead[0].seqs):
            self._ahead = None

    # -- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Run one model step and return its tokens. A greedy decode step that the next one would repeat
        (same sequences, nothing waiting, nobody at max_tokens) launches that next step before reading its
        own tokens: the device runs step n+1 while the host finishes step n (its tokens stay on the device
        and feed step n+1 directly). A sequence that stops on EOS or a stop token then has one extra token
        computed and dropped.

        A step that raises fails the requests it ran: each gets a last event with ``finish_reason="error"`` and
        the message, its blocks and state row are freed, and the next call goes on with the others. An interrupt
        (KeyboardInterrupt) puts the step's sequences back in the queue, recomputed from their tokens later."""
        if self._rank_failure is not None:
            raise distributed.RankFailure(self._rank_failure)
        events = self._step()
        for e in events:
            box = self._inbox.get(e.request_id)
            if box is not None:
                box.append(e)
        return events

    def _step(self) -> list[TokenEvent]:
        step, events = None, []
        try:
            if self._ahead is not None:
                (step, pending), self._ahead = self._ahead, None
            else:
                step = self._schedule()
                if step is None:
                    return self._stalled()
                pending = self._launch(step)
            if self.overlap and self._repeats(step, pending):
                nxt = Step("decode", list(step.seqs), [1] * len(step.seqs), rows_in_use=step.rows_in_use)
                self._ahead = (nxt, self.runner.launch(nxt, ahead=pending))
            tokens = self.runner.finish(pending)
            if self.tp_group is not None and any(s.params.temperature != 0.0 for s in step.seqs):
                tokens = distributed.agree(tokens, self.tp_group)  # rank 0's samples: the ranks' RNGs may differ
            self._record(step, tokens, events)
        except Exception as e:  # noqa: BLE001  (a failed step fails its requests, not the engine)
            if step is None:  # scheduling itself failed: no request to blame
                raise
            if self.tp_group is not None:  # the other ranks ran this step, or wait in its collectives: stop
                raise self._lose_ranks(e) from e
            if step.kind in ("prefill", "packed") and sum(s.status is Status.RUNNING for s in step.seqs) > 1:
                return events + self._retry_alone(step, e)
            return events + self._fail(step, e)
        except BaseException:
            if step is not None:
                self._requeue(step)
            raise
        return events

    def _schedule(self) -> Step | None:
        step = self.scheduler.schedule()
        if step is None and self.scheduler.has_work():  # a decode that preempted all it had leaves a prefill
            step = self.scheduler.schedule()
        return step

    def _launch(self, step: Step):
        """Apply the step's state-row moves (so that a failed launch never loses them), then launch it."""
        self.runner.apply_moves(step.moves)
        step.moves = []
        return self.runner.launch(step)

    def _record(self, step: Step, tokens: list[int | None], events: list[TokenEvent]) -> None:
        self.stats["steps"] += 1
        if step.kind == "prefill":
            self.stats["prefill_tokens"] += sum(step.num_tokens)
        elif step.kind == "packed":
            self.stats["prefill_tokens"] += sum(step.num_tokens[step.num_decodes:])
            self.stats["packed_steps"] += 1
        kept = 0  # decode tokens kept, not rows computed (a dropped token is not output)
        decodes = len(step.seqs) if step.kind == "decode" else step.num_decodes
        for i, (seq, tok) in enumerate(zip(step.seqs, tokens)):
            if tok is None or seq.status is Status.FINISHED:  # finished while this step ran ahead: dropped
                continue
            seq.output.append(tok)
            reason = self._stop_reason(seq, tok)
            if reason:
                self.scheduler.finish(seq, reason)
            events.append(TokenEvent(seq.request_id, tok, reason is not None, reason))
            kept += i < decodes
        self.stats["decode_tokens"] += kept
        if step.kind == "decode":
            self.stats["decode_steps"] += 1

    def _lose_ranks(self, error: Exception) -> Exception:
        """The error that ends a tensor-parallel engine whose step raised: failing only that step's requests here
        would leave this rank's scheduler apart from the others' (and a peer's collectives waiting forever)."""
        import torch.distributed as dist
        self._ahead = None
        self._rank_failure = (f"Engine: a step failed on rank {dist.get_rank(self.tp_group)} of "
                              f"{dist.get_world_size(self.tp_group)} ({' '.join(f'{type(error).__name__}: {error}'.split())[:400]}); "
                              "the ranks no longer run the same steps, so this engine has stopped: start every rank "
                              "again (under hybrid's CLI or torchrun, a rank that exits ends the others)")
        log.error("hybrid engine: %s", self._rank_failure)
        return distributed.RankFailure(self._rank_failure)

    def _fail(self, step: Step, error: Exception) -> list[TokenEvent]:
        """End the requests of a step that raised with ``finish_reason="error"``; drop a step launched ahead of it
        (the same sequences)."""
        self._ahead = None
        if step.moves:
            self.scheduler.return_moves(step.moves)
            step.moves = []
        message = " ".join(f"{type(error).__name__}: {error}".split())
        seqs = [s for s in step.seqs if s.status is not Status.FINISHED]
        self.stats["failed_steps"] += 1
        if self._probe_errors is not None:  # the construction's probe (_probe): it reports the error itself
            self._probe_errors.append(error)
            return [self._end(seq, "error", message) for seq in seqs]
        log.warning("hybrid engine: a %s step failed (%s); requests %s end with finish_reason='error'", step.kind,
                    message, [s.request_id for s in seqs])
        log.debug("the failed step's traceback", exc_info=error)
        return [self._end(seq, "error", message) for seq in seqs]

    def _retry_alone(self, step: Step, error: Exception) -> list[TokenEvent]:
        """A prefill of several prompts that raised: each prompt is prefilled again in a step of its own, where a
        fault fails only the request it belongs to (``_fail``)."""
        self._ahead = None
        if step.moves:
            self.scheduler.return_moves(step.moves)
            step.moves = []
        if self._probe_errors is not None:
            self._probe_errors.append(error)
            self.scheduler.retry_alone(step.seqs)
            return []
        log.warning("hybrid engine: a prefill of %d prompts failed (%s); each is prefilled again alone",
                    len(step.seqs), " ".join(f"{type(error).__name__}: {error}".split()))
        log.debug("the failed step's traceback", exc_info=error)
        self.scheduler.retry_alone(step.seqs)
        return []

    def _end(self, seq: Sequence, reason: str, message: str | None = None) -> TokenEvent:
        seq.error = message
        self.scheduler.finish(seq, reason)
        return TokenEvent(seq.request_id, None, True, reason, message)

    def _requeue(self, step: Step) -> None:
        """An interrupted step: its sequences go back to the queue, to be recomputed from their tokens."""
        self._ahead = None
        if step.moves:
            self.scheduler.return_moves(step.moves)
            step.moves = []
        for seq in step.seqs:
            if seq.status is Status.RUNNING:
                self.scheduler.preempt(seq)

    def _stalled(self) -> list[TokenEvent]:
        """Nothing can be scheduled: [] when nothing is left, else every request left fails (admission makes sure
        that each request fits the cache alone, so this is a bookkeeping bug, reported rather than spun on)."""
        sched = self.scheduler
        if not sched.has_work():
            return []
        free = "" if self.blocks is None else f", {self.blocks.num_free} of {self.blocks.num_blocks - 1} blocks free"
        message = (f"RuntimeError: the engine stalled ({len(sched.waiting)} waiting, {len(sched.running)} running"
                   f"{free}, nothing schedulable): please report this")
        log.warning("hybrid engine: %s", message)
        return [self._end(seq, "error", message) for seq in list(sched.running) + list(sched.waiting)]

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

    def warmup(self, max_context: int | None = None, progress=None) -> dict:
        """Compile and record now what the first requests would otherwise wait for (warmup.py): prefill steps of
        several token counts, and with CUDA graphs every decode graph for contexts up to ``max_context`` tokens.
        Call it before the first request (``hybrid serve`` does); ``progress`` gets one line per phase."""
        from .warmup import warm_up
        return warm_up(self, max_context, progress)

    def has_unfinished(self) -> bool:
        """Requests left, or a step still running ahead (its tokens may all be dropped)."""
        return self._ahead is not None or self.scheduler.has_work()

    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[TokenEvent]:
        """Events of these requests as their tokens come (checked now, queued when iteration starts). Each request
        ends with one event whose ``finished`` is True (``token_id`` None when it was aborted or failed). Leaving
        the loop early (closing the iterator) aborts the requests still running."""
        return self._stream(self._requests(prompts, params))

    def _stream(self, seqs: list[Sequence]) -> Iterator[TokenEvent]:
        self._queue(seqs)
        try:
            for events in self._run(seqs):
                yield from events
        finally:
            self._abort_unfinished(seqs)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress=None) -> list[RequestOutput]:
        """Run these requests to the end: one output per prompt, in order. Nothing is queued when any prompt is
        refused; an interrupt (KeyboardInterrupt) aborts this call's requests, and the others go on."""
        seqs = self._requests(prompts, params)
        self._queue(seqs)
        t0, n = time.perf_counter(), 0
        try:
            for events in self._run(seqs):
                n += sum(e.token_id is not None for e in events)
                if progress is not None:
                    progress(n, time.perf_counter() - t0)
        finally:
            self._abort_unfinished(seqs)
        return [self.output(s.request_id) for s in seqs]

    def _run(self, seqs: list[Sequence]) -> Iterator[list[TokenEvent]]:
        """Step until every one of ``seqs`` has finished; per step, the events of ``seqs`` (other requests run too,
        their events go to their own callers). A request ended without an event of its own (``abort``) gets one."""
        mine = {s.request_id: s for s in seqs}
        for rid in mine:
            self._inbox[rid] = []
        try:
            while mine:
                events = self._take(mine)
                if not events and any(s.status is not Status.FINISHED for s in mine.values()):
                    self.step()
                    events = self._take(mine)
                for e in events:
                    if e.finished:
                        del mine[e.request_id]
                for rid, s in list(mine.items()):
                    if s.status is Status.FINISHED:
                        del mine[rid]
                        events.append(TokenEvent(rid, None, True, s.finish_reason, s.error))
                yield events
        finally:
            for s in seqs:
                self._inbox.pop(s.request_id, None)

    def _take(self, mine: dict[int, Sequence]) -> list[TokenEvent]:
        """The events waiting for these requests, in step order (each request's own order is kept)."""
        events = []
        for rid in mine:
            box = self._inbox[rid]
            if box:
                events.extend(box)
                box.clear()
        return events

    def _abort_unfinished(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")
        self._drop_idle_ahead()

    def output(self, request_id: int) -> RequestOutput:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"no request {request_id!r} in this engine")
        # special tokens (EOS, padding) are not text: the server's streams leave them out alike
        text = self.tokenizer.decode(seq.output, skip_special_tokens=True) if self.tokenizer is not None else None
        return RequestOutput(seq.request_id, seq.prompt, list(seq.output),
                             seq.finish_reason if seq.status is Status.FINISHED else None, text, seq.preemptions,
                             seq.error)
