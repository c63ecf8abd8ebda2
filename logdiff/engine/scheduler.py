"""Requests and the continuous-batching scheduler.

Each engine step first admits the requests that have arrived (their prompts are prefilled, in chunks
if asked, and their first token sampled), then decodes one token for every request that was already
running. A request leaves the batch, and frees its pages, after `max_new_tokens` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from logdiff.api import Request


@dataclass
class Sequence:
    """A request inside the engine."""

    index: int
    request: Request
    table: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens whose keys are in the cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def finished(self) -> bool:
        return len(self.tokens) >= self.request.max_new_tokens


class Scheduler:
    def __init__(self, requests: list[Request]):
        self.waiting = sorted((Sequence(i, r) for i, r in enumerate(requests)), key=lambda s: (s.request.arrival, s.index))
        self.running: list[Sequence] = []
        self.done: list[Sequence] = []
        self.step = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def admit(self) -> list[Sequence]:
        """Requests that join at this step; if nothing runs, time jumps to the next arrival."""
        if not self.running and self.waiting:
            self.step = max(self.step, self.waiting[0].request.arrival)
        joining = [s for s in self.waiting if s.request.arrival <= self.step]
        self.waiting = self.waiting[len(joining) :]
        return joining

    def finish_step(self, joined: list[Sequence]) -> list[Sequence]:
        """Moves joined requests to running, retires finished ones (returned, to free their pages)."""
        self.running += joined
        finished = [s for s in self.running if s.finished]
        self.running = [s for s in self.running if not s.finished]
        self.done += finished
        self.step += 1
        return finished
