"""C0: the stack runs the model. Two paths that agree bit for bit prove nothing if neither computes the
model, so every side's log-probs are scored against an fp64 oracle of the same weights: the rollout's,
the trainer's (on its own instance of the stack) and, where offered, the engine's prefill scoring, on
greedy workloads and on sampled ones at temperatures 0.3, 0.7, 1 and 1.5 (scored at the request's own
temperature, so log-probs recorded at another one fail), in fp32, bf16 and fp16, at contexts past 2048.
Per side, the median of |logp - logp_fp64| over the tokens, the size of the median of logp - logp_fp64 (a wrong
model moves log-probs one way, rounding either way), and the 90th percentile and largest |logp - logp_fp64| over the
tokens whose expert choice is clear of a routing tie, stay within the dtype's bounds (logdiff.oracle.FIDELITY_BOUNDS, with
the measurement of honest and wrong models they come from); greedy tokens are the oracle's argmax wherever
its top-2 margin is clear; seeded sampling draws from the oracle's tempered distribution (a
log-likelihood z-test and a PIT chi-square, alpha 1e-3)."""

import dataclasses

import pytest
import torch

from logdiff.api import Request, TrainerInputs, Unsupported
from logdiff.oracle import fidelity, sampling_fit

from .runs import rollout_and_sequences
from .workloads import WORKLOADS, with_dtype

CASES = {name: WORKLOADS[name] for name in ("block-edges", "sampled", "long-decode", "dense", "batch-20", "long-context")} | {
    f"block-edges-sampled-{dtype}": with_dtype(WORKLOADS["block-edges-sampled"], dtype) for dtype in ("bf16", "fp16")
} | {  # the dtypes RL trains in: a model consistently wrong on both paths fails here, not only in fp32
    f"{name}-{dtype}": with_dtype(WORKLOADS[name], dtype)
    for name in ("long-decode", "long-context") for dtype in ("bf16", "fp16")
} | {  # recorded log-probs against the oracle's at the request's own temperature, not only at 0 and 1
    f"sampled-T{t}": dataclasses.replace(WORKLOADS["sampled"], temperature=t) for t in (0.3, 0.7, 1.5)
}

SAMPLING_PROMPTS, SAMPLING_TOKENS = 32, 32  # 1024 seeded draws: a cheat's expected |z| is 7 to 130 (see README)


@pytest.mark.parametrize("workload", list(CASES))
def test_c0_runs_the_model(stack_for, trainer_for, oracle_for, bitwise, workload):
    w = CASES[workload]
    stack = stack_for(w)
    outputs, sequences, score_from, temperatures = rollout_and_sequences(stack, w)
    oracle = oracle_for(w).score(sequences, score_from, temperatures)
    sides = [
        fidelity("rollout", [o.logprobs for o in outputs], oracle, w.torch_dtype,
                 [o.tokens for o in outputs], [t == 0 for t in temperatures]),
        fidelity("trainer", trainer_for(w).trainer_logprobs(sequences, score_from, temperatures), oracle, w.torch_dtype),
    ]
    try:
        sides.append(fidelity("prompt", stack.prompt_logprobs(sequences, score_from, temperatures), oracle, w.torch_dtype))
    except Unsupported:
        pass  # prefill scoring is optional; the other sides still decide
    bitwise.fidelity(sides)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
def test_c0_sampling_follows_the_tempered_distribution(stack_for, oracle_for, bitwise, temperature):
    w = dataclasses.replace(WORKLOADS["sampled"], temperature=temperature)
    gen = torch.Generator().manual_seed(5)
    vocab = w.spec.config().vocab_size
    requests = [Request(tuple(torch.randint(vocab, (8,), generator=gen).tolist()), SAMPLING_TOKENS, temperature,
                        seed=1000 + i) for i in range(SAMPLING_PROMPTS)]
    outputs = stack_for(w).rollout(requests)
    scored = TrainerInputs.after(requests, outputs)
    rows = oracle_for(w).distributions(scored.sequences, scored.score_from, scored.temperatures)
    bitwise.sampling(sampling_fit([o.tokens for o in outputs], rows), temperature)
