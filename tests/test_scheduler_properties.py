"""Property-based test of the scheduler and the allocators (hypothesis): any sequence of add / step / abort / preempt
(and the reservations of a step launched ahead), with padded or packed steps, keeps the bookkeeping whole. No block
is owned twice, never block 0; free + owned blocks = all of them; every running sequence holds the blocks of its cached tokens and a state row, the
rows stay compact (row i is the i-th running sequence's, holding its state after the queued moves); the scheduler
always has a step while work is left, and draining the queue frees everything."""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.engine.allocator import BlockAllocator, SlotAllocator
from runtime.engine.scheduler import Scheduler
from runtime.engine.sequence import SamplingParams, Sequence, Status


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 14), block_size=st.sampled_from([1, 2, 4]), max_num_seqs=st.integers(1, 4),
                max_prefill_tokens=st.integers(1, 6), kind=st.sampled_from(["attention", "ssm", "hybrid"]),
                chunked=st.booleans(), batched_tokens=st.integers(1, 16), batch_prefill=st.booleans(),
                pad_states=st.booleans(), interleave=st.booleans(), packed=st.booleans())
    def setup(self, num_blocks, block_size, max_num_seqs, max_prefill_tokens, kind, chunked, batched_tokens,
              batch_prefill, pad_states, interleave, packed):
        self.blocks = BlockAllocator(num_blocks, block_size) if kind != "ssm" else None
        self.slots = SlotAllocator(max_num_seqs) if kind != "attention" else None
        # several prompts per prefill step; with state rows of equal length unless padding is exact (the Engine's
        # construction probe decides)
        self.sched = Scheduler(self.blocks, self.slots, max_num_seqs=max_num_seqs,
                               max_prefill_tokens=max_prefill_tokens, chunked_prefill=chunked,
                               max_num_batched_tokens=batched_tokens,
                               max_prefill_seqs=max_num_seqs if batch_prefill else 1,
                               equal_lengths=kind != "attention" and not pad_states, interleave=interleave,
                               packed=packed)
        self.last_kind = None
        self.seqs: list[Sequence] = []
        self.rows: dict[int, int] = {}  # SSM state row -> request id whose state it holds (moves applied by steps)

    # -- actions ----------------------------------------------------------------------------------------------
    @rule(prompt=st.integers(1, 12), max_tokens=st.integers(1, 8))
    def add(self, prompt, max_tokens):
        seq = Sequence(list(range(3, 3 + prompt)), SamplingParams(max_tokens=max_tokens))
        try:
            self.sched.add(seq)
        except ValueError:  # refused only when it could never fit the cache alone
            assert self.blocks.blocks_for(prompt + max_tokens) > self.blocks.num_blocks - 1
            return
        self.seqs.append(seq)

    @rule()
    def step(self):
        sched = self.sched
        ready = [s for s in sched.running if s.num_uncached == 1]
        rows_ok = self.slots is None or sorted(s.state_slot for s in ready) == list(range(len(ready)))
        step = sched.schedule() or (sched.schedule() if sched.has_work() else None)  # as Engine._schedule
        assert step is not None or not sched.has_work(), "work left but nothing schedulable: the engine would spin"
        if step is not None:
            if sched.interleave and self.last_kind == "prefill" and ready and rows_ok:
                # a sequence ready to decode never waits two prefill steps (unless the cache preempted them all)
                assert step.kind in ("decode", "packed") or not any(s.status is Status.RUNNING for s in ready)
            if sched.packed and step.kind != "prefill":  # packed: every sequence ready to decode is in every step
                assert all(s in step.seqs for s in ready if s.status is Status.RUNNING)
            self._run(step)

    @rule()
    def prefill_fails(self):
        """A step that raises (Engine.step): a prefill of several goes back to the queue to run one per step."""
        step = self.sched.schedule()
        if step is not None and step.kind in ("prefill", "packed") and len(step.seqs) > 1:
            self._move(step.moves)  # Engine._launch applies them before the launch that raises
            self.sched.retry_alone(step.seqs)
            assert all(s.status is Status.WAITING and not s.blocks for s in step.seqs)
            assert list(self.sched.waiting)[:len(step.seqs)] == step.seqs
        elif step is not None:
            self._run(step)

    @precondition(lambda self: any(s.status is not Status.FINISHED for s in self.seqs))
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.status is not Status.FINISHED]))
        self.sched.finish(seq, "abort")

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.sched.preempt(data.draw(st.sampled_from(self.sched.running)))

    @precondition(lambda self: self.sched.running)
    @rule()
    def reserve_ahead(self):
        """What a decode step launched ahead reserves (Engine._repeats): one more token for each decoder."""
        for seq in list(self.sched.running):
            if seq.num_uncached == 1:
                self.sched.reserve(seq, len(seq) + 1)

    def _move(self, moves):
        """State-row moves: the row's contents go along (None: a row no finished prefill wrote, such as the rows of
        a failed prefill, freed again)."""
        for src, dst in moves:
            self.rows[dst] = self.rows.pop(src, None)

    def _run(self, step):
        """The runner's bookkeeping of a step: moves, the cache rows it writes, tokens, finishing at max_tokens."""
        self._move(step.moves)
        self.last_kind = step.kind
        if step.kind == "decode" and self.slots is not None:
            assert [s.state_slot for s in step.seqs] == list(range(len(step.seqs)))
        if step.kind == "prefill" and len(step.seqs) > 1:  # within the budget, padding at most half
            assert len(step.seqs) <= self.sched.max_prefill_seqs
            padded = max(step.num_tokens) * len(step.seqs)
            assert padded <= self.sched.max_num_batched_tokens and padded <= 2 * sum(step.num_tokens)
            cached = {s.num_cached for s in step.seqs}
            if cached != {0}:  # chunks continuing prompts: all at one point, of one length, unpadded
                assert len(cached) == 1 and len(set(step.num_tokens)) == 1
            elif self.slots is not None:  # the rows of prompts admitted together follow each other
                assert len(set(step.num_tokens)) == 1 or not self.sched.equal_lengths
                rows = [s.state_slot for s in step.seqs]
                assert rows == list(range(rows[0], rows[0] + len(rows)))
        if step.kind == "packed":  # decodes first, then chunks; unpadded tokens within the budget
            assert sum(step.num_tokens) <= self.sched.max_num_batched_tokens
            # decodes alone go packed only where their state rows are not 0..n-1 (a prompt under way holds one)
            assert len(step.seqs) > step.num_decodes or (
                self.slots is not None and [s.state_slot for s in step.seqs] != list(range(len(step.seqs))))
            assert all(s.num_uncached == 1 for s in step.seqs[:step.num_decodes])
        for seq, n in zip(step.seqs, step.num_tokens):
            assert seq.status is Status.RUNNING and n >= 1
            assert n == 1 if step.kind == "decode" else seq.num_uncached >= n
            if self.blocks is not None:  # every token the step writes has its block
                assert self.blocks.blocks_for(seq.num_cached + n) <= len(seq.blocks)
            if self.slots is not None:
                if seq.num_cached:  # continues from its own state
                    assert self.rows[seq.state_slot] == seq.request_id
                else:
                    self.rows[seq.state_slot] = seq.request_id
            seq.num_cached += n
        for seq in step.seqs:  # then the engine's postprocessing (finishing one may move another's row)
            if step.kind == "decode" or seq.num_uncached == 0:
                seq.output.append(7)
                if len(seq.output) >= seq.params.max_tokens:
                    self.sched.finish(seq, "length")

    # -- invariants -------------------------------------------------------------------------------------------
    @invariant()
    def bookkeeping(self):
        sched = self.sched
        running, waiting = list(sched.running), list(sched.waiting)
        assert len(running) == len(set(running)) and len(waiting) == len(set(waiting))
        assert not set(running) & set(waiting) and len(running) <= sched.max_num_seqs
        for seq in self.seqs:
            where = (seq in running) + (seq in waiting)
            if seq.status is Status.FINISHED:
                assert where == 0 and not seq.blocks and seq.state_slot is None
            elif seq.status is Status.WAITING:
                assert seq in waiting and where == 1 and not seq.blocks and seq.state_slot is None
                assert seq.num_cached == 0
            else:
                assert seq in running and where == 1
                if self.blocks is not None:  # it holds the blocks of its cached tokens
                    assert self.blocks.blocks_for(seq.num_cached) <= len(seq.blocks)
        if self.blocks is not None:
            owned = [b for s in self.seqs for b in s.blocks]
            free = list(self.blocks._free)
            assert len(owned) == len(set(owned)), "a block owned twice"
            assert 0 not in owned and 0 not in free and not set(owned) & set(free)
            assert len(free) == len(set(free)) and len(free) + len(owned) == self.blocks.num_blocks - 1
            assert self.blocks.num_free == len(free)
        else:
            assert not any(s.blocks for s in self.seqs)
        if self.slots is not None:
            assert set(self.slots.owners) == set(running)
            assert all(s.state_slot == i for i, s in enumerate(self.slots.owners))
            rows = dict(self.rows)  # the states after the moves the next step applies
            for src, dst in sched._moves:
                rows[dst] = rows.pop(src)
            for seq in running:
                if seq.num_cached:
                    assert rows.get(seq.state_slot) == seq.request_id, "a running sequence lost its state row"

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(10_000):  # every admitted request finishes
            if not self.sched.has_work():
                break
            self.step()
        assert not self.sched.has_work()
        if self.blocks is not None:
            assert self.blocks.num_free == self.blocks.num_blocks - 1
        if self.slots is not None:
            assert self.slots.num_used == 0


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None, database=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_scheduler_keeps_its_invariants = SchedulerMachine.TestCase
