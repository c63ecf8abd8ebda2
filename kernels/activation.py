"""SiLU(gate) * up built from exp and IEEE arithmetic only.

torch's fused `F.silu` / `torch.sigmoid` give different bits for the same input depending on
whether it lands in the vectorised body or the scalar tail of the loop, i.e. on the tensor's
shape (measured here: ~0.1 % of fp32 inputs). `exp`, `+`, `*` and `/` do not, so a sigmoid written
with them is batch-invariant: the "native SiLU" of the Ascend recipe.
"""

import torch


def _silu(g: torch.Tensor) -> torch.Tensor:
    """g / (1 + exp(-g)) for fp32 g; the sum is made in place (the same bits, one temporary fewer)."""
    return g / torch.exp(-g).add_(1.0)


class _SiluMul(torch.autograd.Function):
    """silu_mul, differentiated by hand: d up = g * silu(gate), d gate = silu'(gate) * g * up (torch's
    silu_backward, elementwise and deterministic; only the forward needs bits no shape can change), each in
    fp32 and rounded once: 7 passes where autograd through the forward's ops took 14."""

    @staticmethod
    def forward(ctx, gate, up):
        silu = _silu(gate.float())
        ctx.save_for_backward(gate, up, silu)
        return (silu * up).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad):
        gate, up, silu = ctx.saved_tensors
        grad = grad.float()
        d_gate = torch.ops.aten.silu_backward(grad * up, gate.float()).to(gate.dtype)
        return d_gate, (grad * silu).to(up.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once to the inputs' dtype. `up` is widened inside the multiply, by type
    promotion: the bits of an fp32 copy, without one. Differentiable."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return (_silu(gate.float()) * up).to(gate.dtype)


def fused_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What most stacks call: torch's fused SiLU in the model dtype."""
    return torch.nn.functional.silu(gate) * up
