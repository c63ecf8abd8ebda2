"""The trainer path: one teacher-forced forward over whole sequences, returning per-token log-probs.

Differentiable: with `grad=True` the log-probs carry autograd history back to the parameters, as a
policy-gradient loss needs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from logdiff.api import Capture, Processing, locate
from logdiff.batch import SeqBatch, check_score_from
from logdiff.kernelset import KernelSet
from logdiff.model import Qwen3ForCausalLM

# Scored positions whose [rows, V] fp32 logits exist at once: a 2048-token response at vocabulary 151936
# would hold 1.2 GB of logits and as much again in the log-softmax. Every op of the head is row-wise, and
# the reference's GEMM gives a row the same bits at any M (kernels/gemm.py), so its log-probs do not change.
HEAD_ROWS = 256


class Trainer:
    def __init__(self, model: Qwen3ForCausalLM, ops: KernelSet):
        self.model = model
        self.ops = ops

    def logprobs(
        self,
        sequences: Sequence[Sequence[int]],
        score_from: Sequence[int],
        temperatures: Sequence[float],
        grad: bool = False,
        capture: Capture = None,
        processing: Sequence[Processing] | None = None,
    ) -> list[torch.Tensor]:
        """Packed batch: for each sequence, log p(token i | tokens < i) for i in [score_from, len).

        Temperature 0 (greedy rollout) scores at temperature 1. `processing` (one per sequence, default
        Processing()): the truncation the rollout sampled under, recomputed here from the trainer's own
        logits, and the log-prob mode each token is scored in.
        """
        processing = processing or [Processing()] * len(sequences)
        check_score_from(sequences, score_from)
        seqs = SeqBatch.from_lengths([len(s) for s in sequences])
        tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        # Row offsets[s] + i - 1 predicts token i of sequence s.
        rows, targets, temps, counts, row_processing = [], [], [], [], []
        for s, (seq, first, temp, proc) in enumerate(zip(sequences, score_from, temperatures, processing)):
            base = int(seqs.offsets[s])
            rows.append(torch.arange(base + first - 1, base + len(seq) - 1))
            targets.append(torch.as_tensor(seq[first:], dtype=torch.long))
            temps.append(torch.full((len(seq) - first,), float(temp)))
            counts.append(len(seq) - first)
            row_processing += [proc] * (len(seq) - first)
        if capture:
            locate(capture, seqs.seq_of_token, seqs.positions, torch.cat(rows))
        with torch.set_grad_enabled(grad):
            ops = self.ops

            def attend(layer, q, k, v):
                return ops.train_attention(q, k, v, seqs)

            hidden = self.model.hidden_states(tokens, seqs, ops, attend, capture)
            rows, targets, temps = torch.cat(rows), torch.cat(targets), torch.cat(temps)
            parts, logits_kept = [], []
            for first in range(0, len(rows), HEAD_ROWS):
                part = slice(first, first + HEAD_ROWS)
                logits = self.model.logits(hidden[rows[part]], ops)
                if capture:
                    logits_kept.append(logits)
                truncated = ops.truncated(logits, temps[part], row_processing[part])
                parts.append(ops.mode_logprobs(logits, truncated, targets[part], temps[part], row_processing[part]))
            logp = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
        if capture:
            capture("logits", torch.cat(logits_kept))
            capture("logprob", logp)
        return list(logp.split(counts))
