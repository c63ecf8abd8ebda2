"""Qwen3 and Qwen3-MoE: the one model definition both the trainer and the rollout engine run.

Parameter names and shapes are those of transformers' `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`
(5.x, experts fused as `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]), so `state_dict()`
loads into a transformers model unchanged. Every op goes through a `KernelSet`; what differs between
the trainer and the rollout engine is only the `attend` callback (own keys vs paged cache) and the
layout of the tokens (`SeqBatch`).

Under tensor parallelism (logdiff.parallel) each rank runs this same code on its shard of the weights:
q/k/v and gate/up column-parallel, o/down row-parallel (`ops.row_parallel`), lm_head vocab-parallel (`logits`
are this rank's vocabulary slice; the callers score them with `ops.vocab_parallel_logprobs`), experts
sharded over the expert-parallel ranks (`ops.expert_parallel`).

`capture(name, tensor)`, when given, receives the inputs and the output of every named point of the
forward (`tokens`, `positions`, `embedding`, `layers.3.q_proj`, ..., `final_norm`, `logits`; the list,
in order, is `logdiff.bisect.capture.point_names`); `logdiff bisect` uses it. None costs a no-op call per point.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from logdiff.api import Capture
from logdiff.batch import SeqBatch
from logdiff.config import ModelConfig
from logdiff.kernels.rope import RotaryTable
from logdiff.kernelset import KernelSet

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size)


class Experts(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, c.moe_intermediate_size))


class SparseMoe(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate = Linear(c.hidden_size, c.num_experts)  # the router
        self.experts = Experts(c)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, index: int):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = SparseMoe(c) if c.layer_is_moe(index) else MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.rope = RotaryTable(config.head_dim, config.rope_theta, config.max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def hidden_states(
        self, tokens: torch.Tensor, seqs: SeqBatch, ops: KernelSet, attend: Attend, capture: Capture = None
    ) -> torch.Tensor:
        """Final-norm hidden states [N, H] of packed `tokens` [N]."""
        c = self.config
        cap = capture or _ignore
        positions = seqs.positions
        cos, sin = self.rope.at(positions)
        cap("tokens", tokens), cap("positions", positions)
        # An embedding gather, not `weight[tokens]`: the backward of advanced indexing accumulates repeated
        # tokens' rows in a thread-dependent order on CPU (not deterministic); embedding's backward is.
        x = nn.functional.embedding(tokens, self.model.embed_tokens.weight)
        if ops.compute_dtype is not None:
            x = x.to(ops.compute_dtype)
        cap("embedding", x)
        for i, layer in enumerate(self.model.layers):
            at = f"layers.{i}."
            attn = layer.self_attn
            h = ops.rms_norm(x, layer.input_layernorm.weight, c.rms_norm_eps)
            cap(at + "input_norm", h)
            q = ops.linear(h, attn.q_proj.weight)
            k = ops.linear(h, attn.k_proj.weight)
            v = ops.linear(h, attn.v_proj.weight)
            cap(at + "q_proj", q), cap(at + "k_proj", k), cap(at + "v_proj", v)
            q = ops.rms_norm(q.view(-1, c.num_attention_heads, c.head_dim), attn.q_norm.weight, c.rms_norm_eps)
            k = ops.rms_norm(k.view(-1, c.num_key_value_heads, c.head_dim), attn.k_norm.weight, c.rms_norm_eps)
            v = v.view(-1, c.num_key_value_heads, c.head_dim)
            cap(at + "q_norm", q), cap(at + "k_norm", k)
            q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
            cap(at + "rope_q", q), cap(at + "rope_k", k)
            o = attend(i, q, k, v).reshape(-1, c.num_attention_heads * c.head_dim)
            cap(at + "attention", o)
            o = ops.row_parallel(o, attn.o_proj.weight)
            cap(at + "o_proj", o)
            x = x + o
            cap(at + "residual", x)
            h = ops.rms_norm(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            cap(at + "post_attention_norm", h)
            x = x + self._mlp(layer.mlp, h, ops, cap, at)
            cap(at + "output", x)
        x = ops.rms_norm(x, self.model.norm.weight, c.rms_norm_eps)
        cap("final_norm", x)
        return x

    def _mlp(self, mlp, h, ops: KernelSet, cap, at: str) -> torch.Tensor:
        if isinstance(mlp, MLP):
            gate, up = ops.linear(h, mlp.gate_proj.weight), ops.linear(h, mlp.up_proj.weight)
            out = ops.row_parallel(ops.act(gate, up), mlp.down_proj.weight)
            cap(at + "mlp", out)
            return out
        c = self.config
        router_logits = ops.linear(h, mlp.gate.weight)
        cap(at + "router_logits", router_logits)
        ids, weights = ops.route(router_logits, c.num_experts_per_tok, c.norm_topk_prob)
        cap(at + "topk_ids", ids), cap(at + "topk_weights", weights)
        expert_out = ops.expert_parallel(h, ids, mlp.experts.gate_up_proj, mlp.experts.down_proj)
        cap(at + "experts", expert_out)
        out = ops.combine(expert_out, weights)
        cap(at + "combine", out)
        return out

    def logits(self, hidden: torch.Tensor, ops: KernelSet, capture: Capture = None) -> torch.Tensor:
        """[N, V/tp]: the logits of the vocabulary slice this rank's lm_head rows hold (all of V on one process)."""
        out = ops.linear(hidden, self.lm_head.weight)
        if capture:
            capture("logits", out)
        return out


def _ignore(name: str, tensor: torch.Tensor) -> None:
    pass
