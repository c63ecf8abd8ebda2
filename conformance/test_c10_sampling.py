"""C10: sampling. The rollout and the trainer apply the temperature identically (and it does change the
log-probs), and seeded sampling is batch-invariant: a request draws the same tokens alone or in any
batch position, and other seeds draw other tokens."""

import dataclasses

import pytest

from .bitwise import PropertyViolation
from .runs import assert_rollout_matches_trainer, rollout
from .workloads import WORKLOADS, all_at_once, scored_sequences


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_c10_temperature_applied_identically(stack_for, trainer_for, bitwise, temperature):
    w = dataclasses.replace(WORKLOADS["sampled"], temperature=temperature)
    stack = stack_for(w)
    assert_rollout_matches_trainer(stack, trainer_for(w), w, bitwise)
    if temperature != 1.0:
        sequences, score_from, _ = scored_sequences(w)
        at_t = stack.trainer_logprobs(sequences, score_from, [temperature] * len(sequences))
        at_1 = stack.trainer_logprobs(sequences, score_from, [1.0] * len(sequences))
        if all(a.equal(b) for a, b in zip(at_t, at_1)):
            raise PropertyViolation(f"trainer log-probs at temperature {temperature} equal those at 1.0: temperature is ignored")


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_c10_seeded_sampling_batch_invariant(stack_for, bitwise, temperature):
    w = dataclasses.replace(WORKLOADS["sampled"], temperature=temperature)
    stack = stack_for(w)
    requests = all_at_once(w.requests())
    batch = rollout(stack, requests)
    bitwise.rollouts(batch, [rollout(stack, [r])[0] for r in requests], ("in the batch", "alone"))
    bitwise.rollouts(batch, rollout(stack, requests[::-1])[::-1], ("in the batch", "in the reversed batch"))
    reseeded = rollout(stack, [dataclasses.replace(r, seed=r.seed + 7919) for r in requests])
    if all(a.tokens == b.tokens for a, b in zip(batch, reseeded)):
        raise PropertyViolation("other sampling seeds drew exactly the same tokens: the seed is ignored or nothing is sampled")
