"""C1: run-to-run determinism of each path. The same call twice gives the same bits, on the same instance
of the stack and on two freshly built instances: the rollout (tokens and log-probs), the trainer, and the
rollout engine's prefill scoring."""

import pytest

from logdiff.runner import engine_options

from .runs import rollout
from .workloads import WORKLOADS, scored_sequences


@pytest.mark.parametrize("instances", ["same", "fresh"])
@pytest.mark.parametrize("workload", ["joins-mid-decode", "sampled"])
@pytest.mark.parametrize("path", ["rollout", "trainer", "prefill-scoring"])
def test_c1_run_to_run_determinism(stack_for, fresh_for, bitwise, path, workload, instances):
    w = WORKLOADS[workload]
    first_stack = stack_for(w)
    second_stack = first_stack if instances == "same" else fresh_for(w)
    names = ("first call", "second call") if instances == "same" else ("one instance", "a fresh instance")
    if path == "rollout":
        requests = w.requests()
        first, second = (rollout(s, requests, engine_options(w)) for s in (first_stack, second_stack))
        bitwise.rollouts(first, second, tuple(f"rollout, {n}" for n in names))
        return
    sequences, score_from, temperatures = scored_sequences(w)
    method = "trainer_logprobs" if path == "trainer" else "prompt_logprobs"
    first, second = (getattr(s, method)(sequences, score_from, temperatures) for s in (first_stack, second_stack))
    bitwise.logprobs(first, second, tuple(f"{path}, {n}" for n in names))
