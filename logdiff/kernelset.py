"""What a kernel set provides: the ops the one model definition runs with, on both paths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from logdiff.comm import SINGLE_PROCESS, Comm


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

    Parallel execution (logdiff.parallel): `tp` and `ep` are the collectives over the ranks that share a
    tensor-parallel layer and the expert layers (`SINGLE_PROCESS`: one process, every collective the
    identity). A row-parallel GEMM ends in `row_linear(x [N, K/tp], w [out, K/tp], tp) -> [N, out]`;
    None: `linear` on the shard, then the backend's native all_reduce (whose order follows the degree).
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
    row_linear: Callable | None = None
    tp: Comm = SINGLE_PROCESS
    ep: Comm = SINGLE_PROCESS

    def row_parallel(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The GEMM of a row-parallel layer (o_proj, down_proj): K is sharded over `tp`, the result whole."""
        if self.row_linear is not None:
            return self.row_linear(x, w, self.tp)
        return self.tp.all_reduce(self.linear(x, w))

    def vocab_parallel_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] from a vocab-parallel lm_head (rows V/tp per rank): each rank's columns, gathered."""
        return self.tp.all_gather(self.linear(hidden, lm_head), dim=-1)

    def expert_parallel(self, x, ids, gate_up, down) -> torch.Tensor:
        """`experts` with the experts sharded over `ep` (gate_up/down hold this rank's E/ep experts)."""
        if self.ep.size == 1:
            return self.experts(x, ids, gate_up, down)
        from logdiff.kernels.moe import dispatch_experts

        return dispatch_experts(self.experts, self.ep, x, ids, gate_up, down)
