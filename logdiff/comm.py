"""Collectives as the model sees them: `Comm` over one process (every collective the identity) or over
the ranks of a torch.distributed group (`logdiff.parallel`). Kernel sets hold one for tensor and one
for expert parallelism, so the model stays one definition."""

from __future__ import annotations

import torch


class Comm:
    """One process: rank 0 of 1."""

    rank: int = 0
    size: int = 1

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's `x` (same shape on all ranks), concatenated along `dim` in rank order."""
        return x

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The backend's native sum over ranks (its order is the backend's)."""
        return x

    def all_to_all(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """Rows x[sum(send[:r]):sum(send[:r+1])] go to rank r; returns the rows received, in rank order."""
        return x

    def exchange_counts(self, send: list[int]) -> list[int]:
        """What every rank sends this one, given what this one sends every rank."""
        return send


SINGLE_PROCESS = Comm()


class DistributedComm(Comm):
    """The ranks of a torch.distributed process group (gloo on CPU, nccl or hccl on a device)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, x, dim=0):
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(self.size)]
        self.dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_reduce(self, x):
        out = x.clone(memory_format=torch.contiguous_format)
        self.dist.all_reduce(out, group=self.group)
        return out

    def all_to_all(self, x, send, receive):
        out = x.new_empty((sum(receive), *x.shape[1:]))
        self.dist.all_to_all_single(out, x.contiguous(), receive, send, group=self.group)
        return out

    def exchange_counts(self, send):
        return self.all_to_all(torch.tensor(send, dtype=torch.long), [1] * self.size, [1] * self.size).tolist()
