"""`naive`: the best straightforward implementation that is consistent, the yardstick of the speed-up claim.

Consistency comes from doing the simplest thing identically on both sides, not from aligned block
kernels: attention is one materialised masked softmax over the whole cache (`max_model_len` keys in
a single block), for the trainer and for every decode step alike, as a static-cache engine does.
The other ops are the same batch-invariant ops as `reference`, vectorised across the batch, and the
MoE is a plain loop over the experts that received tokens. Nothing is slowed down on purpose: the
work it does beyond `reference` is the work the straightforward formulation implies.
"""

from functools import partial

from logdiff.kernels import Alignments, reference_kernels
from logdiff.kernels.attention import rollout_attention, train_attention
from logdiff.kernels.moe import run_experts
from logdiff.kernelset import KernelSet

_ALIGNED = Alignments()


def naive_kernels(max_model_len: int) -> KernelSet:
    """consistent but straightforward: masked softmax over the whole cache, expert-loop MoE"""
    ref = reference_kernels()
    return KernelSet(
        name="naive",
        inference_weight=ref.inference_weight,
        linear=ref.linear,
        rms_norm=ref.rms_norm,
        act=ref.act,
        rope=ref.rope,
        train_attention=partial(train_attention, align=_ALIGNED, block=max_model_len, recompute=False),
        rollout_attention=partial(rollout_attention, align=_ALIGNED, block=max_model_len),
        route=ref.route,
        experts=partial(run_experts, linear=ref.linear, act=ref.act),
        combine=ref.combine,
        token_logprobs=ref.token_logprobs,
        sample=ref.sample,
    )
