"""SiLU(gate) * up with bits no shape can change: one C++ pass (csrc/silu_mul.cpp).

torch's fused `F.silu` / `torch.sigmoid` give different bits for the same input depending on
whether it lands in the vectorised body or the scalar tail of the loop, i.e. on the tensor's
shape (measured here: ~0.1 % of fp32 inputs). The C++ pass computes g / (1 + exp(-g)) * up in fp32
from IEEE +, *, / and its own exp (no libm, no fused multiply-add), rounded once: every element gets
the same bits wherever it sits and on every CPU — the "native SiLU" of the Ascend recipe.
"""

import torch

from logdiff.kernels.gemm import extension


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with contiguous rows (a view where the layout allows: a chunk of gate_up)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return extension().silu_mul(_rows(gate), _rows(up)).view(gate.shape)


class _SiluMul(torch.autograd.Function):
    """silu_mul, differentiated by hand: d up = g * silu(gate) (silu recomputed by the forward's C++, one pass),
    d gate = silu'(gate) * g * up (torch's silu_backward, elementwise and deterministic; only the forward needs
    bits no shape can change), each in fp32 and rounded once."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad = grad.float()
        silu = extension().silu(_rows(gate)).view(gate.shape)
        d_gate = torch.ops.aten.silu_backward(grad * up, gate.float()).to(gate.dtype)
        return d_gate, (grad * silu).to(up.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once to the inputs' dtype (one dtype for both). Differentiable."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return _silu_mul(gate, up)


def fused_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What most stacks call: torch's fused SiLU in the model dtype."""
    return torch.nn.functional.silu(gate) * up
