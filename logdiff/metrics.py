"""Comparing rollout and trainer log-probs: the bitwise verdict, the first divergence, and the
figures RL frameworks log under their own names (verl debug + rollout_corr, slime/Miles)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch

# verl clamps log-ratios to +-SAFETY_BOUND before exponentiating (rollout_corr chi2).
SAFETY_BOUND = 20.0


def bits(x: torch.Tensor) -> torch.Tensor:
    """The IEEE bit pattern of each element, as integers: -0.0 != 0.0 and NaN payloads differ."""
    int_type = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return x.contiguous().view(int_type[x.dtype])


def hex_bits(value: torch.Tensor) -> str:
    width = value.element_size() * 2
    return f"0x{int(bits(value.reshape(1))[0]) & ((1 << (4 * width)) - 1):0{width}x}"


@dataclass(frozen=True)
class Divergence:
    seq: int
    pos: int  # index within the response
    rollout: float
    trainer: float
    rollout_bits: str
    trainer_bits: str

    def __str__(self) -> str:
        return (
            f"logprobs differ at seq {self.seq} pos {self.pos}: "
            f"{self.rollout_bits} ({self.rollout!r}) vs {self.trainer_bits} ({self.trainer!r})"
        )


@dataclass(frozen=True)
class Comparison:
    tokens: int
    bitwise_equal_tokens: int
    max_abs_logdiff: float
    mean_abs_logdiff: float
    first_divergence: Divergence | None
    metrics: dict[str, float]

    @property
    def verdict(self) -> str:
        return "pass" if self.bitwise_equal_tokens == self.tokens else "fail"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict
        return d


def first_divergence(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Divergence | None:
    """The first (sequence, position) whose bits differ, scanning sequences in order."""
    for s, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise ValueError(f"sequence {s}: {x.numel()} rollout log-probs vs {y.numel()} trainer log-probs")
        differ = (bits(x) != bits(y)).nonzero()
        if len(differ):
            p = int(differ[0])
            return Divergence(s, p, float(x[p]), float(y[p]), hex_bits(x[p]), hex_bits(y[p]))
    return None


def compare(rollout: Sequence[torch.Tensor], trainer: Sequence[torch.Tensor], metrics: dict | None = None) -> Comparison:
    """Per-token d = rollout - trainer over every response token of every sequence.

    `metrics` are the framework metrics when the caller holds the padded batch a framework logged them
    from (`logdiff analyze`): recomputed on another padding they could round differently. By default
    they come from these sequences right-padded with zeros.
    """
    divergence = first_divergence(rollout, trainer)
    r, t = torch.cat(list(rollout)).float(), torch.cat(list(trainer)).float()
    equal = int((bits(r) == bits(t)).sum())
    diff = (r - t).abs()
    if metrics is None:
        metrics = framework_metrics(
            old_log_prob=pad_sequences(trainer), rollout_log_prob=pad_sequences(rollout), response_mask=response_mask(rollout)
        )
    return Comparison(
        tokens=r.numel(),
        bitwise_equal_tokens=equal,
        max_abs_logdiff=float(diff.max()) if r.numel() else 0.0,
        mean_abs_logdiff=float(diff.mean()) if r.numel() else 0.0,
        first_divergence=divergence,
        metrics=metrics,
    )


def pad_sequences(seqs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([s.float() for s in seqs], batch_first=True)


def response_mask(seqs: Sequence[torch.Tensor]) -> torch.Tensor:
    width = max(s.numel() for s in seqs)
    return torch.arange(width)[None, :] < torch.tensor([s.numel() for s in seqs])[:, None]


def framework_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """verl's and slime's mismatch metrics from padded [B, T] log-probs, under their logged names.

    old_log_prob is the trainer's recomputation, rollout_log_prob the engine's, as verl names them.
    The verl figures follow verl 0.9.1's own operations in its own order, so that they equal what verl
    logs for the same tensors bit for bit (checked against verl itself by `nox -s verl`).
    """
    mask = response_mask.bool()
    metrics = {}
    # verl: verl/utils/debug/metrics.py calculate_debug_metrics (probabilities, not log-probs)
    actor_p, rollout_p = torch.exp(old_log_prob), torch.exp(rollout_log_prob)
    p_diff = torch.masked_select((actor_p - rollout_p).abs(), mask)
    metrics["training/rollout_probs_diff_max"] = p_diff.max().item()
    metrics["training/rollout_probs_diff_mean"] = p_diff.mean().item()
    metrics["training/rollout_probs_diff_std"] = p_diff.std().item()
    pair = torch.stack([torch.masked_select(actor_p, mask), torch.masked_select(rollout_p, mask)])
    metrics["training/rollout_actor_probs_pearson_corr"] = torch.corrcoef(pair)[0][1].item()
    # verl: verl/trainer/ppo/rollout_corr_helper.py compute_offpolicy_metrics, prefixed rollout_corr/
    mean_train = _masked_mean(old_log_prob, response_mask, dim=-1)
    mean_rollout = _masked_mean(rollout_log_prob, response_mask, dim=-1)
    log_ratio = old_log_prob - rollout_log_prob
    log_ppl_diff = mean_rollout - mean_train
    rho = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    log_ratio_sum = _masked_sum(log_ratio, response_mask, dim=-1)
    corr = {
        "training_ppl": torch.exp(-mean_train).mean(),
        "training_log_ppl": (-mean_train).mean(),
        "kl": _masked_mean(rollout_log_prob - old_log_prob, response_mask),
        "k3_kl": _masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask),
        "rollout_ppl": torch.exp(-mean_rollout).mean(),
        "rollout_log_ppl": (-mean_rollout).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "chi2_token": _masked_mean(rho.square(), response_mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)).mean() - 1.0,
    }
    metrics.update({f"rollout_corr/{k}": v.item() for k, v in corr.items()})
    # slime / Miles: mean over samples of the per-sample mean |old - rollout|
    per_sample = _masked_sum((old_log_prob - rollout_log_prob).abs(), response_mask, dim=-1) / response_mask.sum(-1)
    metrics["train_rollout_logprob_abs_diff"] = per_sample.mean().item()
    return metrics


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    # As verl's masked_sum: padding is zeroed before the product, so NaN or inf log-probs in padded
    # slots (a saved batch may hold anything there) cannot leak into the sum through 0 * inf.
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=dim)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    # As verl's masked_mean: the mask is summed in its own dtype (int64 in verl batches).
    return _masked_sum(values, mask, dim) / (mask.sum(dim=dim) + 1e-8)
