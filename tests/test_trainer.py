"""The trainer path: padded and packed batches give the same bits; it is differentiable and its
backward is deterministic."""

import pytest
import torch

from logdiff.kernels import reference_kernels
from logdiff.trainer import Trainer
from logdiff.weights import ModelSpec

SEQS = [[5, 9, 2, 7, 1, 3], list(range(40, 170)), [11, 12]]


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def trainer(request):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[request.param]
    return Trainer(ModelSpec("qwen3-moe-tiny").build(dtype), reference_kernels())


def _grads(trainer):
    params = [p for p in trainer.model.parameters()]
    for p in params:
        p.requires_grad_(True)
        p.grad = None
    logp = trainer.logprobs(SEQS, [1, 100, 1], [1.0] * 3, grad=True)
    (-torch.cat(logp).float().sum()).backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    return grads


def test_backward_reaches_every_parameter_and_is_deterministic(trainer):
    first, second = _grads(trainer), _grads(trainer)
    routed = {n for n, _ in trainer.model.named_parameters()}
    assert set(first) == routed, f"no gradient for {sorted(routed - set(first))[:3]}"
    assert any(g.abs().sum() > 0 for g in first.values())
    for name in first:
        assert torch.equal(first[name], second[name]), f"backward not deterministic at {name}"


def test_score_from_outside_sequence_is_rejected(trainer):
    with pytest.raises(ValueError, match="score_from"):
        trainer.logprobs([[1, 2, 3]], [0], [1.0])


def test_the_head_in_chunks_gives_the_bits_of_one_pass(trainer, monkeypatch):
    """The trainer scores HEAD_ROWS positions at a time (its [rows, V] logits bounded); every op of the head is
    row-wise and the reference GEMM's rows do not depend on M, so chunking changes no bit, and a capture
    still sees every scored row's logits."""
    import logdiff.trainer as trainer_module
    from logdiff.bisect.capture import Recorder

    def scored(rows):
        monkeypatch.setattr(trainer_module, "HEAD_ROWS", rows)
        recorder = Recorder(request=1, upto=129)
        return torch.cat(trainer.logprobs(SEQS, [1, 3, 1], [1.0, 0.7, 0.0], capture=recorder)), recorder.rows["logits"]

    whole, whole_logits = scored(10**9)
    chunked, chunked_logits = scored(7)  # 5 + 127 + 1 scored rows: chunks cut inside sequences
    assert torch.equal(whole.view(torch.int32), chunked.view(torch.int32))
    assert sorted(chunked_logits) == list(range(2, 129)) and all(
        torch.equal(whole_logits[p], chunked_logits[p]) for p in whole_logits)
