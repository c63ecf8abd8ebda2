"""C2: batch invariance. A sequence's log-probs (and sampled tokens) are the same whether it runs alone,
in a batch of mixed lengths, or at another position of that batch."""

import pytest

from .generated import for_each_workload
from .runs import rollout
from .workloads import WORKLOADS, all_at_once, scored_sequences, with_dtype

CASES = {
    "block-edges": WORKLOADS["block-edges"],
    "sampled": WORKLOADS["sampled"],
    "batch-20": WORKLOADS["batch-20"],
    "block-edges-fp16": with_dtype(WORKLOADS["block-edges"], "fp16"),
}


@pytest.mark.parametrize("workload", list(CASES))
@pytest.mark.parametrize("path", ["rollout", "trainer"])
def test_c2_batch_invariance(stack_for, bitwise, path, workload):
    w = CASES[workload]
    stack = stack_for(w)
    if path == "rollout":
        requests = all_at_once(w.requests())
        batch = rollout(stack, requests)
        bitwise.rollouts(batch, [rollout(stack, [r])[0] for r in requests], ("in the batch", "alone"))
        bitwise.rollouts(batch, rollout(stack, requests[::-1])[::-1], ("in the batch", "in the reversed batch"))
        return
    sequences, score_from, temperatures = scored_sequences(w)
    batch = stack.trainer_logprobs(sequences, score_from, temperatures)
    alone = [stack.trainer_logprobs([s], [f], [t])[0] for s, f, t in zip(sequences, score_from, temperatures)]
    bitwise.logprobs(batch, alone, ("in the batch", "alone"))
    reversed_batch = stack.trainer_logprobs(sequences[::-1], score_from[::-1], temperatures[::-1])[::-1]
    bitwise.logprobs(batch, reversed_batch, ("in the batch", "in the reversed batch"))


def test_c2_batch_invariance_generated(stack_for, bitwise, pytestconfig):
    def check(w):
        stack = stack_for(w)
        requests = all_at_once(w.requests())
        batch = rollout(stack, requests)
        ends = sorted({0, len(requests) - 1})
        bitwise.rollouts([batch[i] for i in ends], [rollout(stack, [requests[i]])[0] for i in ends],
                         ("in the batch", "alone"))
        bitwise.rollouts(batch, rollout(stack, requests[::-1])[::-1], ("in the batch", "in the reversed batch"))

    for_each_workload(pytestconfig, check)
