"""What a kernel set provides: the ops the one model definition runs with, on both paths."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch

from logdiff.api import Processing
from logdiff.comm import SINGLE_PROCESS, Comm


@dataclass(frozen=True)
class KernelSet:
    """The model calls nothing else; a stack's kernel set decides every bit of its log-probs.

    inference_weight(w [.., out, in]) -> the rollout engine's stored copy of a GEMM weight (dtype, layout)
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
    compute_dtype: the dtype of the activations (the embedding rows are cast to it; the ops take weights as
        stored); None: the weights' own. The fp64 oracle's is float64 on weights as the stack stores them.
    devices: the kinds of torch device (logdiff.devices.KINDS) the set has order-fixed kernels for; a stack
        asked to run elsewhere declines. None: any device torch runs its ops on (sets that fix no order).

    Parallel execution (logdiff.parallel): `tp` and `ep` are the collectives over the ranks that share a
    tensor-parallel layer and the expert layers (`SINGLE_PROCESS`: one process, every collective the
    identity). A row-parallel GEMM ends in `row_linear(x [N, K/tp], w [out, K/tp], tp) -> [N, out]`;
    None: `linear` on the shard, then the backend's native all_reduce (whose order follows the degree).
    The lm_head is vocab-parallel and so is the log-softmax: `vocab_logprobs(logits [N, V/tp], targets [N],
    temperature [N], tp) -> fp32 [N]` scores this rank's vocabulary slice (it runs on one process too, so
    TP1 computes what TP2 and TP4 do); None: `token_logprobs` on one process, and on several the max
    gathered and each rank's sum of exp added by the backend's native all_reduce.
    """

    name: str
    inference_weight: Callable
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
    vocab_logprobs: Callable | None = None
    tp: Comm = SINGLE_PROCESS
    ep: Comm = SINGLE_PROCESS
    compute_dtype: torch.dtype | None = None
    devices: tuple[str, ...] | None = None

    def row_parallel(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The GEMM of a row-parallel layer (o_proj, down_proj): K is sharded over `tp`, the result whole."""
        if self.row_linear is not None:
            return self.row_linear(x, w, self.tp)
        return self.tp.all_reduce(self.linear(x, w))

    def vocab_parallel_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """`token_logprobs` from the logits [N, V/tp] of this rank's vocabulary slice (targets: ids in the whole V)."""
        if self.vocab_logprobs is not None:
            return self.vocab_logprobs(logits, targets, temperature, self.tp)
        if self.tp.size == 1:
            return self.token_logprobs(logits, targets, temperature)
        from logdiff.kernels.logsoftmax import native_vocab_parallel_logprobs

        return native_vocab_parallel_logprobs(logits, targets, temperature, self.tp)

    def vocab_parallel_sample(self, logits: torch.Tensor, temperature, seeds, token_index) -> torch.Tensor:
        """`sample` from the logits [S, V/tp] of this rank's vocabulary slice. A sampler draws from the whole
        distribution, so the slices are gathered first (a copy: the same logits bit for bit on every rank and
        degree; S rows, once per engine step); the log-prob of the drawn token stays vocab-parallel."""
        return self.sample(self.tp.all_gather(logits, dim=-1), temperature, seeds, token_index)

    def truncated(self, logits: torch.Tensor, temperature: torch.Tensor, processing: Sequence[Processing]) -> torch.Tensor:
        """The logits [N, V/tp] with every token outside its row's kept set at -inf (`kept_tokens`, decided
        on the whole row: the slices gathered, so every degree keeps the same set); `logits` itself where
        no row truncates. Row i follows processing[i]."""
        if not any(p.truncates for p in processing):
            return logits
        from logdiff.kernels.sampling import kept_tokens

        keep = kept_tokens(self.tp.all_gather(logits, dim=-1), temperature,
                           torch.tensor([p.top_k for p in processing]),
                           torch.tensor([p.top_p for p in processing], dtype=torch.float32),
                           torch.tensor([p.min_p for p in processing], dtype=torch.float32))
        width = logits.shape[-1]
        return logits.masked_fill(~keep[:, self.tp.rank * width : (self.tp.rank + 1) * width], float("-inf"))

    def mode_logprobs(self, logits: torch.Tensor, truncated: torch.Tensor, targets: torch.Tensor,
                      temperature: torch.Tensor, processing: Sequence[Processing]) -> torch.Tensor:
        """Each row's token log-prob in its mode: "processed" from the `truncated` logits at its temperature
        (a token outside the kept set scores -inf), "raw" from the `logits` at temperature 1."""
        raw = torch.tensor([p.logprobs_mode == "raw" for p in processing], dtype=torch.bool)
        if raw.any():
            truncated = torch.where(raw[:, None], logits, truncated)
            temperature = torch.where(raw, 1.0, temperature)
        return self.vocab_parallel_logprobs(truncated, targets, temperature)

    def provenance(self) -> dict:
        """What this kernel set runs, as every report names it: each op's function (a partial with its settings),
        the GEMM backend, both attention paths, and the alignments (logdiff.kernels.Alignments) switched off."""
        ops = {f.name: op_name(getattr(self, f.name)) for f in dataclasses.fields(self)
               if f.name not in ("name", "tp", "ep", "devices") and getattr(self, f.name) is not None}
        align = next((fn.keywords["align"] for fn in (self.train_attention, self.rollout_attention)
                      if isinstance(fn, partial) and "align" in fn.keywords), None)
        alignments = dataclasses.asdict(align) if align is not None else None
        return {
            "gemm": getattr(self.linear, "gemm_backend", ops["linear"]),
            "attention": {"trainer": short_op_name(self.train_attention), "rollout": short_op_name(self.rollout_attention)},
            "alignments": alignments,
            "switched_off": [a for a, on in (alignments or {}).items() if not on],
            "devices": list(self.devices) if self.devices is not None else None,
            "ops": ops,
        }

    def collectives(self) -> dict[str, str]:
        """Capture point (logdiff.bisect.capture) -> the collective its op ends in on these ranks; none on
        one process. `logdiff bisect` names it when that point is the first to differ."""
        named = {}
        if self.tp.size > 1:
            reduction = ("all_gather of fixed K-chunk partial sums, added in chunk order (ordered row-parallel reduction)"
                         if self.row_linear else "all_reduce (row-parallel reduction)")
            named.update({"o_proj": f"attention o_proj {reduction}", "mlp": f"mlp down_proj {reduction}"})
            total = ("all_gather of fixed vocabulary-part sums of exp, added in vocabulary order" if self.vocab_logprobs
                     else "all_reduce of the sum of exp")
            named["logprob"] = f"vocab-parallel log-softmax: all_gather of the row max, {total}, target logit from its rank"
        if self.ep.size > 1:
            named["experts"] = "experts all_to_all dispatch and return, all_gather of the outputs (expert parallelism)"
        return named

    def expert_parallel(self, x, ids, gate_up, down) -> torch.Tensor:
        """`experts` with the experts sharded over `ep` (gate_up/down hold this rank's E/ep experts)."""
        if self.ep.size == 1:
            return self.experts(x, ids, gate_up, down)
        from logdiff.kernels.moe import dispatch_experts

        return dispatch_experts(self.experts, self.ep, x, ids, gate_up, down)


def op_name(fn) -> str:
    """`module.function` of an op, a partial's settings after it, e.g. `...attention.train_attention(align=...)`."""
    if isinstance(fn, partial):
        settings = ", ".join(f"{k}={op_name(v) if callable(v) else v!r}" for k, v in fn.keywords.items())
        return f"{op_name(fn.func)}({settings})"
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def short_op_name(fn) -> str:
    """The function's own name, for one-line reports: `train_attention`."""
    return short_op_name(fn.func) if isinstance(fn, partial) else getattr(fn, "__name__", type(fn).__name__)
