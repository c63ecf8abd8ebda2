"""RMSNorm as Qwen3 computes it: fp32 mean of squares, rsqrt, round, then scale.

Order fixed in torch, not in the C++ module, because torch already gives it: its CPU sum over the last
dimension reduces each row whole, in one vectorised pass whose order follows the row's length and the
CPU's vector width (cpu_capability) only. It splits one row across threads only when there are fewer
rows than threads and the row is longer than at::internal::GRAIN_SIZE (32768); no Qwen3 hidden size is
over 8192 (tests/test_row_invariance.py: every Qwen3 hidden size, M 1..4096, 1 and 2 threads).
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
