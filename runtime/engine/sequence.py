"""Requests as the engine tracks them: sampling parameters, token lists, cache bookkeeping, outputs."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; seed makes sampling repeatable."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


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
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    preemptions: int = 0


@dataclass
class TokenEvent:
    """One generated token, as the streaming iterator yields it."""
    request_id: int
    token_id: int
    finished: bool
    finish_reason: str | None = None
