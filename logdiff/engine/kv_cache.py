"""Paged KV cache: fixed-size pages of `page_size` token slots, handed out from a free list.

A sequence's block table lists its pages in position order; position p lives in slot
`table[p // page_size] * page_size + p % page_size`. Keys are stored head-major
([kv_heads, slots, head_dim]) so an attention block gathers contiguous rows per head.
"""

from __future__ import annotations

import random
from collections import deque

import torch


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, shuffle_seed: int | None = None):
        pages = list(range(num_pages))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(pages)
        self.free_pages = deque(pages)
        self.page_size = page_size

    def reserve(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` until it can hold `num_tokens` positions."""
        while len(table) * self.page_size < num_tokens:
            if not self.free_pages:
                raise RuntimeError("KV cache is out of pages; the engine sized it from the requests, so this is a bug")
            table.append(self.free_pages.popleft())

    def release(self, table: list[int]) -> None:
        self.free_pages.extend(table)
        table.clear()


class PagedKVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype):
        # Zeros, not empty: masked positions may point at never-written slots, and 0 * NaN is NaN.
        shape = (kv_heads, num_pages * page_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.page_size = page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, kv_heads, d] into `slots` [N]."""
        self.k[layer][:, slots] = k.transpose(0, 1)
        self.v[layer][:, slots] = v.transpose(0, 1)

    def slots(self, tables: list[list[int]], positions: torch.Tensor) -> torch.Tensor:
        """Slot of each (sequence, position): positions [S, L] -> [S, L]. Positions past a table's end
        map into its first page; attention masks them."""
        width = max(1, max(len(t) for t in tables))
        table = torch.tensor([t + [t[0] if t else 0] * (width - len(t)) for t in tables], dtype=torch.long)
        page = (positions // self.page_size).clamp(max=width - 1)
        return table.gather(1, page) * self.page_size + positions % self.page_size
