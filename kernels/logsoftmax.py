"""Token log-probs: fp32, max-shifted, `s - log(sum(exp(s)))`, the same formula on both sides.

Temperature divides the fp32 logits first; temperature 0 (greedy) scores the plain distribution,
as temperature 1 (dividing by 1.0 is exact). Order fixed in torch, not in the C++ module: the sum over
the vocabulary is taken in chunks of VOCAB_CHUNK, then over the chunks. Torch splits one reduction
across threads when fewer rows than threads share the call and the row is longer than its grain (32768;
measured: a 151936-wide row sums to other bits alone than among 64 rows); a chunk (4096) and a row of
chunk sums (37 for 151936) are below it, so each runs in one vectorised piece whose order follows its
length only. The row max is exact in any order.

Vocab-parallel (tensor parallelism, `logdiff.parallel`): each rank holds the logits of its slice of the
vocabulary. The row max is gathered (a max is exact in any order), each rank sums exp over its slice,
and the rank that owns the target's vocabulary id hands over its shifted logit (gathered, so copied, not
added). Only the sum of exp is a reduction whose order can follow the degree:
`fixed_order_token_logprobs` sums VOCAB_PARTS fixed parts of the vocabulary, one partial sum each, and
adds the partials in vocabulary order whatever the degree (the reference); `native_vocab_parallel_logprobs`
adds each rank's sum with the backend's all_reduce (what a stack does without that alignment).
"""

import torch
import torch.nn.functional as F

from logdiff.comm import SINGLE_PROCESS, Comm
from logdiff.kernels.linear import REDUCE_CHUNKS, sum_in_order

VOCAB_CHUNK = 4096
# The vocabulary's sum of exp is taken in this many parts whatever the parallel degree: every supported
# degree divides it, so a rank holds whole parts and computes the very partial sums one process does.
VOCAB_PARTS = REDUCE_CHUNKS


def scoring_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """The temperature a log-prob is scored at: a greedy (0) token scores at 1."""
    return torch.where(temperature > 0, temperature, 1.0)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log p(targets[i] | row i) for logits [N, V] at per-row temperatures [N]; fp32 [N]. One process:
    the sum of exp over the whole row in VOCAB_CHUNK chunks (the chunk boundaries follow V, not a degree)."""
    return _TokenLogprobs.apply(logits, targets, temperature, SINGLE_PROCESS, chunked_sum)


def chunked_sum(x: torch.Tensor) -> torch.Tensor:
    """Row sums of x [N, V]: each VOCAB_CHUNK chunk of a row summed (the last zero-padded to a whole chunk),
    then the chunk sums. The whole chunks are summed where they lie (a view; only the last is copied into a
    padded chunk): the same contiguous 4096-element reductions, so the same bits as padding the whole row,
    without its copy (256 x 151936: 73 -> 5 ms)."""
    rows, width = x.shape
    full = width - width % VOCAB_CHUNK
    sums = x[:, :full].unflatten(1, (-1, VOCAB_CHUNK)).sum(-1)
    if full < width:
        tail = x.new_zeros(rows, VOCAB_CHUNK)
        tail[:, : width - full] = x[:, full:]
        sums = torch.cat([sums, tail.sum(-1, keepdim=True)], 1)
    return sums.sum(-1)


def fixed_order_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                               comm: Comm = SINGLE_PROCESS) -> torch.Tensor:
    """`token_logprobs` for logits [N, V/size] of this rank's vocabulary slice (targets: vocabulary ids of
    the whole V), with the sum of exp in an order that does not depend on the degree: a chunked sum per
    fixed part (VOCAB_PARTS of them over the whole V), the partial sums of all ranks gathered in
    vocabulary order, then added one after the other. One process computes the very same parts, so TP1,
    TP2 and TP4 give the same bits."""
    local = VOCAB_PARTS // comm.size
    if local * comm.size != VOCAB_PARTS or (comm.size > 1 and logits.shape[-1] % local):
        raise ValueError(f"vocabulary {logits.shape[-1] * comm.size} does not split into {VOCAB_PARTS} parts "
                         f"over {comm.size} ranks")

    def sum_exp(exp):
        return sum_in_order(comm.all_gather(torch.stack([chunked_sum(part) for part in exp.tensor_split(local, -1)])))

    return _TokenLogprobs.apply(logits, targets, temperature, comm, sum_exp)


class _TokenLogprobs(torch.autograd.Function):
    """shifted[target] - log(sum_exp(exp(shifted))), with the gradient written out: (onehot - softmax) / T
    in two passes over [N, V]. Autograd through the forward's ops instead zero-fills and copies the whole
    [N, V] once per vocabulary part, pad and gather (qwen3-moe-small bf16 trainer: 830 -> 930 tokens/s,
    baseline 1020). The forward is the same ops, so the same bits; the gradient agrees with autograd's to
    fp32 rounding (tests/test_logprobs_backward.py) and is one process's on every TP degree."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, comm, sum_exp):
        shifted = _shifted(logits, temperature, comm)
        target = _target_logit(shifted, targets, comm)
        exp = shifted.exp_()  # its own buffer: exponentiated in place, after the target's logit is taken
        total = sum_exp(exp)
        ctx.save_for_backward(exp, total, targets, temperature)
        ctx.comm, ctx.dtype = comm, logits.dtype
        return target - torch.log(total)

    @staticmethod
    def backward(ctx, grad):
        exp, total, targets, temperature = ctx.saved_tensors
        scale = grad / scoring_temperature(temperature)
        out = exp * (-scale / total)[:, None]
        local = targets - ctx.comm.rank * exp.shape[1]  # the target's column on the rank that holds it
        mine = (local >= 0) & (local < exp.shape[1])
        rows = torch.arange(len(targets))[mine]
        out[rows, local[mine]] += scale[mine]
        return out.to(ctx.dtype), None, None, None, None


def native_vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                                   comm: Comm) -> torch.Tensor:
    """The same quantity with each rank's sum of exp added by the backend's all_reduce: the order of the
    vocabulary reduction follows the degree."""
    shifted = _shifted(logits, temperature, comm)
    total = comm.all_reduce(torch.exp(shifted).sum(-1))
    return _target_logit(shifted, targets, comm) - torch.log(total)


def _shifted(logits: torch.Tensor, temperature: torch.Tensor, comm: Comm) -> torch.Tensor:
    """fp32 logits / T minus the row max over the whole vocabulary (gathered: exact in any order)."""
    x = logits.float() / scoring_temperature(temperature)[:, None]
    top = comm.all_gather(x.amax(-1)[None]).amax(0)
    return x.sub_(top[:, None])  # x is the division's new tensor


def _target_logit(shifted: torch.Tensor, targets: torch.Tensor, comm: Comm) -> torch.Tensor:
    """shifted[i, targets[i]] from the rank whose vocabulary slice holds targets[i]."""
    width = shifted.shape[-1]
    local = (targets - comm.rank * width).clamp(0, width - 1)
    picked = comm.all_gather(shifted.gather(1, local[:, None]).squeeze(1)[None])  # [size, N]
    return picked[targets // width, torch.arange(targets.shape[0])]


def fused_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """torch's fused log_softmax in fp32: what most trainers and samplers call."""
    logp = F.log_softmax(logits.float() / scoring_temperature(temperature)[:, None], dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1)
