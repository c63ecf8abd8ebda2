"""C15: log-prob semantics (docs/logprob-semantics.md). Requests that truncate the sampled distribution
(top-k, top-p, min-p) in each log-prob mode: "processed", the log-prob under the distribution the token
was sampled from (temperature, truncation, renormalised), and "raw", log_softmax of the logits at
temperature 1. Per mode, each side's log-probs read as that mode against the fp64 oracle (which applies
the same truncation to its own logits), and not as another reading (raw, or tempered but untruncated),
which is named when they do: a mode mismatch; then rollout = trainer bit for bit. Every sampled token
lies in the kept set; seeded draws follow the oracle's truncated distribution (C0's sampling test on the
truncated distribution); truncated sampling stays batch-invariant."""

import dataclasses

import pytest
import torch

from logdiff.api import LOGPROB_MODES, Processing, Request, TrainerInputs
from logdiff.oracle import mode_mismatch, readings_of, sampling_fit

from .bitwise import PropertyViolation
from .runs import rollout
from .workloads import WORKLOADS, all_at_once

TEMPERATURE = 0.8
TRUNCATIONS = {
    "top-k": Processing(top_k=20),
    "top-p": Processing(top_p=0.9),
    "min-p": Processing(min_p=0.1),
    "top-k-top-p-min-p": Processing(top_k=50, top_p=0.9, min_p=0.05),
}
# fp32, where the readings lie far apart next to the fidelity bound (1e-4)
SEMANTICS_BASE = dataclasses.replace(WORKLOADS["sampled"], temperature=TEMPERATURE)
SAMPLING_PROMPTS, SAMPLING_TOKENS = 32, 32  # 1024 seeded draws, as C0's sampling test


def truncated_workload(truncation: str, mode: str):
    p = TRUNCATIONS[truncation]
    return dataclasses.replace(SEMANTICS_BASE, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, logprobs_mode=mode)


def assert_reads_as_its_mode(side: str, logprobs, scored: TrainerInputs, oracle, dtype) -> None:
    """`side`'s log-probs within the dtype's max bound of the oracle's reading in the requested mode; if not,
    the message names the reading they do fit (logdiff.oracle.mode_mismatch)."""
    __tracebackhide__ = True
    meanings = readings_of(scored.processing[0])
    scores = oracle.readings(scored.sequences, scored.score_from, scored.temperatures,
                             {name: [p] * len(scored.sequences) for name, p in meanings.items()})
    problem = mode_mismatch(side, logprobs, scores, dtype)
    if problem:
        raise PropertyViolation(problem)


@pytest.mark.parametrize("mode", LOGPROB_MODES)
@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
def test_c15_rollout_matches_trainer_in_each_mode(stack_for, trainer_for, oracle_for, bitwise, truncation, mode):
    w = truncated_workload(truncation, mode)
    requests = w.requests()
    outputs = rollout(stack_for(w), requests)
    scored = TrainerInputs.after(requests, outputs)
    trainer = scored.score(trainer_for(w))
    oracle = oracle_for(w)
    assert_reads_as_its_mode("rollout", [o.logprobs for o in outputs], scored, oracle, w.torch_dtype)
    assert_reads_as_its_mode("trainer", trainer, scored, oracle, w.torch_dtype)
    bitwise.logprobs([o.logprobs for o in outputs], trainer, ("rollout", "trainer"))


@pytest.mark.parametrize("mode", LOGPROB_MODES)
@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
def test_c15_sampled_tokens_lie_in_the_kept_set(stack_for, oracle_for, truncation, mode):
    w = truncated_workload(truncation, mode)
    requests = w.requests()
    outputs = rollout(stack_for(w), requests)
    scored = TrainerInputs.after(requests, outputs)
    dropped = oracle_for(w).score(scored.sequences, scored.score_from, scored.temperatures, scored.processing).dropped
    for s, (out, clear) in enumerate(zip(outputs, dropped)):
        if clear.any():
            p = int(clear.nonzero()[0])
            raise PropertyViolation(
                f"C15: sampled token {out.tokens[p]} at seq {s} pos {p} lies outside the kept set of "
                f"{requests[s].processing.truncation()} at temperature {w.temperature} (by more than the fidelity bound): "
                "the engine did not sample from the truncated distribution")


@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
def test_c15_sampling_follows_the_truncated_distribution(stack_for, oracle_for, bitwise, truncation):
    w = truncated_workload(truncation, "processed")
    p = TRUNCATIONS[truncation]
    gen = torch.Generator().manual_seed(5)
    vocab = w.spec.config().vocab_size
    requests = [Request(tuple(torch.randint(vocab, (8,), generator=gen).tolist()), SAMPLING_TOKENS, TEMPERATURE,
                        seed=2000 + i, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p) for i in range(SAMPLING_PROMPTS)]
    outputs = rollout(stack_for(w), requests)
    scored = TrainerInputs.after(requests, outputs)
    rows = oracle_for(w).distributions(scored.sequences, scored.score_from, scored.temperatures, scored.processing)
    bitwise.sampling(sampling_fit([o.tokens for o in outputs], rows), TEMPERATURE, p.truncation())


@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
def test_c15_truncated_sampling_batch_invariant(stack_for, bitwise, truncation):
    w = truncated_workload(truncation, "processed")
    stack = stack_for(w)
    requests = all_at_once(w.requests())
    batch = rollout(stack, requests)
    bitwise.rollouts(batch, [rollout(stack, [r])[0] for r in requests], ("in the batch", "alone"))
    bitwise.rollouts(batch, rollout(stack, requests[::-1])[::-1], ("in the batch", "in the reversed batch"))
