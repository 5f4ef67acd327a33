"""The engine under bad input and faults: every argument checked by name, a batch checked whole before anything is
queued, abort, streams left early, steps that raise, interrupts; afterwards no request is left queued or holding cache
blocks or state rows, and the engine serves the next call. Tests that could hang run under a deadline."""
import functools
import math
import signal
import threading

import pytest
import torch

from runtime import zoo
from runtime.engine import Engine, SamplingParams
from runtime.engine.sequence import Status

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 29)), [40, 41, 42]]
POISON = 250  # a prompt holding this token makes the model raise (``poison``)


def within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, failing after ``seconds``: a regression that hangs fails instead of stalling CI. On the
    main thread an alarm interrupts the call itself; elsewhere the call runs in a thread that is waited for."""
    def timeout(*_):
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} still running after {seconds}s: it hangs")
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        old = signal.signal(signal.SIGALRM, timeout)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            box["error"] = e
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        timeout()
    if "error" in box:
        raise box["error"]
    return box["value"]


def assert_idle(engine: Engine) -> None:
    """Nothing queued, running or launched ahead; every cache block and state row free."""
    sched = engine.scheduler
    assert not engine.has_unfinished() and not sched.waiting and not sched.running
    if engine.blocks is not None:
        assert engine.blocks.num_free == engine.blocks.num_blocks - 1
    if engine.slots is not None:
        assert engine.slots.num_used == 0


def poison(engine: Engine, when=lambda ids: POISON in ids.view(-1).tolist(), error=RuntimeError("poisoned step")):
    """Make the model raise ``error`` on the steps whose input ids [B, T] satisfy ``when``."""
    real = engine.runner.forward

    def forward(ids, **kwargs):
        if when(ids):
            raise error
        return real(ids, **kwargs)
    engine.runner.forward = forward


def nth(n: int, cond=lambda *args: True):
    """A predicate true on exactly the ``n``-th call whose arguments satisfy ``cond``."""
    count = [0]

    def when(*args):
        if not cond(*args):
            return False
        count[0] += 1
        return count[0] == n
    return when


def drain(engine: Engine, until=None) -> None:
    """Step until nothing is left (or ``until()``), under a deadline."""
    def run():
        while engine.has_unfinished() and not (until and until()):
            engine.step()
    within(60, run)


@functools.lru_cache(maxsize=None)
def _plain(name: str) -> Engine:
    return Engine(zoo.build(name), compile=None)


def reference(name: str, prompts, params) -> list:
    """Tokens of ``prompts`` on an engine nothing else touches."""
    return [o.token_ids for o in _plain(name).generate(prompts, params)]


# -- arguments --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_num_seqs=0), ValueError, "max_num_seqs must be >= 1, got 0"),
    (dict(block_size=0), ValueError, "block_size must be >= 1, got 0"),
    (dict(block_size=4.0), TypeError, "block_size must be an integer, got 4.0"),
    (dict(max_prefill_tokens=-3), ValueError, "max_prefill_tokens must be >= 1"),
    (dict(cache_memory="1G"), TypeError, "cache_memory must be an integer, got '1G'"),
    (dict(cache_memory=0), ValueError, "cache_memory must be >= 1"),
    (dict(compile="fast"), ValueError, "compile must be one of 'auto'.*got 'fast'"),
    (dict(compile="hybrid-cudagraphs"), ValueError, "records CUDA graphs and needs the model on a CUDA device"),
    (dict(overlap="yes"), TypeError, "overlap must be True or False"),
    (dict(bucket_decode=1), TypeError, r"bucket_decode must be True or False \(or None\)"),
    (dict(compile_options=["moe"]), TypeError, "compile_options must be a dict"),
    (dict(compile="hybrid-eager", compile_options={"fuse_everything": True}), ValueError,
     "compile_options: unknown hybrid option 'fuse_everything'"),
])
def test_engine_options_are_checked_by_name(kwargs, error, match):
    model = zoo.build("llama")
    with pytest.raises(error, match=match):
        within(30, Engine, model, **kwargs)


def test_engine_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="model must be a Hugging Face causal LM.*got str.*Engine.from_pretrained"):
        Engine("llama")
    with pytest.raises(TypeError, match="unknown option 'max_seqs'"):
        Engine.from_pretrained("llama", max_seqs=4)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        Engine.from_pretrained("llama", dtype="bf16")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_tokens="8"), TypeError, r"max_tokens must be an integer, got '8' \(str\)"),
    (dict(max_tokens=0), ValueError, "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=True), TypeError, "max_tokens must be an integer"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0.0, got nan"),
    (dict(temperature=math.inf), ValueError, "temperature must be a finite number"),
    (dict(temperature=-1), ValueError, "temperature must be a finite number >= 0.0, got -1.0"),
    (dict(temperature=1e-30), ValueError, r"temperature must be 0 \(greedy\) or at least 1e-06"),
    (dict(temperature="hot"), TypeError, "temperature must be a number"),
    (dict(top_k=-1), ValueError, "top_k must be >= 0"),
    (dict(top_k=2.5), TypeError, "top_k must be an integer"),
    (dict(top_p=0.0), ValueError, r"top_p must be a finite number in \(0.0, 1.0\], got 0.0"),
    (dict(top_p=float("nan")), ValueError, "top_p must be a finite number"),
    (dict(top_p=1.5), ValueError, "top_p must be a finite number in"),
    (dict(seed=-1), ValueError, r"seed must be in \[0, 18446744073709551615\]"),
    (dict(seed=2 ** 64), ValueError, "seed must be in"),
    (dict(seed="7"), TypeError, "seed must be an integer"),
    (dict(stop_token_ids=3), TypeError, "stop_token_ids must be a list of token ids, got int"),
    (dict(stop_token_ids=[1.5]), TypeError, "stop_token_ids must hold integer token ids, got 1.5"),
    (dict(stop_token_ids=[-2]), ValueError, "stop_token_ids must be >= 0"),
    (dict(ignore_eos="no"), TypeError, "ignore_eos must be True or False"),
])
def test_sampling_params_are_checked_by_name(kwargs, error, match):
    with pytest.raises(error, match="SamplingParams: " + match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_what_they_accept():
    p = SamplingParams(max_tokens=torch.tensor(3).item(), temperature=1, stop_token_ids=[4, 5], seed=0)
    assert p.temperature == 1.0 and isinstance(p.temperature, float) and p.stop_token_ids == (4, 5)
    assert SamplingParams(stop_token_ids=torch.tensor([7])).stop_token_ids == (7,)


def test_prompt_batches_as_tensors_and_lists():
    engine = Engine(zoo.build("llama"), compile=None)
    params = SamplingParams(max_tokens=3)
    want = [o.token_ids for o in engine.generate([[5, 6], [7, 8]], params)]
    assert [o.token_ids for o in engine.generate(torch.tensor([[5, 6], [7, 8]]), params)] == want
    assert [o.token_ids for o in engine.generate([torch.tensor([5, 6]), (7, 8)], params)] == want
    assert [o.token_ids for o in engine.generate(torch.tensor([5, 6]), params)] == want[:1]
    assert engine.generate([], params) == []
    for prompts, error, match in [
        (torch.zeros(1, 2, 2, dtype=torch.long), ValueError, r"must be 1-D \(one prompt\) or 2-D.*shape \(1, 2, 2\)"),
        (torch.tensor([[5.0, 6.0]]), TypeError, "prompt must hold integer token ids, got a torch.float32 tensor"),
        ([[5, 6], [7, 8.0]], TypeError, r"prompt 1 must hold integer token ids, got 8.0 \(float\)"),
        ([True, 5], TypeError, r"prompt must hold integer token ids, got True \(bool\)"),
        ([[5, 6], [True, 5]], TypeError, r"prompt 1 must hold integer token ids, got True \(bool\)"),
        (5, TypeError, "prompts must be a string, a list of token ids or a list of prompts, got int"),
        ([[5, 6], [[7]]], TypeError, r"prompt 1 must hold integer token ids, got \[7\]"),
    ]:
        with pytest.raises(error, match=match):
            engine.generate(prompts, params)
    assert_idle(engine)


def test_a_batch_is_checked_whole_before_anything_is_queued():
    """One bad prompt (or a params list of the wrong length) refuses the whole batch: nothing stays queued, so the
    next call computes only its own requests and its caller gets only their events."""
    engine = Engine(zoo.build("llama"), compile=None)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="got 2 prompts and 1 SamplingParams: give one SamplingParams for all"):
        engine.generate([[5, 6], [7, 8]], [params])
    with pytest.raises(ValueError, match=r"prompt 1: token ids \[300\] are outside the vocabulary"):
        engine.generate([[5, 6], [7, 300], [9, 10]], params)
    with pytest.raises(ValueError, match="prompt 2: empty prompt"):
        list(engine.stream([[5, 6], [7], []], params))
    with pytest.raises(ValueError, match=r"prompt 0: stop_token_ids \[999\] are outside the vocabulary"):
        engine.generate([[5, 6], [7]], [SamplingParams(stop_token_ids=[999]), params])
    with pytest.raises(TypeError, match="prompt 1: params must be a SamplingParams, got dict"):
        engine.generate([[5, 6], [7]], [params, {"max_tokens": 3}])
    assert_idle(engine)
    steps = engine.stats["steps"]
    events = list(within(60, lambda: list(engine.stream([[11, 12]], params))))
    assert {e.request_id for e in events} == {events[0].request_id} and engine.stats["steps"] - steps == 4


def test_stream_checks_at_the_call_and_queues_when_iterated():
    engine = Engine(zoo.build("llama"), compile=None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.stream([[5, 300]])
    gen = engine.stream([[5, 6]], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()  # not iterated: nothing queued
    assert len(list(gen)) == 2
    assert_idle(engine)


# -- abort and streams left early -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "mamba2"])
def test_leaving_a_stream_early_aborts_its_requests(name):
    engine = Engine(zoo.build(name), compile=None)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    gen = engine.stream(PROMPTS[:2], params)
    seen = []
    for event in gen:
        seen.append(event)
        if len(seen) == 5:
            break
    gen.close()
    assert_idle(engine)
    rids = sorted({e.request_id for e in seen})
    for rid in rids:  # the consumer saw a prefix of what each had (a step's other events were not taken)
        out, mine = engine.output(rid), [e.token_id for e in seen if e.request_id == rid]
        assert out.finish_reason == "abort" and out.token_ids[:len(mine)] == mine and len(out.token_ids) < 30
    # the next call decodes its own request only, and it is what it is alone
    steps = engine.stats["steps"]
    out = within(60, engine.generate, [PROMPTS[2]], SamplingParams(max_tokens=4))
    assert engine.stats["steps"] - steps <= 4
    assert out[0].token_ids == reference(name, [PROMPTS[2]], SamplingParams(max_tokens=4))[0]


@pytest.mark.parametrize("name", ["llama", "mamba2", "bamba"])
def test_abort_waiting_running_and_finished_requests(name):
    engine = Engine(zoo.build(name), compile=None, max_num_seqs=2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    for _ in range(4):  # two running (prefilled, decoding), one waiting for a slot
        engine.step()
    waiting = [r for r in ids if engine._seqs[r].status is Status.WAITING]
    assert waiting == [ids[2]]
    assert engine.abort(ids[2]) and engine.abort(ids[0])
    assert engine.output(ids[0]).finish_reason == "abort" and engine.output(ids[2]).token_ids == []
    drain(engine)
    assert engine.output(ids[1]).token_ids == reference(name, [PROMPTS[1]], params)[0]
    assert engine.abort(ids[1]) is False  # finished already
    with pytest.raises(KeyError, match="no request 123456 in this engine"):
        engine.abort(123456)
    with pytest.raises(TypeError, match="request_id must be an int"):
        engine.abort("x")
    assert_idle(engine)


def test_abort_while_a_step_runs_ahead():
    """Greedy decode steps run ahead (overlap): aborting a sequence the launched step holds drops its token, and
    the others' tokens stay exactly the serial engine's."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = reference("llama", PROMPTS, params)
    engine = Engine(zoo.build("llama"), compile=None)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    drain(engine, until=lambda: engine._ahead is not None)
    assert engine._seqs[ids[1]] in engine._ahead[0].seqs
    kept = len(engine.output(ids[1]).token_ids)
    engine.abort(ids[1])
    drain(engine)
    assert engine.output(ids[1]).token_ids == want[1][:kept]
    assert [engine.output(r).token_ids for r in (ids[0], ids[2])] == [want[0], want[2]]
    assert_idle(engine)


def test_a_stream_reports_a_request_aborted_while_it_runs():
    engine = Engine(zoo.build("llama"), compile=None)
    events = []
    for event in engine.stream(PROMPTS[:2], SamplingParams(max_tokens=10, ignore_eos=True)):
        events.append(event)
        if len(events) == 3:
            engine.abort(event.request_id)
    last = {}
    for e in events:
        last[e.request_id] = e
    assert sum(e.finished for e in events) == 2
    aborted = last[events[2].request_id]
    assert (aborted.token_id, aborted.finish_reason) == (None, "abort")
    assert_idle(engine)


@pytest.mark.parametrize("name", ["llama", "mamba2"])
def test_open_streams_and_a_generate_inside_one_each_get_all_their_tokens(name):
    """Whichever call steps the engine runs every request: two streams read in turn and a generate called inside a
    stream loop each get every token of their own requests, equal to running them alone."""
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    want = reference(name, PROMPTS, params)
    engine = Engine(zoo.build(name), compile=None)
    first, second = engine.stream([PROMPTS[0]], params), engine.stream([PROMPTS[1]], params)
    got = {0: [], 1: []}

    def interleave():
        inner = None
        for a, b in zip(first, second):
            got[0].append(a)
            got[1].append(b)
            if inner is None:
                inner = engine.generate([PROMPTS[2]], params)
        return inner
    inner = within(60, interleave)
    got[0] += list(first)
    got[1] += list(second)
    for i in (0, 1):
        assert [e.token_id for e in got[i]] == want[i] and got[i][-1].finished
        assert sum(e.finished for e in got[i]) == 1
    assert inner[0].token_ids == want[2]
    assert_idle(engine)
    assert not engine._inbox


# -- steps that raise -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "mamba2", "bamba"])
def test_a_failing_step_fails_only_its_requests(name):
    """A prefill that raises fails its request (finish_reason "error", the message), frees what it held, and the
    other requests and the next call run as they would have."""
    params = SamplingParams(max_tokens=6)
    prompts = [PROMPTS[0], [3, POISON, 4], PROMPTS[2]]
    engine = Engine(zoo.build(name), compile=None)
    poison(engine)
    outs = within(60, engine.generate, prompts, params)
    assert [o.finish_reason == "error" for o in outs] == [False, True, False]
    assert outs[1].error == "RuntimeError: poisoned step" and outs[1].token_ids == []
    want = reference(name, [prompts[0], prompts[2]], params)
    assert [outs[0].token_ids, outs[2].token_ids] == want
    assert_idle(engine)
    assert [o.token_ids for o in within(60, engine.generate, [prompts[0], prompts[2]], params)] == want
    assert engine.stats["failed_steps"] == 1


@pytest.mark.parametrize("name", ["llama", "mamba2"])
def test_a_failing_decode_step_fails_its_batch_and_the_rest_goes_on(name):
    """The third decode step raises: the sequences it decoded fail with what they had; a request queued after it
    runs to the end, exactly."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine = Engine(zoo.build(name), compile=None, overlap=False)
    poison(engine, when=nth(3, lambda ids: ids.shape[1] == 1))
    first = [engine.add_request(p, params) for p in PROMPTS[:2]]
    events = within(60, lambda: [e for _ in range(40) for e in engine.step()])
    errors = [e for e in events if e.finish_reason == "error"]
    assert sorted(e.request_id for e in errors) == first and all(e.token_id is None for e in errors)
    assert all(len(engine.output(r).token_ids) == 3 for r in first)  # prefill token + two decode steps
    assert_idle(engine)
    out = within(60, engine.generate, [PROMPTS[2]], params)[0]
    assert out.token_ids == reference(name, [PROMPTS[2]], params)[0]


def test_a_failure_while_a_step_runs_ahead():
    """Reading step n raises after step n + 1 was launched ahead: both are dropped, their sequences fail, the
    engine goes on."""
    engine = Engine(zoo.build("llama"), compile=None)
    real, calls, first = engine.runner.finish, [], nth(1, lambda: engine._ahead is not None)

    def finish(pending):
        if first():
            calls.append(1)
            raise RuntimeError("device lost")
        return real(pending)
    engine.runner.finish = finish
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = within(60, engine.generate, PROMPTS, params)
    assert calls and all(o.finish_reason in ("error", "length") for o in outs)
    assert any(o.error == "RuntimeError: device lost" for o in outs)
    assert_idle(engine)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == reference("llama", PROMPTS, params)


def test_a_stream_gets_an_error_event():
    engine = Engine(zoo.build("llama"), compile=None)
    poison(engine)
    events = within(60, lambda: list(engine.stream([PROMPTS[0], [POISON]], SamplingParams(max_tokens=3))))
    finals = [e for e in events if e.finished]
    assert len(finals) == 2
    err = next(e for e in finals if e.finish_reason == "error")
    assert err.token_id is None and err.error == "RuntimeError: poisoned step"


def test_a_stalled_engine_fails_its_requests_instead_of_spinning():
    """Bookkeeping that leaves nothing schedulable (here: blocks taken behind the scheduler's back) ends the
    requests with an error that says so; it never spins."""
    engine = Engine(zoo.build("llama"), compile=None, block_size=4, cache_memory=8 * 4 * 2 * 2 * 2 * 16 * 4)
    stolen = engine.blocks.allocate(engine.blocks.num_free)
    out = within(30, engine.generate, [[5, 6, 7]], SamplingParams(max_tokens=4))[0]
    assert out.finish_reason == "error"
    assert "the engine stalled (1 waiting, 0 running, 0 of 7 blocks free, nothing schedulable)" in out.error
    engine.blocks.free(stolen)
    assert within(30, engine.generate, [[5, 6, 7]], SamplingParams(max_tokens=4))[0].finish_reason == "length"


# -- interrupts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["forward", "finish"])
@pytest.mark.parametrize("name", ["llama", "mamba2"])
def test_an_interrupt_aborts_the_call_and_keeps_the_rest(name, where):
    """Ctrl-C during generate: its requests are aborted; a request queued by someone else is recomputed and ends as
    it would have; the next call runs normally."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine = Engine(zoo.build(name), compile=None)
    other = engine.add_request(PROMPTS[1], params)
    engine.step()
    third = nth(3)
    if where == "forward":
        poison(engine, when=third, error=KeyboardInterrupt())
    else:
        real = engine.runner.finish

        def finish(pending):
            if third():
                raise KeyboardInterrupt
            return real(pending)
        engine.runner.finish = finish
    with pytest.raises(KeyboardInterrupt):
        within(60, engine.generate, [PROMPTS[0], PROMPTS[2]], params)
    mine = [r for r in engine._seqs if r != other]
    assert all(engine.output(r).finish_reason == "abort" for r in mine)
    assert engine.output(other).finish_reason is None
    drain(engine)
    want = reference(name, PROMPTS, params)
    assert engine.output(other).token_ids == want[1]
    assert_idle(engine)
    assert [o.token_ids for o in within(60, engine.generate, PROMPTS, params)] == want
