"""An example stack: a rollout "engine" without KV cache that re-runs the whole sequence through the
trainer's forward for every new token. Consistent by construction and slow by design: it shows the
Stack API, not a fast engine. Your stack wraps your own trainer and rollout engine the same way."""

import torch

from logdiff.api import EngineOptions, RolloutOutput, Stack, Unsupported
from logdiff.batch import SeqBatch
from logdiff.kernels import reference_kernels
from logdiff.trainer import Trainer


class RecomputeStack(Stack):
    """no-KV-cache rollout: every step re-runs the whole sequence through the trainer's forward"""

    name = "example"

    def __init__(self, spec, dtype, max_model_len):
        self.trainer = Trainer(spec.build(dtype), reference_kernels())  # the same weights as every stack

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, processing=None):
        # processing: each sequence's truncation and log-prob mode (logdiff.api.Processing), recomputed here
        return self.trainer.logprobs(sequences, score_from, temperatures, grad=grad, processing=processing)

    @torch.no_grad()
    def rollout(self, requests, options=EngineOptions()):
        if options != EngineOptions():  # declined: the suite reports those properties as skipped
            raise Unsupported("no paged KV cache, so no page size, chunked prefill or block tables")
        return [self._generate(r) for r in requests]

    def _generate(self, request):
        model, ops, tokens, logprobs = self.trainer.model, self.trainer.ops, list(request.prompt), []
        temperature, seed = torch.tensor([request.temperature]), torch.tensor([request.seed])
        for i in range(request.max_new_tokens):
            seqs = SeqBatch.from_lengths([len(tokens)])
            attend = lambda _, q, k, v, seqs=seqs: ops.train_attention(q, k, v, seqs)  # noqa: E731
            hidden = model.hidden_states(torch.tensor(tokens), seqs, ops, attend)
            logits = model.logits(hidden[-1:], ops)
            truncated = ops.truncated(logits, temperature, [request.processing])  # top-k/top-p/min-p: dropped at -inf
            token = ops.sample(truncated, temperature, seed, torch.tensor([i]))
            logprobs.append(ops.mode_logprobs(logits, truncated, token, temperature, [request.processing]))
            tokens.append(int(token))
        return RolloutOutput(tokens[len(request.prompt):], torch.cat(logprobs))
