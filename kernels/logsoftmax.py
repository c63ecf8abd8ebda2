"""Token log-probs: fp32, max-shifted, `s - log(sum(exp(s)))`, the same formula on both sides.

Temperature divides the fp32 logits first; temperature 0 (greedy) scores the plain distribution,
as temperature 1 (dividing by 1.0 is exact). The sum over the vocabulary is taken in chunks of VOCAB_CHUNK: torch splits one long
reduction across threads when few rows share the call (measured: a 151936-wide row sums to other
bits alone than among 64 rows), while a chunk-sized reduction always runs in one piece.
"""

import torch
import torch.nn.functional as F

VOCAB_CHUNK = 4096


def scoring_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """The temperature a log-prob is scored at: a greedy (0) token scores at 1."""
    return torch.where(temperature > 0, temperature, 1.0)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log p(targets[i] | row i) for logits [N, V] at per-row temperatures [N]; fp32 [N]."""
    x = logits.float() / scoring_temperature(temperature)[:, None]
    shifted = x - x.amax(-1, keepdim=True)
    total = _chunked_sum(torch.exp(shifted))
    return shifted.gather(1, targets[:, None]).squeeze(1) - torch.log(total)


def _chunked_sum(x: torch.Tensor) -> torch.Tensor:
    padded = F.pad(x, (0, -x.shape[1] % VOCAB_CHUNK))
    return padded.view(x.shape[0], -1, VOCAB_CHUNK).sum(-1).sum(-1)


def fused_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """torch's fused log_softmax in fp32: what most trainers and samplers call."""
    logp = F.log_softmax(logits.float() / scoring_temperature(temperature)[:, None], dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1)
