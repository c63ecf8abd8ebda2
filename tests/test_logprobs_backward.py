"""The token log-probs' written-out gradient: the forward keeps its bits with and without autograd, the
gradient matches autograd through the plain max-shifted formula within fp32 rounding and is deterministic.
On vocabulary slices (TP4, real gloo ranks) it is one process's gradient bit for bit: test_vocab_parallel_logsoftmax."""

import pytest
import torch

from logdiff.kernels.logsoftmax import fixed_order_token_logprobs, scoring_temperature, token_logprobs

KERNELS = [token_logprobs, fixed_order_token_logprobs]


def _autograd_formula(logits, targets, temperature):
    x = logits.float() / scoring_temperature(temperature)[:, None]
    shifted = x - x.amax(-1, keepdim=True)
    return shifted.gather(1, targets[:, None]).squeeze(1) - torch.log(torch.exp(shifted).sum(-1))


def _inputs(vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(48, vocab, generator=g) * 3).to(dtype)
    temperature = torch.rand(48, generator=g) + 0.5
    temperature[::4] = 0  # greedy rows score at 1
    return logits, torch.randint(0, vocab, (48,), generator=g), temperature, torch.randn(48, generator=g)


def _grad(kernel, logits, targets, temperature, weight):
    leaf = logits.clone().requires_grad_(True)
    out = kernel(leaf, targets, temperature)
    (grad,) = torch.autograd.grad(out, leaf, weight)
    return out.detach(), grad


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("vocab", [1024, 38000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_matches_autograd_through_the_formula(kernel, vocab, dtype):
    logits, targets, temperature, weight = _inputs(vocab, dtype)
    out, grad = _grad(kernel, logits, targets, temperature, weight)
    with torch.no_grad():
        assert torch.equal(out, kernel(logits, targets, temperature)), "the forward with grad differs from the no-grad one"
    _, expected = _grad(_autograd_formula, logits, targets, temperature, weight)
    assert grad.dtype == logits.dtype
    diff = (grad.float() - expected.float()).abs().max()
    assert diff <= 1e-6 * float(expected.float().abs().max()) + 1e-7, f"gradient differs by {diff}"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_gradient_is_deterministic(kernel):
    logits, targets, temperature, weight = _inputs(16384, torch.bfloat16, seed=1)
    first = _grad(kernel, logits, targets, temperature, weight)
    second = _grad(kernel, logits, targets, temperature, weight)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
