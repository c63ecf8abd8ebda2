"""The reference aligned kernels: the four alignments on, every op batch-invariant."""

from __future__ import annotations

from functools import partial

from logdiff.kernels.activation import silu_mul
from logdiff.kernels.attention import Alignments, rollout_attention, train_attention
from logdiff.kernels.gemm import grouped_linear
from logdiff.kernels.linear import fixed_order_row_linear, linear, row_tiled_linear, weight_layout
from logdiff.kernels.logsoftmax import fixed_order_token_logprobs, token_logprobs
from logdiff.kernels.moe import combine, grouped_experts, route
from logdiff.kernels.norm import rms_norm
from logdiff.kernels.rope import rope
from logdiff.kernels.sampling import sample
from logdiff.kernelset import KernelSet

__all__ = ["Alignments", "reference_kernels"]


def reference_kernels(align: Alignments = Alignments(), name: str = "reference") -> KernelSet:
    # `order` also covers the GEMMs: a reduction may not depend on how many rows share the call.
    gemm = linear if align.order else row_tiled_linear

    return KernelSet(
        name=name,
        inference_weight=weight_layout,
        linear=gemm,
        rms_norm=rms_norm,
        act=silu_mul,
        rope=rope,
        train_attention=partial(train_attention, align=align),
        rollout_attention=partial(rollout_attention, align=align),
        route=route,
        experts=partial(grouped_experts, linear=gemm, act=silu_mul, grouped_linear=grouped_linear if align.order else None),
        combine=combine,
        # The fixed vocabulary order is a change of the one-process sum too, so it is the reduce_order switch.
        token_logprobs=fixed_order_token_logprobs if align.reduce_order else token_logprobs,
        sample=sample,
        row_linear=fixed_order_row_linear if align.reduce_order else None,
        vocab_logprobs=fixed_order_token_logprobs if align.reduce_order else None,
        devices=("cpu",),  # logdiff's order-fixed GEMM is a CPU extension (kernels/csrc)
    )
