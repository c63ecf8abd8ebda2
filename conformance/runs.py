"""The two calls most properties start from, with the Stack API contract checked on the way."""

from __future__ import annotations

from logdiff.api import EngineOptions, Request, RolloutOutput, Stack, TrainerInputs
from logdiff.runner import engine_options
from logdiff.workload import Workload

from .bitwise import check_rollout


def rollout(stack: Stack, requests: list[Request], options: EngineOptions = EngineOptions()) -> list[RolloutOutput]:
    __tracebackhide__ = True
    outputs = stack.rollout(requests, options)
    check_rollout(outputs, requests)
    return outputs


def rollout_and_sequences(stack: Stack, workload: Workload):
    """The workload's rollout, and what a trainer scores next: (outputs, sequences, score_from, temperatures)."""
    __tracebackhide__ = True
    requests = workload.requests()
    outputs = rollout(stack, requests, engine_options(workload))
    scored = TrainerInputs.after(requests, outputs)
    return outputs, scored.sequences, scored.score_from, scored.temperatures


def assert_rollout_matches_trainer(stack: Stack, trainer_stack: Stack, workload: Workload, bitwise) -> None:
    """The headline: every sampled token's rollout log-prob equals the trainer's recomputation, bit for bit.
    The trainer runs on its own instance of the stack, so it cannot answer from the rollout's memory."""
    __tracebackhide__ = True
    requests = workload.requests()
    outputs = rollout(stack, requests, engine_options(workload))
    trainer = TrainerInputs.after(requests, outputs).score(trainer_stack)
    bitwise.logprobs([o.logprobs for o in outputs], trainer, ("rollout", "trainer"))
