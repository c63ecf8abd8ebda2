"""`baseline`: what a fast, unaligned stack does, on the same model and engine.

Trainer and prefill attention are torch's fused SDPA over a padded batch; decode is a split-KV paged
attention whose split count depends on batch and length; GEMMs run at whatever row count they get
(GEMV for one decode row), the experts grouped like the reference's but each at its own row count;
SiLU, softmax, top-k and log-softmax are torch's fused ops; the MoE combine sums in the model dtype.
"""

from functools import partial

import torch
import torch.nn.functional as F

from logdiff.kernels import sampling
from logdiff.kernels.activation import fused_silu_mul
from logdiff.kernels.attention import Alignments, decode_attention
from logdiff.kernels.linear import native_gemm_dtype, plain_linear
from logdiff.kernels.logsoftmax import fused_token_logprobs
from logdiff.kernels.moe import grouped_experts
from logdiff.kernels.norm import rms_norm_in_torch
from logdiff.kernels.rope import rope_in_torch
from logdiff.kernelset import KernelSet

_SPLIT_KV = Alignments(order=False)


def _sdpa(q, k, v, q_pos, key_len):
    """q [S, Hq, T, d], k/v [S, Hkv, L, d]; query at q_pos [S, T] sees keys < min(q_pos + 1, key_len)."""
    keys = torch.arange(k.shape[2])
    mask = (keys <= q_pos[..., None]) & (keys < key_len[:, None, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


def _padded(x, index):
    """Packed [N, H, d] -> [S, H, T, d] by a padded index (N = a zero row)."""
    return F.pad(x, (0, 0, 0, 0, 0, 1))[index].transpose(1, 2)


def _packed(out, index, num_tokens):
    flat = out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])
    return flat[(index.flatten() < num_tokens).nonzero().squeeze(1)]


def sdpa_train_attention(q, k, v, seqs):
    index = seqs.padded_index()
    q_pos = torch.arange(index.shape[1]).expand(seqs.num_seqs, -1)
    out = _sdpa(_padded(q, index), _padded(k, index), _padded(v, index), q_pos, seqs.lengths)
    return _packed(out, index, seqs.num_tokens)


def baseline_rollout_attention(q, k_cache, v_cache, seqs, slots):
    if seqs.is_decode:
        return decode_attention(q, k_cache, v_cache, seqs, slots, _SPLIT_KV)
    index = seqs.padded_index()
    q_pos = seqs.starts[:, None] + torch.arange(index.shape[1])
    keys = k_cache[:, slots].permute(1, 0, 2, 3)  # [S, Hkv, L, d]
    values = v_cache[:, slots].permute(1, 0, 2, 3)
    out = _sdpa(_padded(q, index), keys, values, q_pos, seqs.starts + seqs.lengths)
    return _packed(out, index, seqs.num_tokens)


def fused_route(router_logits, top_k, norm_topk_prob):
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def model_dtype_combine(expert_out, weights):
    return (expert_out * weights.to(expert_out.dtype)[..., None]).sum(1)


def _native_weight(w):
    """The engine's weights in the dtype torch's GEMM runs in, stored as they come."""
    return w.to(native_gemm_dtype(w.dtype))


def baseline_kernels() -> KernelSet:
    """fast unaligned stack: fused SDPA, split-KV decode, GEMV decode, fused ops"""
    return KernelSet(
        name="baseline",
        inference_weight=_native_weight,
        linear=plain_linear,
        rms_norm=rms_norm_in_torch,
        act=fused_silu_mul,
        rope=rope_in_torch,
        train_attention=sdpa_train_attention,
        rollout_attention=baseline_rollout_attention,
        route=fused_route,
        experts=partial(grouped_experts, linear=plain_linear, act=fused_silu_mul),
        combine=model_dtype_combine,
        token_logprobs=fused_token_logprobs,
        sample=sampling.sample,
    )
