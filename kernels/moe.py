"""MoE routing and expert combine with an order fixed by the data, not by the batch.

Routing: fp32 softmax over the router logits, top-k by a stable descending sort (ties go to the
lower expert id), renormalised. Experts: each expert's tokens run through the batch-invariant
linear. Combine: a token's k expert outputs are summed in routing-rank order, in fp32.
"""

import torch

from logdiff.kernels.activation import silu_mul
from logdiff.kernels.linear import linear


def softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 max-shifted softmax over the last dim, from exp and IEEE arithmetic."""
    x = x.float()
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """-> (expert ids [N, k], fp32 weights [N, k]), highest probability first."""
    probs = softmax(router_logits)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def run_experts(x, ids, gate_up, down, linear=linear, act=silu_mul):
    """Output of expert ids[t, r] on token t, for every (t, r): [N, k, H] in x's dtype."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    grouped = x[order // top_k]
    pieces, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            rows = grouped[start : start + count]
            gate, up = linear(rows, gate_up[expert]).chunk(2, dim=-1)
            pieces.append(linear(act(gate, up), down[expert]))
            start += count
    out = torch.empty_like(grouped)
    out = out.index_copy(0, order, torch.cat(pieces))
    return out.view(num_tokens, top_k, -1)


def combine(expert_out, weights):
    """sum_r weights[:, r] * expert_out[:, r], accumulated in rank order in fp32."""
    acc = weights[:, 0, None] * expert_out[:, 0].float()
    for r in range(1, weights.shape[1]):
        acc = acc + weights[:, r, None] * expert_out[:, r].float()
    return acc.to(expert_out.dtype)
