"""Bitwise comparison compares bits; the verdict and the first divergence say exactly where."""

import math

import torch

from logdiff.metrics import bits, compare, first_divergence, hex_bits


def test_negative_zero_and_nan_payloads_are_differences():
    assert not torch.equal(bits(torch.tensor([0.0])), bits(torch.tensor([-0.0])))
    quiet = torch.tensor([math.nan])
    other = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert not torch.equal(bits(quiet), bits(other))
    c = compare([torch.tensor([0.0, -1.0])], [torch.tensor([-0.0, -1.0])])
    assert c.verdict == "fail" and c.bitwise_equal_tokens == 1 and c.max_abs_logdiff == 0.0


def test_one_ulp_is_caught_and_located():
    a = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -3.0, -4.0])]
    b = [t.clone() for t in a]
    b[1][2] = torch.nextafter(b[1][2], torch.tensor(0.0))
    c = compare(a, b)
    assert c.verdict == "fail" and c.tokens == 5 and c.bitwise_equal_tokens == 4
    d = c.first_divergence
    assert (d.seq, d.pos) == (1, 2)
    assert str(d) == "logprobs differ at seq 1 pos 2: 0xc0800000 (-4.0) vs 0xc07fffff (-3.999999761581421)"
    assert c.max_abs_logdiff == 4.0 - 3.999999761581421


def test_identical_logprobs_pass_with_zero_mismatch_metrics():
    a = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    c = compare(a, [t.clone() for t in a])
    assert c.verdict == "pass" and c.first_divergence is None
    assert c.metrics["rollout_corr/kl"] == 0.0 and c.metrics["rollout_corr/k3_kl"] == 0.0
    assert c.metrics["training/rollout_probs_diff_max"] == 0.0
    assert c.metrics["train_rollout_logprob_abs_diff"] == 0.0
    assert abs(c.metrics["rollout_corr/ppl_ratio"] - 1.0) < 1e-7


def test_slime_metric_is_mean_over_samples_of_mean_abs_diff():
    c = compare([torch.tensor([-1.0, -1.0]), torch.tensor([-1.0])], [torch.tensor([-1.5, -1.0]), torch.tensor([-2.0])])
    assert abs(c.metrics["train_rollout_logprob_abs_diff"] - (0.25 + 1.0) / 2) < 1e-7
    assert c.mean_abs_logdiff == (0.5 + 0 + 1.0) / 3


def test_hex_bits_of_low_precision_values():
    assert hex_bits(torch.tensor(1.0)) == "0x3f800000"
    assert hex_bits(torch.tensor(-2.0, dtype=torch.bfloat16)) == "0xc000"
    assert first_divergence([torch.tensor([1.0])], [torch.tensor([1.0])]) is None
