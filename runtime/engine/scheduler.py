"""Continuous batching, plain Python: which sequences run in the next model step.

Each step is either a prefill or a decode of every running sequence (one token each). Prefills go first, but
never twice in a row while sequences wait to decode (``interleave``): a running sequence waits at most one prefill
step (at most ``max_num_batched_tokens`` tokens) for its next token however long the prompts being prefilled
(with state rows only where the decoding sequences hold rows 0..n-1, the rows a decode step reads). A prefill starts
waiting sequences, in arrival order, as many as fit in one step: each feeds its uncached tokens (its first
chunk when long and the model allows chunking), the rows padded to the longest, and the step's padded tokens
stay within ``max_num_batched_tokens`` (the first row always goes; a row that would make padding more than
half of the step waits for the next; one whose batched prefill failed prefills alone). With ``equal_lengths``
(models with state layers where padding would move the states: the engine's construction probe decides) the rows
of one step all feed the same number of tokens: a prompt of another length waits for the next step. Chunks that
continue prompts under way go first, each from what its cache holds: those at the same point of their prompts with
chunks of one length share a step, unpadded. Requests join between steps and leave when they finish. When the
paged cache is full, the most recently admitted running sequence is preempted: its blocks and state row are freed
and it is recomputed later from its tokens (prompt + what it generated), so nothing is lost and no sequence ever
writes into another's cache. A request ends (``finish``) when it stops, is aborted or fails; whatever it holds is
free at once.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .allocator import BlockAllocator, SlotAllocator
from .sequence import Sequence, Status


@dataclass
class Step:
    kind: str  # "prefill" | "decode" | "packed" (decodes and prefill chunks in one unpadded forward)
    seqs: list[Sequence]
    #: tokens each sequence feeds this step (its uncached tokens, or a chunk of them)
    num_tokens: list[int]
    #: SSM state rows to move before the step (from_row, to_row), left by sequences that finished/preempted
    moves: list[tuple[int, int]] = field(default_factory=list)
    #: a packed step's first ``num_decodes`` sequences decode (one token each); the others feed prefill chunks
    num_decodes: int = 0
    #: state rows held when the step was scheduled (rows 0..n-1): a decode step of fewer sequences must not pad its
    #: batch into the others (``ModelRunner.launch``)
    rows_in_use: int = 0


class Scheduler:
    def __init__(self, blocks: BlockAllocator | None, slots: SlotAllocator | None, *, max_num_seqs: int,
                 max_prefill_tokens: int, chunked_prefill: bool, max_num_batched_tokens: int | None = None,
                 max_prefill_seqs: int = 1, equal_lengths: bool = False, interleave: bool = True,
                 packed: bool = False):
        self.blocks, self.slots = blocks, slots
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        #: padded tokens of a prefill step of several sequences; sequences per prefill step (1: one at a time)
        self.max_num_batched_tokens = max_num_batched_tokens or max_prefill_tokens
        self.max_prefill_seqs = max_prefill_seqs
        #: the rows of a prefill step of several sequences feed the same number of tokens (no padding)
        self.equal_lengths = equal_lengths
        self.chunked_prefill = chunked_prefill
        #: a decode step after each prefill step while sequences are ready to decode
        self.interleave = interleave
        #: steps that prefill go packed: every sequence ready to decode plus prefill chunks, unpadded (``_schedule_packed``)
        self.packed = packed
        self._last_kind: str | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._moves: list[tuple[int, int]] = []
        self.num_preemptions = 0
        #: request ids that prefill alone: a prefill of several sequences that held them failed (``retry_alone``)
        self.alone: set[int] = set()

    def check(self, seq: Sequence) -> None:
        """Refuse a request that could never run: alone in the cache it would not fit (so every request that
        is admitted finishes, by preempting the others if need be)."""
        if self.blocks is not None:
            need = self.blocks.blocks_for(len(seq) + seq.params.max_tokens)
            if need > self.blocks.num_blocks - 1:
                raise ValueError(f"request {seq.request_id} needs {need} cache blocks for its prompt and max_tokens "
                                 f"but the cache has {self.blocks.num_blocks - 1}: raise the cache memory budget "
                                 "(cache_memory, --cache-mb) or lower max_tokens")

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def would_prefill(self) -> bool:
        """Could the next step be a prefill (a partial prefill, or a waiting request with room to start:
        a batch slot, a state row and cache blocks for its first chunk, or its whole prompt with SSM rows)?"""
        if any(s.num_uncached > 1 for s in self.running):
            return True
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        seq = self.waiting[0]
        return self._fits(seq, self._prefill_upto(seq))

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` cached tokens of a running sequence (False when the cache is full)."""
        return self._reserve(seq, num_tokens)

    # ------------------------------------------------------------------------------------------------
    def schedule(self) -> Step | None:
        step = self._schedule_packed() if self.packed else None
        if step is None:
            step = self._schedule_decode() if self._decode_due() else None
            step = step or self._schedule_prefill() or self._schedule_decode()
        if step is not None:
            step.moves, self._moves = self._moves, []
            self._last_kind = step.kind
            step.rows_in_use = self.slots.num_used if self.slots is not None else 0
        return step

    def _decode_due(self) -> bool:
        """Does a decode go before the next prefill? After a prefill step, when sequences are ready to decode (and,
        with state rows, hold rows 0..n-1: a sequence still prefilling never sits among the rows a decode reads)."""
        if not self.interleave or self._last_kind != "prefill":
            return False
        ready = [s for s in self.running if s.num_uncached == 1]
        if not ready:
            return False
        return self.slots is None or sorted(s.state_slot for s in ready) == list(range(len(ready)))

    def _schedule_prefill(self) -> Step | None:
        partial = [s for s in self.running if s.num_uncached > 1]
        if partial:
            return self._schedule_continue(partial)
        seqs, counts = [], []
        for seq in list(self.waiting):  # arrival order: a request never overtakes an earlier one
            if len(self.running) >= self.max_num_seqs or len(seqs) >= self.max_prefill_seqs:
                break
            n = self._chunk(seq)
            if seqs and (seq.request_id in self.alone or (self.equal_lengths and n != counts[0])):
                break
            if seqs:
                padded = max(max(counts), n) * (len(seqs) + 1)
                if padded > self.max_num_batched_tokens or padded > 2 * (sum(counts) + n):
                    break
            if not self._reserve(seq, self._prefill_upto(seq)):
                break
            self._admit(seq, n, seqs, counts)
            if seq.request_id in self.alone:
                if n == seq.num_uncached:  # else it stays alone for the chunks that continue its prompt
                    self.alone.discard(seq.request_id)
                break
        if not seqs:
            return None
        self._sort_running()
        return Step("prefill", seqs, counts)

    def _schedule_packed(self) -> Step | None:
        """A packed step (models whose attention and state layers run on packed sequences): every sequence
        ready to decode, one token each, then prefill chunks within ``max_num_batched_tokens`` tokens in all: the
        chunks that continue prompts under way (each from its own point), then waiting prompts in arrival order, a
        chunk cut to the tokens left in the step. No padding, and no running sequence waits for a prompt. Without
        prefill work the step is a plain decode step (CUDA graphs). None leaves the step to the padded schedule: a
        request that must prefill alone (``alone``), prompts under way that need a preemption to continue, a prompt
        that goes whole (no chunking) and does not fit what is left of the step."""
        partial = [s for s in self.running if s.num_uncached > 1]
        if any(s.request_id in self.alone for s in partial) or (
                not partial and self.waiting and self.waiting[0].request_id in self.alone):
            return None
        if not partial and not self.would_prefill():
            return self._schedule_decode()
        decode = self._schedule_decode()
        seqs = list(decode.seqs) if decode is not None else []
        counts = [1] * len(seqs)
        budget = self.max_num_batched_tokens - len(seqs)
        for seq in partial:
            n = min(self._chunk(seq), budget)
            if seq.status is not Status.RUNNING or n <= 0 or not self._reserve(seq, self._packed_upto(seq, n)):
                continue
            seqs.append(seq)
            counts.append(n)
            budget -= n
        whole = False  # the next prompt goes whole (no chunking) and does not fit in what is left of the step
        for seq in list(self.waiting):  # arrival order: a request never overtakes an earlier one
            if budget <= 0 or len(self.running) >= self.max_num_seqs or seq.request_id in self.alone:
                break
            n = min(self._chunk(seq), budget) if self.chunked_prefill else seq.num_uncached
            whole = n > budget
            if n > budget or not self._reserve(seq, self._packed_upto(seq, n)):
                break
            self._admit(seq, n, seqs, counts)
            budget -= n
        self._sort_running()
        num_decodes = len(decode.seqs) if decode is not None else 0
        if len(seqs) == num_decodes and whole:
            return None  # the padded schedule prefills it, a decode step between its prefill steps
        if len(seqs) == num_decodes and (decode is None or self._rows_in_order(decode.seqs)):
            return decode  # no chunk fitted: decode alone, else the padded schedule
        # (a decode batch off state rows 0..n-1, which a prompt under way holds some of, goes packed too)
        return Step("packed", seqs, counts, num_decodes=num_decodes)

    def _packed_upto(self, seq: Sequence, n: int) -> int:
        """Cached tokens to hold blocks for before a packed step feeds ``n`` tokens of ``seq``: that chunk's end, or
        with state rows the whole prompt (``_prefill_upto``): a prompt under way never waits for blocks."""
        return len(seq) if self.slots is not None else seq.num_cached + n

    def _rows_in_order(self, seqs: list[Sequence]) -> bool:
        """Do these sequences hold state rows 0..n-1 in order (what a plain decode step reads), or are there none?"""
        return self.slots is None or [s.state_slot for s in seqs] == list(range(len(seqs)))

    def _admit(self, seq: Sequence, n: int, seqs: list[Sequence], counts: list[int]) -> None:
        """The head of the queue starts running, feeding ``n`` tokens in the step being built."""
        self.waiting.popleft()
        seq.status = Status.RUNNING
        self.running.append(seq)
        seqs.append(seq)
        counts.append(n)

    def _schedule_continue(self, partial: list[Sequence]) -> Step | None:
        """The next chunks of prompts under way, each continuing from what its cache holds: the first, and with it
        those at the same point of their prompts (as many tokens cached) whose chunks have its length, within the
        step's budget: rows of one layout, no padding (a state layer's recurrence would run over padding from a
        state that is not zero)."""
        first = partial[0]
        n = self._chunk(first)
        while not self._reserve(first, self._prefill_upto(first)):
            # the cache is full: the most recently admitted sequence is preempted, as a decode step does (prompts
            # under way could otherwise each hold the blocks another needs); when that is ``first``, decodes go next
            victim = self.running[-1]
            self.preempt(victim)
            if victim is first:
                return None
        group = [first]
        if first.request_id in self.alone:
            if n == first.num_uncached:
                self.alone.discard(first.request_id)
            return Step("prefill", group, [n])
        for seq in partial[1:]:
            if len(group) >= self.max_prefill_seqs or n * (len(group) + 1) > self.max_num_batched_tokens:
                break
            if seq.request_id in self.alone or seq.num_cached != first.num_cached or self._chunk(seq) != n:
                continue
            if not self._reserve(seq, self._prefill_upto(seq)):
                break
            group.append(seq)
        return Step("prefill", group, [n] * len(group))

    def _schedule_decode(self) -> Step | None:
        batch = [s for s in self.running if s.num_uncached == 1]
        for seq in list(batch):
            while seq.status is Status.RUNNING and not self._reserve(seq, len(seq)):
                victim = self.running[-1]  # the most recently admitted (possibly seq itself)
                self.preempt(victim)
                if victim in batch:
                    batch.remove(victim)
        batch = [s for s in batch if s.status is Status.RUNNING]
        if not batch:
            return None
        return Step("decode", batch, [1] * len(batch))

    def _prefill_upto(self, seq: Sequence) -> int:
        """Cached tokens to hold blocks for before ``seq``'s next prefill chunk: that chunk's end, or with SSM state
        rows the whole prompt, reserved when the sequence starts (a half-prefilled sequence holds a state row
        that a decode step, reading rows 0..n-1, cannot skip: it must never wait for blocks between chunks)."""
        return len(seq) if self.slots is not None else seq.num_cached + self._chunk(seq)

    def _chunk(self, seq: Sequence) -> int:
        """Tokens of ``seq`` its next prefill step feeds."""
        return min(seq.num_uncached, self.max_prefill_tokens) if self.chunked_prefill else seq.num_uncached

    def _fits(self, seq: Sequence, num_tokens: int) -> bool:
        """Would ``_reserve(seq, num_tokens)`` succeed now? (allocates nothing)"""
        if self.slots is not None and seq.state_slot is None and not self.slots.can_allocate():
            return False
        return self.blocks is None or self.blocks.can_allocate(
            max(0, self.blocks.blocks_for(num_tokens) - len(seq.blocks)))

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` cached tokens, and a state row; False when the cache is full."""
        if self.slots is not None and seq.state_slot is None:
            if not self.slots.can_allocate():
                return False
        if self.blocks is not None:
            need = self.blocks.blocks_for(num_tokens) - len(seq.blocks)
            if need > 0:
                if not self.blocks.can_allocate(need):
                    return False
                seq.blocks += self.blocks.allocate(need)
        if self.slots is not None and seq.state_slot is None:
            seq.state_slot = self.slots.allocate(seq)
        return True

    def _sort_running(self) -> None:
        if self.slots is not None:  # decode batches follow state rows (the model sees a prefix view)
            self.running.sort(key=lambda s: s.state_slot)

    # ------------------------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        if self.blocks is not None and seq.blocks:
            self.blocks.free(seq.blocks)
        seq.blocks = []
        if self.slots is not None and seq.state_slot is not None:
            move = self.slots.free(seq.state_slot)
            if move is not None:
                src, dst, moved = move
                moved.state_slot = dst
                self._moves.append((src, dst))
        seq.state_slot = None
        if seq in self.running:
            self.running.remove(seq)
        self._sort_running()

    def return_moves(self, moves: list[tuple[int, int]]) -> None:
        """State-row moves of a step that did not apply them: they go first in the next step."""
        self._moves[:0] = moves

    def preempt(self, seq: Sequence) -> None:
        if seq.status is not Status.RUNNING:
            raise ValueError(f"request {seq.request_id} is {seq.status.value}: only running sequences are preempted")
        self._release(seq)
        seq.num_cached = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def retry_alone(self, seqs: list[Sequence]) -> None:
        """The sequences of a prefill of several that failed: back to the head of the queue in their order, their
        blocks freed, each to prefill in a step of its own (so that one request's fault fails that request only)."""
        for seq in reversed(seqs):
            if seq.status is Status.RUNNING:
                self._release(seq)
                seq.num_cached = 0
                seq.status = Status.WAITING
                self.waiting.appendleft(seq)
                self.alone.add(seq.request_id)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (running or waiting) for ``reason``: its blocks and state row are free at once."""
        if seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        self.alone.discard(seq.request_id)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
