"""Sampling is a pure function of (request seed, token index, logits): batch-invariant by construction."""

import torch

from logdiff.kernels.sampling import sample, uniform_noise


def test_noise_of_a_request_does_not_depend_on_its_batch():
    alone = uniform_noise(torch.tensor([42]), torch.tensor([7]), 1000)
    batch = uniform_noise(torch.tensor([1, 42, 3]), torch.tensor([0, 7, 9]), 1000)
    assert torch.equal(alone[0], batch[1])
    assert not torch.equal(batch[0], batch[1])


def test_noise_is_uniform_on_the_open_interval():
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.std().item() - (1 / 12) ** 0.5) < 0.005


def test_greedy_rows_take_the_argmax_and_sampled_rows_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).expand(4000, 3)
    temps = torch.ones(4000)
    temps[0] = 0.0
    tokens = sample(logits, temps, torch.arange(4000), torch.zeros(4000, dtype=torch.long))
    assert tokens[0] == 1
    freq = torch.bincount(tokens[1:], minlength=3).float() / 3999
    assert torch.allclose(freq, torch.tensor([0.1, 0.6, 0.3]), atol=0.03), freq
