"""Runs a workload through a stack: rollout, then trainer recompute of the same tokens, then compare."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from logdiff.api import EngineOptions, RolloutOutput, Stack, TrainerInputs
from logdiff.metrics import Comparison, compare
from logdiff.workload import Workload


@dataclass
class StackRun:
    stack: str
    scored: TrainerInputs  # prompt + response of every request, as the trainer scored them
    rollout: list[RolloutOutput]
    trainer: list[torch.Tensor]
    comparison: Comparison
    seconds: float


def engine_options(workload: Workload) -> EngineOptions:
    return EngineOptions(page_size=workload.block_size, prefill_chunk=workload.prefill_chunk)


def run_stack(stack: Stack, workload: Workload) -> StackRun:
    requests = workload.requests()
    start = time.perf_counter()
    rollout = stack.rollout(requests, engine_options(workload))
    scored = TrainerInputs.after(requests, rollout)
    trainer = stack.trainer_logprobs(scored.sequences, scored.score_from, scored.temperatures)
    seconds = time.perf_counter() - start
    comparison = compare([o.logprobs for o in rollout], trainer)
    return StackRun(stack.name, scored, rollout, trainer, comparison, seconds)
