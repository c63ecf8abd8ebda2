"""Kernel-level cases at the real shapes of one qwen3-30b-a3b layer, kernel set against kernel set.

Attention: 32 query / 4 KV heads, head_dim 128, 2048-token prompts and 2048-token responses, so
`max_model_len` is 4096 (the span of naive's single block):
  attn-train    teacher-forced attention over one whole sequence, 2048 + 2048 = 4096 tokens (forward)
  attn-prefill  one 2048-token prompt against the paged cache (KV page 128)
  attn-decode   one token for each of 16 sequences at context 3072, the mean context of the response
MoE (hidden 2048, 128 experts, top-8, expert width 768): router GEMM, routing, experts, combine:
  moe-decode    32 tokens (a decode step at batch 32)
  moe-layer     512 tokens (a trainer or prefill micro-batch)
Sizes are chosen for a 2-core, 24 GiB machine: naive's attn-train materialises 4 x 32768 x 4096 fp32
scores (2 GiB per temporary), the MoE weights take 1.2 GiB in bf16.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from logdiff.batch import SeqBatch
from logdiff.config import NAMED_CONFIGS
from logdiff.kernelset import KernelSet
from logdiff.stacks import builtin_kernel_sets

SHAPES = NAMED_CONFIGS["qwen3-30b-a3b"]
PROMPT, RESPONSE, PAGE = 2048, 2048, 128
MAX_MODEL_LEN = PROMPT + RESPONSE


def kernel_set(name: str) -> KernelSet:
    make, _ = builtin_kernel_sets()[name]
    return make(MAX_MODEL_LEN)


@dataclass(frozen=True)
class KernelCase:
    describe: str
    tokens: int  # tokens/s counts these
    inputs: Callable[[torch.dtype], dict]
    run: Callable[[KernelSet, dict], torch.Tensor]


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _qkv(n: int, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = SHAPES
    return (_randn(n, c.num_attention_heads, c.head_dim, dtype=dtype, seed=1),
            _randn(n, c.num_key_value_heads, c.head_dim, dtype=dtype, seed=2),
            _randn(n, c.num_key_value_heads, c.head_dim, dtype=dtype, seed=3))


def _train_inputs(dtype) -> dict:
    q, k, v = _qkv(MAX_MODEL_LEN, dtype)
    return {"q": q, "k": k, "v": v, "seqs": SeqBatch.from_lengths([MAX_MODEL_LEN])}


def _paged_inputs(dtype, num_seqs: int, context: int, new_per_seq: int) -> dict:
    """A cache holding `context` positions of each sequence (pages in order), and the new tokens' queries."""
    c = SHAPES
    pages_per_seq = -(-MAX_MODEL_LEN // PAGE)
    slots = num_seqs * pages_per_seq * PAGE
    positions = torch.arange(context)
    table = torch.stack([(s * pages_per_seq + positions // PAGE) * PAGE + positions % PAGE for s in range(num_seqs)])
    q, _, _ = _qkv(num_seqs * new_per_seq, dtype)
    return {
        "q": q,
        "k_cache": _randn(c.num_key_value_heads, slots, c.head_dim, dtype=dtype, seed=4),
        "v_cache": _randn(c.num_key_value_heads, slots, c.head_dim, dtype=dtype, seed=5),
        "seqs": SeqBatch.from_lengths([new_per_seq] * num_seqs, [context - new_per_seq] * num_seqs),
        "slots": table,
    }


def _moe_inputs(dtype, tokens: int) -> dict:
    c = SHAPES
    h, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
    return {
        "x": _randn(tokens, h, dtype=dtype, seed=6),
        "router": (_randn(e, h, dtype=torch.float32, seed=7) / h**0.5).to(dtype),
        "gate_up": (_randn(e, 2 * i, h, dtype=torch.float32, seed=8) / h**0.5).to(dtype),
        "down": (_randn(e, h, i, dtype=torch.float32, seed=9) / i**0.5).to(dtype),
    }


def _attend_train(ops: KernelSet, x: dict) -> torch.Tensor:
    return ops.train_attention(x["q"], x["k"], x["v"], x["seqs"])


def _attend_rollout(ops: KernelSet, x: dict) -> torch.Tensor:
    return ops.rollout_attention(x["q"], x["k_cache"], x["v_cache"], x["seqs"], x["slots"])


def _moe(ops: KernelSet, x: dict) -> torch.Tensor:
    c = SHAPES
    ids, weights = ops.route(ops.linear(x["x"], x["router"]), c.num_experts_per_tok, c.norm_topk_prob)
    return ops.combine(ops.experts(x["x"], ids, x["gate_up"], x["down"]), weights)


KERNEL_CASES: dict[str, KernelCase] = {
    "attn-train": KernelCase(f"attention, 1 x {MAX_MODEL_LEN} tokens, 32q/4kv heads x 128", MAX_MODEL_LEN,
                             _train_inputs, _attend_train),
    "attn-prefill": KernelCase(f"attention, one {PROMPT}-token prompt, paged cache", PROMPT,
                               lambda dt: _paged_inputs(dt, 1, PROMPT, PROMPT), _attend_rollout),
    "attn-decode": KernelCase("paged decode attention, 16 sequences at context 3072", 16,
                              lambda dt: _paged_inputs(dt, 16, PROMPT + RESPONSE // 2, 1), _attend_rollout),
    "moe-decode": KernelCase("MoE layer, 32 tokens, 128 experts top-8, 2048 -> 768", 32,
                             lambda dt: _moe_inputs(dt, 32), _moe),
    "moe-layer": KernelCase("MoE layer, 512 tokens, 128 experts top-8, 2048 -> 768", 512,
                            lambda dt: _moe_inputs(dt, 512), _moe),
}


@torch.no_grad()
def measure_kernel(case: KernelCase, stack: str, inputs: dict) -> tuple[float, torch.Tensor]:
    """Seconds of one call of the case on `stack`'s kernel set, and its output."""
    ops = kernel_set(stack)
    start = time.perf_counter()
    out = case.run(ops, inputs)
    return time.perf_counter() - start, out
