"""MoE routing and expert combine with an order fixed by the data, not by the batch.

Routing: fp32 softmax over the router logits, top-k by a stable descending sort (ties go to the
lower expert id), renormalised. Experts: each expert's tokens run through the kernel set's linear.
Combine: a token's k expert outputs are summed in routing-rank order, in fp32: k - 1 elementwise adds,
no reduction torch could split or reorder. The experts' GEMMs are the kernel set's `linear`.

`grouped_experts` is the reference's expert layer: the (token, expert) pairs are laid out once in one
buffer, expert after expert; then one grouped GEMM call over the active experts (the reference's
`grouped_linear`) or one GEMM per active expert, or one batched GEMM over all experts when nearly all have
rows (decode), and one activation over the whole buffer. With the reference's GEMM a
row's bits do not depend on how many rows its expert received (nor on the batched or per-expert form),
so nothing is padded; with torch's GEMM (baseline) they follow the expert's row count. `run_experts` is
the plain loop over experts, with every op per expert, that a straightforward implementation writes (naive's).
"""

import torch
import torch.nn.functional as F

from logdiff.kernels.activation import silu_mul
from logdiff.kernels.gemm import extension
from logdiff.kernels.linear import linear as fixed_linear

# Batched over all experts when that computes at most this many times the rows of the per-expert GEMMs.
# Measured on qwen3-moe-small bf16 (reference, tokens/s at 2.0 -> 1.25): prefill 3220 -> 4770, trainer
# 893 -> 1077, decode-b8 212 -> 236, decode-b32 666 -> 701; at 1.0 decode-b32 falls to 622.
BATCHED_WASTE = 1.25


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


def run_experts(x, ids, gate_up, down, linear=fixed_linear, act=silu_mul):
    """Output of expert ids[t, r] on token t, for every (t, r): [N, k, H] in x's dtype."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    grouped = x[order // top_k]
    gate_up, down = _per_expert(gate_up), _per_expert(down)
    pieces = []
    for expert, rows in enumerate(grouped.split(counts)):
        if len(rows):
            gate, up = linear(rows, gate_up[expert]).chunk(2, dim=-1)
            pieces.append(linear(act(gate, up), down[expert]))
    out = torch.empty_like(grouped)
    out = out.index_copy(0, order, torch.cat(pieces))
    return out.view(num_tokens, top_k, -1)


def grouped_experts(x, ids, gate_up, down, linear=fixed_linear, act=silu_mul, grouped_linear=None):
    """`run_experts` with one buffer for all experts and `linear` (the kernel set's) for every GEMM;
    `grouped_linear` runs all experts' GEMMs in one call where the kernel set has one (default: one
    `linear` per expert)."""
    num_tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    capacity = int(counts.max())
    # Dense (decode: nearly every expert gets a few rows): one batched GEMM over all experts, each
    # padded to the largest; otherwise each expert's rows as they are, in one grouped call or one GEMM
    # per active expert. Only a matter of speed.
    batched = num_experts * capacity <= BATCHED_WASTE * num_tokens * top_k
    # The buffer's rows: expert after expert, each expert's (token, slot) pairs in order (csrc/expert_rows.cpp).
    source, row_of_pair, offsets = extension().expert_rows(ids, num_experts, capacity if batched else 0)
    # An embedding gather: its backward sums a token's k rows in a fixed order (index backward does not).
    # Padding rows read the zero row.
    buffer = F.embedding(source, F.pad(x, (0, 0, 0, 1)))
    if batched:
        gate, up = linear(buffer.view(num_experts, capacity, -1), gate_up).view(len(source), -1).chunk(2, dim=-1)
        out = linear(act(gate, up).view(num_experts, capacity, -1), down).view(len(source), -1)
    elif grouped_linear is None:
        sizes = counts.tolist()
        gate, up = _loop_linear(linear, buffer, gate_up, sizes).chunk(2, dim=-1)
        out = _loop_linear(linear, act(gate, up), down, sizes)
    else:
        gate, up = grouped_linear(buffer, gate_up, offsets).chunk(2, dim=-1)
        out = grouped_linear(act(gate, up), down, offsets)
    return F.embedding(row_of_pair, out).view(num_tokens, top_k, -1)


def _loop_linear(linear, rows: torch.Tensor, weights: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """One `linear` per expert with rows, outputs concatenated in expert order."""
    active = [e for e, n in enumerate(sizes) if n]
    weights = _per_expert(weights)
    # split(), not slicing: a slice's backward zero-fills a gradient of the whole buffer, once per expert.
    pieces = rows.split([sizes[e] for e in active])
    return torch.cat([linear(piece, weights[e]) for e, piece in zip(active, pieces)])


def _per_expert(weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The experts' weight matrices as views whose gradients autograd stacks once. Indexing `weights[e]`
    per expert instead makes each backward allocate and zero-fill a gradient of all E experts (O(E^2)
    memory traffic: 77 % of a qwen3-moe-small trainer step). Unbound along the layout the weights are
    stored in (K-major: [E, in, out] contiguous), so the stacked gradient has the weights' own strides and
    lands in .grad without a transposing copy (a qwen3-moe-small bf16 trainer step made four of 25 MB).
    Without autograd, indexing is the cheaper view."""
    if not (weights.requires_grad and torch.is_grad_enabled()):
        return weights
    if weights.stride(-2) == 1:
        return tuple(piece.mT for piece in weights.mT.unbind(0))
    return weights.unbind(0)


class _Combine(torch.autograd.Function):
    """The combine and its backward, each one C++ pass (csrc/moe_combine.cpp): d expert_out[:, r] = g *
    weights[:, r] rounded to the outputs' dtype, d weights[:, r] = the fp32 sum over H of g * expert_out[:, r]
    in a fixed order."""

    @staticmethod
    def forward(ctx, expert_out, weights):
        ctx.save_for_backward(expert_out, weights)
        return extension().combine(expert_out, weights)

    @staticmethod
    def backward(ctx, g):
        expert_out, weights = ctx.saved_tensors
        return extension().combine_backward(g.to(expert_out.dtype), expert_out, weights)


def combine(expert_out, weights):
    """sum_r weights[:, r] * expert_out[:, r], accumulated in rank order in fp32 and rounded once: each product
    and each sum one fp32 operation along H, in one C++ pass over the [N, k, H] outputs (torch's k products and
    k - 1 adds, the bits of `combine_in_torch`, read the outputs 2k - 1 times). Differentiable."""
    if torch.is_grad_enabled() and (expert_out.requires_grad or weights.requires_grad):
        return _Combine.apply(expert_out, weights)
    return extension().combine(expert_out, weights)


def combine_in_torch(expert_out, weights):
    """`combine` as torch ops: each product fp32 by type promotion (a bf16 output widened exactly inside the
    multiply), the terms added one after the other."""
    terms = [w[:, None] * out for w, out in zip(weights.unbind(1), expert_out.unbind(1))]
    acc = terms[0]
    for term in terms[1:]:
        acc = acc + term
    return acc.to(expert_out.dtype)


def dispatch_experts(experts, comm, x, ids, gate_up, down):
    """Expert parallelism: `experts` with E/size experts per rank (gate_up, down: this rank's, in expert
    order), on tokens every rank holds in full ([N, H]).

    Each rank owns a contiguous block of the tokens. It sends each (token, slot) pair of its block to the
    rank holding that expert (all-to-all dispatch), runs its experts on the rows it receives (source rank
    after source rank, so in global (token, slot) order), sends the outputs back (all-to-all), and the
    ranks all-gather the [N, k, H] outputs; the caller's `combine` then sums each token's slots in routing
    order exactly as one process does. With the reference's GEMM a row's bits do not depend on how many
    rows share its expert's GEMM, so EP1 and EP2 agree bit for bit. Inference only."""
    num_tokens, top_k = ids.shape
    per_rank = gate_up.shape[0]
    block = -(-num_tokens // comm.size)
    lo, hi = min(comm.rank * block, num_tokens), min((comm.rank + 1) * block, num_tokens)
    own_ids = ids[lo:hi].flatten()
    dest = own_ids // per_rank
    order = torch.argsort(dest, stable=True)  # pairs by destination rank, (token, slot) order within
    send = torch.bincount(dest, minlength=comm.size).tolist()
    receive = comm.exchange_counts(send)
    rows = comm.all_to_all(x[lo:hi].repeat_interleave(top_k, 0)[order], send, receive)
    local_ids = comm.all_to_all(own_ids[order], send, receive) - comm.rank * per_rank
    out = experts(rows, local_ids[:, None], gate_up, down)[:, 0] if len(rows) else rows
    back = comm.all_to_all(out, receive, send)
    mine = torch.empty_like(back).index_copy_(0, order, back).view(hi - lo, top_k, x.shape[-1])
    padded = torch.nn.functional.pad(mine, (0, 0, 0, 0, 0, block - (hi - lo)))
    return comm.all_gather(padded)[:num_tokens]
