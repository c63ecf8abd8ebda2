"""What a kernel set provides: the ops the one model definition runs with, on both paths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KernelSet:
    """The model calls nothing else; a stack's kernel set decides every bit of its log-probs.

    gemm_dtype(model dtype) -> the dtype GEMM weights are read in (the engine stores its copy so)
    linear(x [N, in], w [out, in]) -> [N, out] in x's dtype
    rms_norm(x, weight, eps)
    act(gate, up) -> silu(gate) * up
    rope(x [N, heads, d], cos, sin [N, d] fp32) -> x rotated, in x's dtype
    train_attention(q [N, Hq, d], k, v [N, Hkv, d], seqs) -> [N, Hq, d]
    rollout_attention(q, k_cache, v_cache [Hkv, slots, d], seqs, slots [S, L]) -> [N, Hq, d]
    route(router_logits [N, E], top_k, norm_topk_prob) -> ids [N, k], fp32 weights [N, k]
    experts(x [N, H], ids [N, k], gate_up [E, 2I, H], down [E, H, I]) -> [N, k, H]: expert ids[t, r] on token t
    combine(expert_out [N, k, H], weights [N, k]) -> [N, H]
    token_logprobs(logits [N, V], targets [N], temperature [N]) -> fp32 [N]; temperature 0 scores at 1
    sample(logits [S, V], temperature [S], seeds [S], token_index [S]) -> tokens [S]
    """

    name: str
    gemm_dtype: Callable
    linear: Callable
    rms_norm: Callable
    act: Callable
    rope: Callable
    train_attention: Callable
    rollout_attention: Callable
    route: Callable
    experts: Callable
    combine: Callable
    token_logprobs: Callable
    sample: Callable
