"""SiLU(gate) * up built from exp and IEEE arithmetic only.

torch's fused `F.silu` / `torch.sigmoid` give different bits for the same input depending on
whether it lands in the vectorised body or the scalar tail of the loop, i.e. on the tensor's
shape (measured here: ~0.1 % of fp32 inputs). `exp`, `+`, `*` and `/` do not, so a sigmoid written
with them is batch-invariant: the "native SiLU" of the Ascend recipe.
"""

import torch


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once to the inputs' dtype. `up` is widened inside the multiply, by type
    promotion: the bits of an fp32 copy, without one."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up).to(gate.dtype)


def fused_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What most stacks call: torch's fused SiLU in the model dtype."""
    return torch.nn.functional.silu(gate) * up
