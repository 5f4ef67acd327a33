"""Requests as the engine tracks them: sampling parameters, token lists, cache bookkeeping, outputs; the checks
of the engine's arguments (a TypeError or ValueError that names the field)."""
from __future__ import annotations

import enum
import itertools
import math
import numbers
from dataclasses import dataclass, field

import torch

#: why a request finished: EOS or a stop token, max_tokens or the model's length, ``Engine.abort`` (also a
#: stream left early, an interrupted call), a step that raised (``RequestOutput.error`` says what)
FINISH_REASONS = ("stop", "length", "abort", "error")
#: smallest temperature above 0: the sampler divides logits by it in fp32
MIN_TEMPERATURE = 1e-6


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(where: str, value, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in [lo, hi]; a TypeError or ValueError starting with ``where`` otherwise."""
    if not _is_int(value):
        raise TypeError(f"{where} must be an integer, got {value!r} ({type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{where} must be {bound}, got {value}")
    return int(value)


def check_number(where: str, value, lo: float, hi: float | None = None, *, lo_open: bool = False) -> float:
    """``value`` as a finite float in [lo, hi] ((lo, hi] with ``lo_open``); NaN and inf are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    low_ok = value > lo if lo_open else value >= lo
    if not math.isfinite(value) or not low_ok or (hi is not None and value > hi):
        left = "(" if lo_open else "["
        bound = f"{'>' if lo_open else '>='} {lo}" if hi is None else f"in {left}{lo}, {hi}]"
        raise ValueError(f"{where} must be a finite number {bound}, got {value}")
    return value


def check_bool(where: str, value, none_ok: bool = False) -> bool | None:
    if value is None and none_ok:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be True or False{' (or None)' if none_ok else ''}, got {value!r} "
                        f"({type(value).__name__})")
    return value


def token_ids(where: str, values) -> list[int]:
    """Token ids as a list of ints: a list/tuple of integers or a 1-D integer tensor (TypeError / ValueError
    naming ``where`` otherwise; the vocabulary range is the engine's check)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{where} as a tensor must be 1-D, got shape {tuple(values.shape)}")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{where} must hold integer token ids, got a {values.dtype} tensor")
        return values.tolist()
    if isinstance(values, (str, bytes, bytearray, dict, set)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{where} must be a list of token ids, got {type(values).__name__}")
    ids = list(values)
    if all(type(t) is int for t in ids):  # the common case: one type check a token, no conversion
        return ids
    for t in ids:
        if not _is_int(t):
            raise TypeError(f"{where} must hold integer token ids, got {t!r} ({type(t).__name__})")
    return [int(t) for t in ids]


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; seed makes sampling repeatable.
    Every field is checked here: a wrong type is a TypeError, a value out of range (NaN, inf) a ValueError."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        set_("max_tokens", check_int("SamplingParams: max_tokens", self.max_tokens, 1))
        temperature = check_number("SamplingParams: temperature", self.temperature, 0.0)
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"SamplingParams: temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got "
                             f"{temperature}")
        set_("temperature", temperature)
        set_("top_k", check_int("SamplingParams: top_k", self.top_k, 0))
        set_("top_p", check_number("SamplingParams: top_p", self.top_p, 0.0, 1.0, lo_open=True))
        if self.seed is not None:
            set_("seed", check_int("SamplingParams: seed", self.seed, 0, 2 ** 64 - 1))
        set_("stop_token_ids", tuple(token_ids("SamplingParams: stop_token_ids", self.stop_token_ids)))
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams: stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        check_bool("SamplingParams: ignore_eos", self.ignore_eos)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    request_id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    #: paged-cache blocks holding this sequence's tokens, in order
    blocks: list[int] = field(default_factory=list)
    #: row of the SSM state buffers while running (None: none held)
    state_slot: int | None = None
    #: tokens whose keys/values (and states) are in the cache
    num_cached: int = 0
    finish_reason: str | None = None
    #: what failed, when finish_reason is "error" ("ExceptionType: message")
    error: str | None = None
    preemptions: int = 0
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_uncached(self) -> int:
        return len(self) - self.num_cached


@dataclass
class RequestOutput:
    """A request's tokens so far; ``finish_reason`` is None while it runs, else one of ``FINISH_REASONS``.
    A failed request ("error") keeps the tokens it had and says why in ``error``."""
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    preemptions: int = 0
    error: str | None = None


@dataclass
class TokenEvent:
    """One generated token, as the streaming iterator yields it. A request's last event has ``finished`` True;
    when it ends without a token (aborted, failed) that event's ``token_id`` is None."""
    request_id: int
    token_id: int | None
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
