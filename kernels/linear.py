"""Batch-invariant linear layer: a row's result may not depend on how many rows share the GEMM.

MKL picks a different micro-kernel, and so a different reduction order along K, for skinny GEMMs:
here fp32 `x[:m] @ W` differs from `(x @ W)[:m]` for m in {1, 2, 3, 5, 6, 7, 9, 10, 11}, and on
AVX2 machines for m <= 3. From MIN_ROWS rows on every row comes out the same whatever M is, so
skinny calls (decode, small experts) are zero-padded up to MIN_ROWS rows. On a memory-bound GEMV
the extra rows cost almost nothing: the weights are read once either way.

Low-precision inputs are computed as fp32 GEMMs and rounded once: the bits of a bf16 GEMM with fp32
accumulation, at fp32 GEMM speed (a bf16 matmul on this CPU is 5-300x slower).
"""

import torch
import torch.nn.functional as F

MIN_ROWS = 16


def _fp32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float()).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, in] @ w[out, in].T, invariant to N."""
    rows = x.shape[0]
    if rows >= MIN_ROWS:
        return _fp32_linear(x, w)
    padded = F.pad(x, (0, 0, 0, MIN_ROWS - rows))
    return _fp32_linear(padded, w)[:rows]


def plain_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same GEMM without the padding: the reduction order follows N (GEMV for one row)."""
    return _fp32_linear(x, w)
