"""Batch-invariant sampling: Gumbel-max with noise that depends only on (request seed, token index), and
the truncation (top-k, top-p, min-p) of the distribution sampled from.

The noise for vocabulary entry v of a request's i-th generated token is a counter-based hash
(splitmix64) of (seed, i, v), computed with integer tensor ops, so a request samples the same token
whatever its batch, its slot in the batch or the step at which it joined. Temperature 0 is greedy.
A truncated row samples over its kept set (`kept_tokens`): the others' logits are -inf, so the same noise
decides among the kept tokens, and the draw stays batch-invariant.
"""

import torch

from logdiff.kernels.logsoftmax import chunked_sum, scoring_temperature

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def uniform_noise(seeds: torch.Tensor, token_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] fp32 uniforms in (0, 1), a pure function of (seed, token index, vocabulary id)."""
    x = (seeds[:, None] * _GOLDEN + token_index[:, None]) * _MIX1 + torch.arange(vocab_size)[None, :] * _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 40).float() + 0.5) / float(1 << 24)


def sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, token_index: torch.Tensor):
    """Next token per row: argmax(logits / T + Gumbel noise), or argmax(logits) where T == 0."""
    x = logits.float()
    greedy = temperature == 0
    if greedy.all():
        return x.argmax(-1)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, token_index, x.shape[1])))
    noisy = x / torch.where(greedy, 1.0, temperature)[:, None] + gumbel
    return torch.where(greedy, x.argmax(-1), noisy.argmax(-1))


def kept_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
    """bool [S, V]: the tokens each row's truncation keeps, decided on its tempered logits in fp32 (fp64 logits,
    the oracle's, in fp64).

    In this order (transformers' order of its warpers): top-k keeps the k likeliest (top_k 0: off); top-p
    keeps, of what top-k kept, renormalised, the likeliest tokens until their mass reaches top_p (the smallest
    such set; top_p >= 1: off); min-p keeps tokens whose probability is at least min_p times the likeliest's
    (exp(x - max) >= min_p: a ratio, the same before and after renormalising; min_p 0: off). Ties: a token
    whose value equals that of the last token a rule keeps is kept too, so the set depends on the values
    alone, never on a sort's order among equals or on token ids (top-k may keep more than k). Rows at
    temperature 0 keep everything: a greedy token is the argmax, which every truncation keeps.

    Row-invariant: sort, the fixed-order sum of logsoftmax and cumsum (one running sum along the row,
    in double) each work row by row, so a row's set does not depend on its batch.
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / scoring_temperature(temperature)[:, None]
    sampled = temperature > 0
    keep = torch.ones_like(x, dtype=torch.bool)
    top_k = torch.where(sampled, top_k, 0)
    if (top_k > 0).any():
        ordered = x.sort(dim=-1, descending=True).values
        kth = ordered.gather(1, (top_k.clamp(1, x.shape[1]) - 1)[:, None])
        keep &= (x >= kth) | (top_k == 0)[:, None]
    top_p = torch.where(sampled, top_p, 1.0)
    if (top_p < 1).any():
        shifted = x.masked_fill(~keep, float("-inf")) - x.amax(-1, keepdim=True)
        exp = shifted.exp()
        p = exp / chunked_sum(exp)[:, None]
        ordered = p.sort(dim=-1, descending=True).values
        likelier_mass = torch.cat([torch.zeros_like(ordered[:, :1]), ordered.cumsum(-1)[:, :-1]], dim=-1)
        kept = (likelier_mass < top_p[:, None]).sum(-1).clamp(min=1)
        last = ordered.gather(1, (kept - 1)[:, None])
        keep &= (p >= last) | (top_p >= 1)[:, None]
    min_p = torch.where(sampled, min_p, 0.0)
    if (min_p > 0).any():
        keep &= torch.exp(x - x.amax(-1, keepdim=True)) >= min_p[:, None]
    return keep
