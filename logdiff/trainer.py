"""The trainer path: one teacher-forced forward over whole sequences, returning per-token log-probs.

Differentiable: with `grad=True` the log-probs carry autograd history back to the parameters, as a
policy-gradient loss needs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from logdiff.batch import SeqBatch, check_score_from
from logdiff.capture import locate
from logdiff.kernelset import KernelSet
from logdiff.model import Capture, Qwen3ForCausalLM


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
    ) -> list[torch.Tensor]:
        """Packed batch: for each sequence, log p(token i | tokens < i) for i in [score_from, len).

        Temperature 0 (greedy rollout) scores at temperature 1.
        """
        check_score_from(sequences, score_from)
        seqs = SeqBatch.from_lengths([len(s) for s in sequences])
        tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        # Row offsets[s] + i - 1 predicts token i of sequence s.
        rows, targets, temps, counts = [], [], [], []
        for s, (seq, first, temp) in enumerate(zip(sequences, score_from, temperatures)):
            base = int(seqs.offsets[s])
            rows.append(torch.arange(base + first - 1, base + len(seq) - 1))
            targets.append(torch.as_tensor(seq[first:], dtype=torch.long))
            temps.append(torch.full((len(seq) - first,), float(temp)))
            counts.append(len(seq) - first)
        if capture:
            locate(capture, seqs.seq_of_token, seqs.positions, torch.cat(rows))
        with torch.set_grad_enabled(grad):
            ops = self.ops

            def attend(layer, q, k, v):
                return ops.train_attention(q, k, v, seqs)

            hidden = self.model.hidden_states(tokens, seqs, ops, attend, capture)
            logits = self.model.logits(hidden[torch.cat(rows)], ops, capture)
            logp = ops.token_logprobs(logits, torch.cat(targets), torch.cat(temps))
        if capture:
            capture("logprob", logp)
        return list(logp.split(counts))

    def logprobs_padded(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, score_mask: torch.Tensor, temperature: float = 1.0,
        grad: bool = False,
    ) -> torch.Tensor:
        """Padded batch, verl-style: `attention_mask` marks real tokens (left and/or right padding),
        `score_mask` the tokens to score. Returns [B, T] log-probs, 0 where not scored."""
        sequences, score_from = [], []
        for ids, real, scored in zip(input_ids, attention_mask.bool(), score_mask.bool()):
            kept = ids[real]
            scored_real = scored[real].nonzero()
            if len(scored_real) == 0 or not bool(scored[real][int(scored_real[0]) :].all()):
                raise ValueError("score_mask must mark one contiguous suffix of each sequence's real tokens")
            sequences.append(kept.tolist())
            score_from.append(int(scored_real[0]))
        flat = self.logprobs(sequences, score_from, [temperature] * len(sequences), grad=grad)
        mask = score_mask.bool() & attention_mask.bool()
        return torch.zeros(input_ids.shape).masked_scatter(mask, torch.cat(flat))
