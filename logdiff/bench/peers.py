"""Published slowdowns of batch-invariant / bitwise-consistent modes, each measured by its authors on
their own hardware and model. `logdiff bench` prints them beside its own ratios for context only: they
are not comparable to a measurement on this machine.

`slowdown` is consistent-mode time over the default mode's time (>1 = slower), as each source states
it or as it follows from the stated percentage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PeerFigure:
    who: str
    what: str
    slowdown: float
    hardware: str
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


PEER_FIGURES = (
    PeerFigure("vLLM", "batch-invariant mode, eager", 2.27, "H100, Qwen3-1.7B",
               "vLLM batch-invariance docs / RFC (VLLM_BATCH_INVARIANT=1)"),
    PeerFigure("Thinking Machines", "batch-invariant vLLM before / after their attention fix", 1.62, "their GPUs",
               "Thinking Machines Lab, 'Defeating Nondeterminism in LLM Inference' (2.12x -> 1.62x)"),
    PeerFigure("TorchTitan + vLLM", "bitwise-identical RL, end to end", 2.4, "their GPUs",
               "PyTorch blog on bitwise-exact RL with TorchTitan and vLLM (trainer alone 2.9x)"),
    PeerFigure("TorchTitan + vLLM", "bitwise-identical RL, trainer", 2.9, "their GPUs",
               "PyTorch blog on bitwise-exact RL with TorchTitan and vLLM"),
    PeerFigure("SGLang", "deterministic inference, average latency", 1.34, "their GPUs",
               "SGLang deterministic inference announcement (+34 % average)"),
    PeerFigure("Miles", "true on-policy training cost", 1.30, "their GPUs",
               "Miles / slime true on-policy write-up (~30 % training cost)"),
    PeerFigure("VeXact", "bitwise RL stack", 1.82, "their GPUs", "VeXact paper, arXiv 2605.14220"),
)

# The seed's claim: aligned kernels run 1.2-1.6x as fast as their (unstated) consistent baseline.
CLAIMED_SPEEDUP = (1.2, 1.6)
CLAIM_SOURCE = "Huawei Ascend verl true_on_policy recipe (Qwen3-30B-A3B, Eager mode), baseline not stated"
