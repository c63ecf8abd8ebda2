"""RMSNorm as Qwen3 computes it: fp32 mean of squares, rsqrt, round, then scale.

`rms_norm` is one C++ pass (csrc/rms_norm.cpp) whose sum of squares has one order by construction: 32 fixed
lanes added in a fixed tree, each row reduced whole by one thread, so no row count, thread count or vector
width can change a bit. torch's own sum (`rms_norm_in_torch`, the baseline's) vectorises by the CPU's width
and splits a row across threads when there are fewer rows than threads and the row is longer than
at::internal::GRAIN_SIZE: an order that was only measured to hold on Qwen3's sizes.
"""

import torch

from logdiff.kernels.gemm import extension


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] normalised over H and scaled by weight [H] (x's dtype), rounded as `rms_norm_in_torch` rounds.
    Differentiable."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return _rms_norm(x, weight, eps)[0]


def _rms_norm(x, weight, eps):
    rows = x.reshape(-1, x.shape[-1])
    out, inv = extension().rms_norm(rows if rows.stride(-1) == 1 else rows.contiguous(), weight, eps)
    return out.view(x.shape), inv


def rms_norm_in_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in torch ops: what the baseline runs."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """With y = x r (r = 1 / rms, fp32, as the forward computed it) and dy = g w: dx = r (dy - y mean(dy y)),
    dw = the sum over rows of g y rounded as the forward rounded it; fp32 torch ops, deterministic (only the
    forward needs bits no shape can change)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        out, inv = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, inv)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, inv = ctx.saved_tensors
        g = grad.reshape(-1, x.shape[-1]).float()
        y = x.reshape(-1, x.shape[-1]).float() * inv[:, None]
        dy = g * weight.float()
        dx = inv[:, None] * (dy - y * (dy * y).mean(-1, keepdim=True))
        dw = (g * y.to(x.dtype).float()).sum(0)
        return dx.view(x.shape).to(x.dtype), dw.to(weight.dtype), None
