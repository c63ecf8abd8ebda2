"""C1: run-to-run determinism of each path. The same call on the same stack, twice, gives the same bits:
the rollout (tokens and log-probs), the trainer, and the rollout engine's prefill scoring."""

import pytest

from logdiff.runner import engine_options

from .runs import rollout
from .workloads import WORKLOADS, scored_sequences


@pytest.mark.parametrize("workload", ["joins-mid-decode", "sampled"])
@pytest.mark.parametrize("path", ["rollout", "trainer", "prefill-scoring"])
def test_c1_run_to_run_determinism(stack_for, bitwise, path, workload):
    w = WORKLOADS[workload]
    stack = stack_for(w)
    if path == "rollout":
        requests = w.requests()
        first, second = (rollout(stack, requests, engine_options(w)) for _ in range(2))
        bitwise.rollouts(first, second, ("first rollout", "second rollout"))
        return
    sequences, score_from, temperatures = scored_sequences(w)
    score = stack.trainer_logprobs if path == "trainer" else stack.prompt_logprobs
    first, second = (score(sequences, score_from, temperatures) for _ in range(2))
    bitwise.logprobs(first, second, (f"first {path}", f"second {path}"))
