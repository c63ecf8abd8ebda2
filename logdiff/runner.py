"""Runs a workload through a stack: rollout, then trainer recompute of the same tokens, then compare."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from logdiff.engine import RolloutOutput
from logdiff.metrics import Comparison, compare
from logdiff.stacks import EngineOptions, Stack
from logdiff.workload import Workload


@dataclass
class StackRun:
    stack: str
    prompts: list[tuple[int, ...]]
    rollout: list[RolloutOutput]
    trainer: list[torch.Tensor]
    comparison: Comparison
    seconds: float

    @property
    def sequences(self) -> list[list[int]]:
        return [list(p) + o.tokens for p, o in zip(self.prompts, self.rollout)]


def engine_options(workload: Workload) -> EngineOptions:
    return EngineOptions(page_size=workload.block_size, prefill_chunk=workload.prefill_chunk)


def run_stack(stack: Stack, workload: Workload) -> StackRun:
    requests = workload.requests()
    start = time.perf_counter()
    rollout = stack.rollout(requests, engine_options(workload))
    sequences = [list(r.prompt) + o.tokens for r, o in zip(requests, rollout)]
    trainer = stack.trainer_logprobs(sequences, [len(r.prompt) for r in requests], [r.temperature for r in requests])
    seconds = time.perf_counter() - start
    comparison = compare([o.logprobs for o in rollout], trainer)
    return StackRun(stack.name, [r.prompt for r in requests], rollout, trainer, comparison, seconds)
