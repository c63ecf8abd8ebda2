"""C11: the trainer trains. Log-probs computed with autograd on equal the ones computed without (so the
first PPO ratio is exactly 1), backward reaches every parameter with finite gradients, and two backward
passes give bitwise identical gradients."""

from contextlib import contextmanager

import pytest
import torch

from logdiff.workload import Workload

from .bitwise import PropertyViolation
from .workloads import scored_sequences


def _sequences(dtype):
    # Long, overlapping sequences: tokens repeat, so gradient rows receive several contributions.
    w = Workload(dtype=dtype, prompt_lens=(20, 140, 300, 129, 64), batch_size=5, max_new_tokens=16)
    return w, scored_sequences(w)


@contextmanager
def _trainable(stack):
    params = stack.trainer_parameters()
    before = {name: p.requires_grad for name, p in params.items()}
    for p in params.values():
        p.requires_grad_(True)
    try:
        yield params
    finally:
        for name, p in params.items():
            p.requires_grad_(before[name])


def _policy_gradient(stack, params, sequences, score_from, temperatures):
    """log-probs with autograd, and d(sum_s A_s * sum_i logp_si)/d(params) for fixed advantages A_s = +-1."""
    logp = stack.trainer_logprobs(sequences, score_from, temperatures, grad=True)
    if not all(x.requires_grad for x in logp):
        raise PropertyViolation("trainer_logprobs(grad=True) returned log-probs without autograd history")
    loss = sum((1.0 if s % 2 else -1.0) * x.sum() for s, x in enumerate(logp))
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return logp, dict(zip(params, grads))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_c11_trainer_differentiable(stack_for, bitwise, dtype):
    w, (sequences, score_from, temperatures) = _sequences(dtype)
    stack = stack_for(w)
    with _trainable(stack) as params:
        with_grad, grads = _policy_gradient(stack, params, sequences, score_from, temperatures)
    without_grad = stack.trainer_logprobs(sequences, score_from, temperatures)
    bitwise.logprobs(with_grad, without_grad, ("trainer with grad", "trainer without grad"))
    missing = [name for name, g in grads.items() if g is None]
    if missing:
        raise PropertyViolation(f"backward reaches no gradient to {len(missing)} parameters, first {missing[0]}")
    for name, g in grads.items():
        if not torch.isfinite(g).all():
            raise PropertyViolation(f"gradient of {name} is not finite")
    if not any(g.any() for g in grads.values()):
        raise PropertyViolation("every gradient is zero")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_c11_backward_deterministic(stack_for, bitwise, dtype):
    w, (sequences, score_from, temperatures) = _sequences(dtype)
    stack = stack_for(w)
    with _trainable(stack) as params:
        _, first = _policy_gradient(stack, params, sequences, score_from, temperatures)
        _, second = _policy_gradient(stack, params, sequences, score_from, temperatures)
    used = [name for name in first if first[name] is not None]
    bitwise.gradients({n: first[n] for n in used}, {n: second[n] for n in used}, ("first backward", "second backward"))
