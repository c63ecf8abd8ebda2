"""RMSNorm as Qwen3 computes it: fp32 mean of squares, rsqrt, round, then scale.

The mean runs over the hidden size (<= a few thousand): one vectorised reduction per row, whose
order depends on the row length only, never on how many rows there are.
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
