"""Batch-invariant sampling: Gumbel-max with noise that depends only on (request seed, token index).

The noise for vocabulary entry v of a request's i-th generated token is a counter-based hash
(splitmix64) of (seed, i, v), computed with integer tensor ops, so a request samples the same token
whatever its batch, its slot in the batch or the step at which it joined. Temperature 0 is greedy.
"""

import torch

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
