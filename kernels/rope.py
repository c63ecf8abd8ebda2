"""Rotary position embedding with fp32 cos/sin looked up by absolute position.

The table is computed once per model, so a token's rotation depends on its position only, not on
which positions share the call (the trainer rotates all positions at once, decode one at a time).
"""

import torch

from logdiff.kernels.gemm import extension


class RotaryTable:
    def __init__(self, head_dim: int, theta: float, max_positions: int):
        # On the CPU whatever the default device: the model's parameters are made on "meta", then loaded.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float, device="cpu")[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = angles.cos(), angles.sin()

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin [N, head_dim] of `positions` [N]."""
        return self.cos[positions], self.sin[positions]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] rotated by cos/sin [N, head_dim]: x cos + rotate_half(x) sin in fp32 arithmetic,
    rounded once, in one C++ pass (csrc/rope.cpp; the bits of `rope_in_torch`). Differentiable."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, cos, sin)
    return _rope(x, cos, sin)


def _rope(x, cos, sin):
    return extension().rope(x if x.stride(-1) == 1 else x.contiguous(), cos, sin)


def rope_in_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope` in torch ops: what the baseline runs, and the bits `rope` is held to (tests/test_row_invariance.py)."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class _Rope(torch.autograd.Function):
    """The rotation is linear: dx = g cos + rotate_half^T(g sin), rotate_half^T(y) = cat(y[half:], -y[:half]),
    in fp32, rounded once (elementwise: deterministic)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        g = grad.float()
        gs = g * sin[:, None, :]
        half = g.shape[-1] // 2
        return (g * cos[:, None, :] + torch.cat((gs[..., half:], -gs[..., :half]), dim=-1)).to(grad.dtype), None, None
