"""The reference's fast MoE path gives the bits of the plain per-expert loop: the grouped buffer (one
GEMM per expert, or one batched GEMM over all experts, padded to the largest) runs on logdiff's GEMM,
whose rows do not depend on the row count. This is what lets decode and training take different
paths and still agree bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from logdiff.kernels import moe
from logdiff.kernels.linear import linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 32, 300])
@pytest.mark.parametrize("batched", [True, False])
def test_grouped_experts_equal_the_plain_loop(monkeypatch, dtype, tokens, batched):
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, width, top_k = 16, 64, 48, 4
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * width, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, width, generator=gen) / width**0.5).to(dtype)
    ids, _ = moe.route(torch.randn(tokens, experts, generator=gen), top_k, True)
    monkeypatch.setattr(moe, "BATCHED_WASTE", float("inf") if batched else 0.0)
    grouped = moe.grouped_experts(x, ids, gate_up, down)
    plain = moe.run_experts(x, ids, gate_up, down, linear=linear)
    assert torch.equal(grouped.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       plain.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_grouped_experts_backward_matches_the_plain_loop():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=gen, requires_grad=True)
    gate_up = torch.randn(8, 64, 32, generator=gen, requires_grad=True)
    down = torch.randn(8, 32, 32, generator=gen, requires_grad=True)
    ids, weights = moe.route(torch.randn(40, 8, generator=gen), 2, True)
    grads = []
    for experts in (moe.grouped_experts, lambda *a: moe.run_experts(*a, linear=linear)):
        out = moe.combine(experts(x, ids, gate_up, down), weights)
        grads.append(torch.autograd.grad(F.mse_loss(out, torch.zeros_like(out)), (x, gate_up, down)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 1, 64), (33, 2, 100), (300, 8, 512)])
def test_the_one_pass_combine_is_the_torch_combine_bit_for_bit(dtype, tokens, top_k, hidden):
    """The C++ combine adds the same fp32 products in the same order as k torch multiplies and k - 1 adds,
    vector body and tail alike; its backward gives the outputs' gradient bit for bit and the weights' the same
    whatever the threads."""
    gen = torch.Generator().manual_seed(tokens)
    expert_out = torch.randn(tokens, top_k, hidden, generator=gen).to(dtype).requires_grad_()
    _, weights = moe.route(torch.randn(tokens, 16, generator=gen), top_k, True)
    weights.requires_grad_()
    g = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ours, theirs = moe.combine(expert_out, weights), moe.combine_in_torch(expert_out, weights)
    view = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(ours.view(view), theirs.view(view))
    d_out, d_weights = torch.autograd.grad(ours, (expert_out, weights), g)
    their_d_out, their_d_weights = torch.autograd.grad(theirs, (expert_out, weights), g)
    assert torch.equal(d_out, their_d_out)
    torch.testing.assert_close(d_weights, their_d_weights, rtol=1e-5, atol=1e-5)  # a sum over H, in an order of its own
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(torch.autograd.grad(moe.combine(expert_out, weights), weights, g)[0], d_weights)
    finally:
        torch.set_num_threads(threads)
    strided = expert_out.detach().transpose(0, 1).contiguous().transpose(0, 1)  # slots outermost in memory
    assert torch.equal(moe.combine(strided, weights.detach()).view(view), theirs.detach().view(view))
