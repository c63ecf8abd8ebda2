"""Runs a workload through a stack: rollout, then the trainer's recompute of the same tokens on its own
instance of the stack, then the bitwise comparison and each side's distance from the fp64 oracle."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from logdiff.api import EngineOptions, Processing, RolloutOutput, Stack, TrainerInputs
from logdiff.metrics import Comparison, compare
from logdiff.oracle import Fidelity, Oracle, fidelity, mode_mismatch, readings_of
from logdiff.workload import Workload


@dataclass
class StackRun:
    stack: str
    scored: TrainerInputs  # prompt + response of every request, as the trainer scored them
    rollout: list[RolloutOutput]
    trainer: list[torch.Tensor]
    comparison: Comparison
    fidelity: list[Fidelity]  # rollout and trainer sides against the oracle; empty when run without one
    seconds: float
    mode_problems: list[str] = dataclasses.field(default_factory=list)  # C15: a side not in the requests' mode

    @property
    def verdict(self) -> str:
        """pass only if both paths agree bit for bit and both compute the model (C0)."""
        faithful = all(f.holds for f in self.fidelity) and not self.mode_problems
        return "pass" if self.comparison.verdict == "pass" and faithful else "fail"

    def problems(self) -> list[str]:
        """One line per reason the verdict is fail."""
        divergence = self.comparison.first_divergence
        lines = [f"C3 (rollout vs trainer): {divergence}"] if divergence else []
        return lines + self.mode_problems + [f.problem() for f in self.fidelity if not f.holds]

    def to_dict(self) -> dict:
        return {"name": self.stack, **self.comparison.to_dict(), "bitwise_verdict": self.comparison.verdict,
                "verdict": self.verdict, "fidelity": [f.to_dict() for f in self.fidelity], "mode_problems": self.mode_problems,
                "seconds": self.seconds}


def engine_options(workload: Workload) -> EngineOptions:
    return EngineOptions(page_size=workload.block_size, prefill_chunk=workload.prefill_chunk)


def run_stack(stack: Stack, workload: Workload, trainer_stack: Stack | None = None, oracle: Oracle | None = None) -> StackRun:
    """`trainer_stack`: a separately built instance for the trainer side (default: the same one)."""
    requests = workload.requests()
    start = time.perf_counter()
    rollout = stack.rollout(requests, engine_options(workload))
    scored = TrainerInputs.after(requests, rollout)
    trainer = scored.score(trainer_stack or stack)
    seconds = time.perf_counter() - start
    comparison = compare([o.logprobs for o in rollout], trainer)
    sides, mode_problems = [], []
    if oracle is not None:
        # A truncating or raw workload is scored in every reading, so a side in another mode is named as such.
        meanings = {"": scored.processing[0]} if all(p == Processing() for p in scored.processing) else (
            readings_of(scored.processing[0]))
        scores = oracle.readings(scored.sequences, scored.score_from, scored.temperatures,
                                 {name: [p] * len(requests) for name, p in meanings.items()})
        exact = next(iter(scores.values()))
        if len(scores) > 1:
            mode_problems = [line for side, values in (("rollout", [o.logprobs for o in rollout]), ("trainer", trainer))
                             if (line := mode_mismatch(side, values, scores, workload.torch_dtype))]
        sides = [
            fidelity("rollout", [o.logprobs for o in rollout], exact, workload.torch_dtype, [o.tokens for o in rollout],
                     [r.temperature == 0 for r in requests]),
            fidelity("trainer", trainer, exact, workload.torch_dtype),
        ]
    return StackRun(stack.name, scored, rollout, trainer, comparison, sides, seconds, mode_problems)
