"""Stacks that are consistent but are not the model, and one tuned to the catalogue's fixed shapes: the
negative controls of verdict integrity. Each is what a real mistake or shortcut looks like."""

import dataclasses

import torch

from logdiff.api import EngineOptions, Processing, RolloutOutput, TrainerInputs
from logdiff.baselines.baseline import baseline_kernels
from logdiff.conformance.workloads import ABLATION_WORKLOADS, BLOCK_EDGES, WORKLOADS
from logdiff.kernels import Alignments, reference_kernels
from logdiff.kernels.attention import KV_BLOCK, _rollout
from logdiff.kernels.linear import linear as reference_linear
from logdiff.kernels.linear import split_k_linear
from logdiff.kernels.rope import RotaryTable
from logdiff.stacks import KernelStack


class ConstantStack(KernelStack):
    """rollout and trainer both report -1/temperature for every token (the tokens are really sampled)"""

    def rollout(self, requests, options=EngineOptions(), capture=None):
        outputs = super().rollout(requests, options, capture)
        return [RolloutOutput(o.tokens, torch.full((len(o.tokens),), -1.0 / (r.temperature or 1.0)))
                for r, o in zip(requests, outputs)]

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None):
        return [torch.full((len(s) - f,), -1.0 / (t or 1.0)) for s, f, t in zip(sequences, score_from, temperatures)]


def constant(spec, dtype, max_model_len):
    return ConstantStack(spec, dtype, max_model_len, reference_kernels(name="constant"))


def zero_attention(spec, dtype, max_model_len):
    """reference kernels whose attention returns zeros, on both paths"""
    ops = reference_kernels(name="zero-attention")
    ops = dataclasses.replace(ops, train_attention=lambda q, k, v, seqs: torch.zeros_like(q),
                              rollout_attention=lambda q, kc, vc, seqs, slots: torch.zeros_like(q))
    return KernelStack(spec, dtype, max_model_len, ops)


class EchoStack(KernelStack):
    """the trainer hands back what the rollout recorded ("old_log_probs = rollout_log_probs"); on sequences
    it has not rolled out it falls back to a fast unaligned trainer"""

    def __init__(self, spec, dtype, max_model_len):
        super().__init__(spec, dtype, max_model_len, reference_kernels(name="echo"))
        self.recorded = {}
        self.fallback = KernelStack(spec, dtype, max_model_len, baseline_kernels())

    def rollout(self, requests, options=EngineOptions(), capture=None):
        outputs = super().rollout(requests, options, capture)
        for r, o in zip(requests, outputs):
            self.recorded[tuple(r.prompt) + tuple(o.tokens)] = o.logprobs
        return outputs

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None):
        computed = self.fallback.trainer_logprobs(sequences, score_from, temperatures, grad)
        return [self.recorded.get(tuple(s), c) for s, c in zip(sequences, computed)]


def echo_without_capture(spec, dtype, max_model_len):
    """the echoing trainer in a stack that does not implement capture, as one wrapping a foreign engine may not"""
    stack = EchoStack(spec, dtype, max_model_len)
    stack.supports_capture = False
    return stack


class RoundingStack(KernelStack):
    """reference, with every log-prob rounded to a multiple of 1/16 on both paths"""

    def rollout(self, requests, options=EngineOptions(), capture=None):
        return [RolloutOutput(o.tokens, _round(o.logprobs)) for o in super().rollout(requests, options, capture)]

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None):
        return [_round(x) for x in super().trainer_logprobs(sequences, score_from, temperatures, grad, capture)]


def _round(x):
    return (x * 16).round() / 16


def rounding(spec, dtype, max_model_len):
    return RoundingStack(spec, dtype, max_model_len, reference_kernels(name="rounding"))


# Every prompt length of the catalogue's fixed workloads (C0's sampling prompts have 8 tokens).
FIXED_LENGTHS = set(BLOCK_EDGES) | {n for w in [*WORKLOADS.values(), *ABLATION_WORKLOADS.values()] for n in w.prompt_lens} | {
    3, 5, 8, 17, 20, 60, 64, 120, 140, 200, 250, 300}


class TunedStack(KernelStack):
    """aligned kernels on the prompt lengths of the catalogue's fixed workloads, the baseline's elsewhere"""

    def __init__(self, spec, dtype, max_model_len):
        super().__init__(spec, dtype, max_model_len, reference_kernels(name="tuned"))
        self.fast = KernelStack(spec, dtype, max_model_len, baseline_kernels())

    def _side(self, prompt_lens):
        return self if set(prompt_lens) <= FIXED_LENGTHS else self.fast

    def rollout(self, requests, options=EngineOptions(), capture=None):
        side = self._side(len(r.prompt) for r in requests)
        return KernelStack.rollout(side, requests, options, capture)

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None):
        side = self._side(score_from)
        return KernelStack.trainer_logprobs(side, sequences, score_from, temperatures, grad, capture)

    def prompt_logprobs(self, sequences, score_from, temperatures, options=EngineOptions()):
        return KernelStack.prompt_logprobs(self._side(score_from), sequences, score_from, temperatures, options)



class WrongTemperatureStack(KernelStack):
    """samples at the request's temperature T but records log-probs at T * T, on both paths (the trainer
    recomputes at T * T too): consistent, and right only at T = 1 and greedy"""

    def rollout(self, requests, options=EngineOptions(), capture=None):
        outputs = super().rollout(requests, options, capture)
        scored = TrainerInputs.after(requests, outputs)
        logprobs = self.trainer_logprobs(scored.sequences, scored.score_from, scored.temperatures)
        return [RolloutOutput(o.tokens, lp) for o, lp in zip(outputs, logprobs)]

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None):
        squared = [t * t for t in temperatures]
        return super().trainer_logprobs(sequences, score_from, squared, grad, capture)


def wrong_temperature(spec, dtype, max_model_len):
    return WrongTemperatureStack(spec, dtype, max_model_len, reference_kernels(name="wrong-temperature"))


class ModelDtypeLogprobStack(KernelStack):
    """reference, with every log-prob rounded to the model dtype (bf16/fp16) on both paths, then returned as fp32"""

    def rollout(self, requests, options=EngineOptions(), capture=None):
        return [RolloutOutput(o.tokens, self._in_model_dtype(o.logprobs)) for o in super().rollout(requests, options, capture)]

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None):
        return [self._in_model_dtype(x) for x in super().trainer_logprobs(sequences, score_from, temperatures, grad, capture)]

    def _in_model_dtype(self, x):
        return x.to(next(self.model.parameters()).dtype).float()


def model_dtype_logprobs(spec, dtype, max_model_len):
    return ModelDtypeLogprobStack(spec, dtype, max_model_len, reference_kernels(name="model-dtype-logprobs"))


def _split_k_past_2048_rows(x, w):
    """reference's GEMM, except that a call of more than 2048 rows adds two half-K partial products"""
    return reference_linear(x, w) if x.shape[:-1].numel() <= 2048 else split_k_linear(x, w)


def big_step_prefill(spec, dtype, max_model_len):
    """reference kernels whose GEMMs change their reduction once a forward holds more than 2048 tokens
    (a prefill step's kernel switch), on both paths"""
    ops = dataclasses.replace(reference_kernels(name="big-step-prefill"), linear=_split_k_past_2048_rows)
    return KernelStack(spec, dtype, max_model_len, ops)


# --------------------------------------------------------------------------- regimes: kernel switches the
# fixed edge workloads never reach (long contexts, large decode batches), as real engines switch there.

def _decode_attention_split_when(switch):
    """the reference's rollout attention, except that a decode step for which `switch(seqs, slots)` holds
    merges two KV partitions by log-sum-exp (a flash-decoding split)"""
    reference = reference_kernels().rollout_attention

    def attention(q, k_cache, v_cache, seqs, slots):
        if seqs.is_decode and switch(seqs, slots):
            return _rollout(q, k_cache, v_cache, seqs, slots, Alignments(), KV_BLOCK, splits=2)
        return reference(q, k_cache, v_cache, seqs, slots)

    return attention


def long_context_split(spec, dtype, max_model_len):
    """reference, whose decode splits the KV range in two once a context holds more than 2048 tokens"""
    ops = dataclasses.replace(reference_kernels(name="long-context-split"),
                              rollout_attention=_decode_attention_split_when(lambda seqs, slots: slots.shape[1] > 2048))
    return KernelStack(spec, dtype, max_model_len, ops)


def large_batch_split(spec, dtype, max_model_len):
    """reference, whose decode splits the KV range in two once a step decodes more than 48 sequences"""
    ops = dataclasses.replace(reference_kernels(name="large-batch-split"),
                              rollout_attention=_decode_attention_split_when(lambda seqs, slots: seqs.num_seqs > 48))
    return KernelStack(spec, dtype, max_model_len, ops)


# --------------------------------------------------------------------------- consistently the wrong model:
# rollout and trainer agree bit for bit, on a model that is not the checkpoint's.

def wrong_rope_base(spec, dtype, max_model_len):
    """reference, with rotary frequencies from base 10,000 (Qwen2's and Llama's) instead of the config's 1,000,000"""
    stack = KernelStack(spec, dtype, max_model_len, reference_kernels(name="wrong-rope-base"))
    c = stack.model.config
    for model in (stack.model, stack.engine_model):
        model.rope = RotaryTable(c.head_dim, 10_000.0, c.max_position_embeddings)
    return stack


def wrong_norm_eps(spec, dtype, max_model_len):
    """reference, whose RMSNorms add 1e-2 instead of the config's epsilon"""
    ops = reference_kernels(name="wrong-norm-eps")
    ops = dataclasses.replace(ops, rms_norm=lambda x, weight, eps: reference_kernels().rms_norm(x, weight, 1e-2))
    return KernelStack(spec, dtype, max_model_len, ops)


def dropped_layer(spec, dtype, max_model_len):
    """reference, without its last decoder layer (an off-by-one in a layer loop or a checkpoint loader)"""
    stack = KernelStack(spec, dtype, max_model_len, reference_kernels(name="dropped-layer"))
    for model in (stack.model, stack.engine_model):
        model.model.layers = model.model.layers[:-1]
    return stack


def truncated_routing(spec, dtype, max_model_len):
    """reference, routing each token to top-(k-1) experts instead of top-k"""
    ops = reference_kernels(name="truncated-routing")
    route = ops.route
    return KernelStack(spec, dtype, max_model_len,
                       dataclasses.replace(ops, route=lambda logits, top_k, norm: route(logits, top_k - 1, norm)))


class _ModelDtypeRotaryTable(RotaryTable):
    """cos/sin of angles whose positions and frequencies are the model dtype's (positions past 256 round in bf16)"""

    def __init__(self, head_dim, theta, max_positions, dtype):
        inv_freq = (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))).to(dtype)
        freqs = torch.arange(max_positions, dtype=dtype)[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1).float()
        self.cos, self.sin = angles.cos(), angles.sin()


def rope_angles_in_model_dtype(spec, dtype, max_model_len):
    """reference, with rotary angles computed in the model dtype (bf16/fp16), as a table built from
    `torch.arange(n, dtype=inv_freq.dtype)` does when inv_freq was cast with the model"""
    stack = KernelStack(spec, dtype, max_model_len, reference_kernels(name="rope-angles-in-model-dtype"))
    c = stack.model.config
    for model in (stack.model, stack.engine_model):
        model.rope = _ModelDtypeRotaryTable(c.head_dim, c.rope_theta, c.max_position_embeddings, dtype)
    return stack
class RawLogprobsStack(KernelStack):
    """samples from the processed distribution the requests ask for, but records raw log-probs (log_softmax at
    temperature 1, untruncated) on both paths while the requests ask for processed ones: consistent, and the
    importance ratio's behaviour probability is wrong (trl#6789's 0.17 at top_k=50)"""

    def rollout(self, requests, options=EngineOptions(), capture=None):
        outputs = super().rollout(requests, options, capture)
        scored = TrainerInputs.after(requests, outputs)
        logprobs = self.trainer_logprobs(scored.sequences, scored.score_from, scored.temperatures,
                                         processing=scored.processing)
        return [RolloutOutput(o.tokens, lp) for o, lp in zip(outputs, logprobs)]

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None, processing=None):
        raw = [dataclasses.replace(p, logprobs_mode="raw") for p in processing or [Processing()] * len(sequences)]
        return super().trainer_logprobs(sequences, score_from, temperatures, grad, capture, raw)


def raw_logprobs(spec, dtype, max_model_len):
    return RawLogprobsStack(spec, dtype, max_model_len, reference_kernels(name="raw-logprobs"))


def _untruncated(processing):
    return [Processing(logprobs_mode=p.logprobs_mode) for p in processing] if processing else None


class TrainerIgnoresTruncationStack(KernelStack):
    """the rollout samples and records as asked; the trainer scores without the truncation (it never learnt the
    rollout's top-k/top-p/min-p): truncation on one side only"""

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None, processing=None):
        return super().trainer_logprobs(sequences, score_from, temperatures, grad, capture, _untruncated(processing))


def trainer_ignores_truncation(spec, dtype, max_model_len):
    return TrainerIgnoresTruncationStack(spec, dtype, max_model_len, reference_kernels(name="trainer-ignores-truncation"))


class SamplerIgnoresTruncationStack(KernelStack):
    """the rollout engine drops the requests' truncation (samples and records from the whole tempered
    distribution); the trainer scores as asked: truncation on the other side only"""

    def rollout(self, requests, options=EngineOptions(), capture=None):
        plain = [dataclasses.replace(r, top_k=0, top_p=1.0, min_p=0.0) for r in requests]
        return super().rollout(plain, options, capture)


def sampler_ignores_truncation(spec, dtype, max_model_len):
    return SamplerIgnoresTruncationStack(spec, dtype, max_model_len, reference_kernels(name="sampler-ignores-truncation"))


class StaleSyncStack(KernelStack):
    """an engine that keeps the weights it started with: its weight sync does nothing"""

    def sync_weights(self):
        self._own_weights()


def stale_sync(spec, dtype, max_model_len):
    return StaleSyncStack(spec, dtype, max_model_len, reference_kernels(name="stale-sync"))


class LossySyncStack(KernelStack):
    """a weight sync through bf16 (a wire dtype below the model's): an fp32 engine runs a rounding away from its
    trainer after every sync, a step at learning rate 0 included"""

    @torch.no_grad()
    def sync_weights(self):
        super().sync_weights()
        for param in self.engine_model.parameters():
            param.copy_(param.to(torch.bfloat16))


def lossy_sync(spec, dtype, max_model_len):
    return LossySyncStack(spec, dtype, max_model_len, reference_kernels(name="lossy-sync"))
