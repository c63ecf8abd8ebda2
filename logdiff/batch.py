"""Where each token of a call sits: the packed (varlen) layout every path of the model runs on."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class SeqBatch:
    """`lengths[s]` new tokens of sequence s, the first at absolute position `starts[s]`.

    The model sees these tokens packed as rows 0..N-1, sequence after sequence. The trainer passes
    whole sequences (starts = 0); a rollout prefill passes prompts or prompt chunks; a decode step
    passes one token per running sequence, at the position it has reached.
    """

    lengths: torch.Tensor  # [S] int64
    starts: torch.Tensor  # [S] int64

    @classmethod
    def from_lengths(cls, lengths, starts=None) -> "SeqBatch":
        lengths = torch.as_tensor(lengths, dtype=torch.long)
        starts = torch.zeros_like(lengths) if starts is None else torch.as_tensor(starts, dtype=torch.long)
        return cls(lengths, starts)

    @property
    def num_seqs(self) -> int:
        return self.lengths.numel()

    @cached_property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @cached_property
    def max_len(self) -> int:
        return int(self.lengths.max())

    @cached_property
    def offsets(self) -> torch.Tensor:
        """Packed row of each sequence's first token."""
        return torch.cumsum(self.lengths, 0) - self.lengths

    @cached_property
    def seq_of_token(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.num_seqs), self.lengths)

    @cached_property
    def positions(self) -> torch.Tensor:
        """Absolute position of every packed token: what RoPE sees."""
        rank = torch.arange(self.num_tokens) - self.offsets[self.seq_of_token]
        return self.starts[self.seq_of_token] + rank

    @cached_property
    def is_decode(self) -> bool:
        return self.max_len == 1

    def padded_index(self, left: bool = False) -> torch.Tensor:
        """[S, max_len]: packed row of each (sequence, slot), or N (a padding row) beyond its length.

        Right-padded by default (slot t holds the t-th new token); `left=True` aligns sequences to the end.
        """
        t = torch.arange(self.max_len)
        shift = (self.max_len - self.lengths)[:, None] if left else 0
        rank = t[None, :] - shift
        valid = (rank >= 0) & (rank < self.lengths[:, None])
        return torch.where(valid, self.offsets[:, None] + rank, self.num_tokens)


def check_score_from(sequences, score_from) -> None:
    """Scoring starts after at least one token and inside the sequence: 1 <= score_from[s] <= len."""
    for s, (seq, first) in enumerate(zip(sequences, score_from)):
        if not 1 <= first <= len(seq):
            raise ValueError(f"score_from {first} outside [1, {len(seq)}] for sequence {s}")
