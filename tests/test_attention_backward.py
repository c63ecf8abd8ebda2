"""The trainer attention's recomputing backward (`BlockAttention`): the forward keeps the block loop's
bits, the gradients match autograd through the loop within fp32 rounding, and they are deterministic."""

import pytest
import torch

from logdiff.batch import SeqBatch
from logdiff.kernels.attention import Alignments, train_attention

# Packed varlen batch: lengths below, at and over one KV block, so blocks are partial, skipped and shared.
LENGTHS = [5, 70, 300, 129]
HQ, HKV, D = 4, 2, 16


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    q, k, v = (torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    return q, k, v, torch.randn(n, HQ, D, generator=g).to(dtype)


def _run(q, k, v, dout, align, recompute, block):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = train_attention(q, k, v, SeqBatch.from_lengths(LENGTHS), align, block=block, recompute=recompute)
    (out.float() * dout.float()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("mask", [True, False], ids=["aligned-mask", "additive-mask"])
@pytest.mark.parametrize("block", [128, 64])
def test_recomputing_backward_matches_autograd_through_the_loop(mask, block):
    q, k, v, dout = _inputs(torch.float32)
    align = Alignments(mask=mask)
    out, *grads = _run(q, k, v, dout, align, recompute=True, block=block)
    ref_out, *ref_grads = _run(q, k, v, dout, align, recompute=False, block=block)
    assert torch.equal(out, ref_out), "the forward's bits changed"
    with torch.no_grad():
        plain = train_attention(q, k, v, SeqBatch.from_lengths(LENGTHS), align, block=block)
    assert torch.equal(out, plain), "the forward with grad differs from the no-grad forward"
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-6 * float(r.abs().max())), f"d{name}: max diff {(g - r).abs().max()}"


def test_recomputing_backward_is_deterministic_bf16():
    q, k, v, dout = _inputs(torch.bfloat16, seed=1)
    first = _run(q, k, v, dout, Alignments(), recompute=True, block=128)
    second = _run(q, k, v, dout, Alignments(), recompute=True, block=128)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    ref = _run(q, k, v, dout, Alignments(), recompute=False, block=128)
    assert torch.equal(first[0], ref[0])
    for g, r in zip(first[1:], ref[1:]):  # bf16 gradients: equal up to one rounding of the model dtype
        assert torch.allclose(g.float(), r.float(), rtol=2e-2, atol=2e-2 * float(r.float().abs().max()))
