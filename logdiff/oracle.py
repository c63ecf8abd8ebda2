"""The fidelity oracle: the same weights, the same model definition, plain ops in float64.

Two paths that agree bit for bit prove nothing if neither computes the model. The oracle scores the
sequences a stack produced (teacher-forced, as the trainer does) in float64 with the textbook form of
every op: materialised causal softmax, loop-free GEMMs, softmax router, per-expert loop. Its weights
are the stack's weights as the stack's dtype stores them (bf16 weights upcast exactly), so what
remains between a stack and the oracle is only the stack's arithmetic: rounding of activations and
the order of its reductions. Property C0 bounds that gap per dtype (`FIDELITY_BOUNDS`).

It streams: the weights stay as stored (a checkpoint's memory map) and each op upcasts the slice of one
weight it needs to float64, so an fp64 copy of the model never exists; the logits, [positions, vocabulary]
in fp64, are made and scored a few positions at a time.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from logdiff import devices
from logdiff.api import Processing, Unsupported
from logdiff.batch import SeqBatch
from logdiff.errors import UserError
from logdiff.kernels.gemm import weight_layout
from logdiff.kernelset import KernelSet
from logdiff.weights import ModelSpec

# What an honest stack's |logp - logp_fp64| stays within, per dtype of its weights and activations, as three
# statistics of one side's tokens in one case (a fourth, signed, below): the median over all tokens (a wrong model shifts the bulk
# of the tokens; rounding and a rare routing flip do not), and the 90th percentile and the largest error over
# the tokens whose expert choice is clear of a tie (the oracle's routing margin, ROUTING_TIE). At a tie, rounding
# may pick either expert set, and the log-prob move that follows (0.85 on the tiny MoE in bf16, 1.77 in fp32 at
# Qwen3-30B-A3B's dimensions) says nothing about the model; with 64 or 128 experts such ties are on most tokens,
# so a percentile over all tokens is set by them (q90 0.051 on honest qwen3-moe-small in bf16, 0.0197 at no tie).
# Through attention a flip reaches the tokens after it, which the percentile absorbs.
# Measured (2026-12, tests/measure_fidelity_bounds.py, output in results/vm/fidelity/) over C0's workloads for
# the honest stacks reference, baseline, naive, hf and hf-eager, and for the wrong models of tests/cheats.py
# (RoPE base 1e4 for 1e6, norm epsilon 1e-2, last layer dropped, top-(k-1) routing; rotary angles computed in
# the model dtype, wrong past a few hundred positions), rollout and trainer sides; the honest stacks' worst ->
# bound <- the wrong models' best (rotary angles at long context in brackets):
#   fp32  median 3.9e-7 -> 2e-5 <- 0.0045            q90 1.1e-6 -> 5e-5 <- 0.0123             max at no tie 1.8e-6 -> 1e-4
#   bf16  median 0.0077 -> 0.03 <- 0.104 (0.018)     q90 0.0188 -> 0.04 <- 0.244 (0.053)      max at no tie 0.51   -> 2.0
#   fp16  median 0.0013 -> 0.003 <- 0.0046 (0.0026)  q90 0.0046 -> 0.01 <- 0.0125 (0.0127)    max at no tie 0.016  -> 1.5
# On qwen3-moe-small (64 experts, top-8: near-ties on most tokens) in bf16 the honest stacks reach median 0.0208
# and q90 0.0347 (hf at long context: transformers rounds cos and sin to bf16), rotary angles in bf16 0.116
# (bounds-measurement-qwen3-moe-small-bf16.txt); at Qwen3-30B-A3B's dimensions (128 experts, top-8, depth 2) the
# honest stacks reach 0.0137 and 0.0293 (hf at long context), rotary angles in bf16 0.0473, the other wrong models
# from 0.0361 and 0.0968; in fp32 honest 1.9e-6, 5.8e-6 and 8.7e-6 at no tie (routing near-ties no longer flip:
# the GEMM's order is fixed), wrong from 0.0149; in fp16 honest 0.0014 and 0.0021, wrong from 0.0438 and 0.0954
# (bounds-measurement-qwen3-30b-a3b-2l.txt). bf16's q90 bound sits between the honest 0.0347 and the wrong
# 0.0473, x1.15 from the one and x1.18 from the other.
# (bf16's 0.51 at no tie: a flip 3 positions earlier in a 17-token prompt, reaching the token through
# attention.) A fourth statistic is signed: the median of logp - logp_fp64. Rounding moves a log-prob either way;
# a wrong model moves it one way on a greedy workload (a norm epsilon of 1e-2 flattens the distribution: 73-88 %
# of the greedy tokens below the oracle's). It catches what bf16's rounding hides from the three sizes above, the
# norm epsilon, whose median |error| (0.006-0.016) is bf16's own (0.005-0.021). Honest worst -> bound <- wrong
# best on the greedy C0 workloads: bf16 0.0054 (hf at long context on qwen3-moe-small; 0.0031 tiny, 0.0033 at
# Qwen3-30B-A3B's dimensions) -> 0.0065 <- 0.0082 (long-decode on the tiny MoE; 0.0084 and 0.0137 on the others).
# In fp32 and fp16 |median signed| <= median |error|, whose honest worst is 1.9e-6 and 0.0014 at any size
# measured: bounds 1e-5 and 0.002. On sampled workloads the wrong norm epsilon keeps its sign balance (0.0015):
# fp32 and fp16 catch it there. In bf16 and fp16 a stack that rounds its log-probs to a 1/16 grid stays inside
# the bounds too; C0's fp32 workloads and the grid check catch it.
# The signed median of a handful of tokens is mostly chance (4 honest bf16 tokens at a 2048-token prompt: +0.013,
# all four above the oracle), so it counts only where the signs are lopsided beyond chance too: a two-sided sign
# test at SIGN_TEST_ALPHA (the wrong norm epsilon's 73 % below the oracle over C0's 192-token workloads: p < 1e-9;
# 4 tokens can never reach it).
SIGN_TEST_ALPHA = 1e-3
FIDELITY_BOUNDS = {  # dtype: (median, q90, max at no routing tie, size of the signed median)
    torch.float32: (2e-5, 5e-5, 1e-4, 1e-5),
    torch.bfloat16: (0.03, 0.04, 2.0, 0.0065),
    torch.float16: (0.003, 0.01, 1.5, 0.002),
}
# A token's expert choice is at a tie when, in some MoE layer, the k-th and (k+1)-th router logits of the
# position that predicts it are closer than this many standard deviations of its router logits (measured:
# the flips of honest stacks sit below 0.0013 in bf16 and fp16; fp32 rounds 2^16 times finer).
ROUTING_TIE = {torch.float32: 1e-4, torch.bfloat16: 0.03, torch.float16: 0.03}


def fidelity_bounds(dtype: torch.dtype) -> tuple[float, float, float, float]:
    """(median over all tokens, 90th percentile and max over the tokens clear of a routing tie) of |logp - logp_fp64|,
    and the largest size of the median of logp - logp_fp64, allowed for a stack in `dtype`."""
    return FIDELITY_BOUNDS[dtype]


# Rows of a weight upcast to fp64 at once (16 MiB at hidden 2048... 128 MiB at 8192 rows x 2048 x 8 bytes),
# and positions whose fp64 logits exist at once ([128, 151936] fp64: 156 MB).
WEIGHT_ROWS = 8192
QUERY_ROWS = 128  # queries whose fp64 attention scores are held at once
LOGIT_POSITIONS = 128


def _linear(x, w):
    return torch.cat([F.linear(x, rows.to(x.dtype)) for rows in w.split(WEIGHT_ROWS)], dim=-1)


def _rms_norm(x, weight, eps):
    return weight.to(x.dtype) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _act(gate, up):
    return F.silu(gate) * up


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype)[:, None, :] + rotated * sin.to(x.dtype)[:, None, :]


def _causal_attention(q, k, v, seqs: SeqBatch):
    """Each sequence attends to its own keys up to its position: a materialised softmax per QUERY_ROWS queries,
    so that a long sequence's fp64 scores are never held whole (heads x L x L x 8 bytes: 1 GB at 32 heads, 2048)."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    out = torch.empty_like(q)
    for s in range(seqs.num_seqs):
        start, length = int(seqs.offsets[s]), int(seqs.lengths[s])
        ks = k[start:start + length].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)  # [Hq, L, d]
        vs = v[start:start + length].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        for first in range(0, length, QUERY_ROWS):
            rows = slice(start + first, start + min(first + QUERY_ROWS, length))
            scores = q[rows].transpose(0, 1) @ ks.transpose(1, 2) * head_dim**-0.5  # [Hq, rows, L]
            future = torch.arange(length) > torch.arange(first, first + scores.shape[1])[:, None]
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            out[rows] = (probs @ vs).transpose(0, 1)
    return out


def _no_rollout(*args):
    raise RuntimeError("the oracle scores given sequences; it has no rollout path")


def _route(router_logits, top_k, norm_topk_prob):
    # Exact ties go to the lower expert id, as in transformers' and logdiff's routers.
    weights, ids = torch.sort(torch.softmax(router_logits, dim=-1), dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def _experts(x, ids, gate_up, down):
    out = torch.zeros(*ids.shape, x.shape[-1], dtype=x.dtype)
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[token], gate_up[expert].to(x.dtype)).chunk(2, dim=-1)
        out[token, slot] = F.linear(F.silu(gate) * up, down[expert].to(x.dtype))
    return out


def _combine(expert_out, weights):
    return (expert_out * weights.to(expert_out.dtype)[..., None]).sum(1)


def _token_logprobs(logits, targets, temperature):
    scale = torch.where(temperature > 0, temperature, 1.0).to(logits.dtype)
    return F.log_softmax(logits / scale[:, None], dim=-1).gather(1, targets[:, None]).squeeze(1)


ORACLE_KERNELS = KernelSet(
    name="oracle-fp64", inference_weight=lambda w: w, linear=_linear, rms_norm=_rms_norm, act=_act, rope=_rope,
    train_attention=_causal_attention, rollout_attention=_no_rollout, route=_route, experts=_experts,
    combine=_combine, token_logprobs=_token_logprobs, sample=_no_rollout, compute_dtype=torch.float64,
)


@dataclass(frozen=True)
class OracleScores:
    logprobs: list[torch.Tensor]  # fp64, one per sequence: log p(token i | < i) for i >= score_from
    top2_margin: list[torch.Tensor]  # fp64: log p(top-1) - log p(top-2) at each scored position
    argmax: list[torch.Tensor]  # the oracle's most likely token at each scored position
    # fp64: the smallest gap, over MoE layers, between the k-th and (k+1)-th router logit of the position
    # that predicts each scored token, in units of that token's router-logit standard deviation (rounding
    # moves a logit in proportion to that scale); inf for a dense model. How far its expert choice is from a tie.
    routing_margin: list[torch.Tensor]
    # bool, one per sequence: the token lies outside the oracle's kept set by more than the boundary margin
    # (see Oracle.score); all False where the sequence is not truncated
    dropped: list[torch.Tensor]


class Oracle:
    """Scores sequences in float64 with the weights `spec.build(dtype)` gives a stack in `dtype`."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        # On the run's device (`--device`) where it computes in fp64, else on the CPU.
        self.device = devices.current() if devices.has_fp64(devices.current()) else torch.device("cpu")
        try:
            with devices.using(self.device):
                model = spec.build(dtype, weight_layout)  # the reference's copy: one in memory while both live
        except (UserError, OSError, KeyError, ValueError) as e:  # a checkpoint the model definition cannot read
            raise Unsupported(f"the fp64 oracle cannot load model {spec.name!r} ({e})") from None
        self.dtype = dtype
        self.model = model

    @torch.no_grad()
    def _forward(self, seq: Sequence[int], first: int, layer_done: Callable[[], None] = lambda: None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp64 final hidden states [len - first, H] of the positions that predict tokens first.., and their
        routing margins; `layer_done` is called as each layer's attention ends (progress)."""
        seqs = SeqBatch.from_lengths([len(seq)])
        top_k = self.model.config.num_experts_per_tok
        margin = torch.full((len(seq),), torch.inf, dtype=torch.float64)

        def attend(layer, q, k, v):
            out = _causal_attention(q, k, v, seqs)
            layer_done()
            return out

        def capture(name, tensor):
            if name.endswith("router_logits"):
                ranked = tensor.sort(dim=-1, descending=True).values
                gap = (ranked[:, top_k - 1] - ranked[:, top_k]) / tensor.std(dim=-1)
                torch.minimum(margin, gap, out=margin)

        hidden = self.model.hidden_states(torch.as_tensor(seq, dtype=torch.long), seqs, ORACLE_KERNELS, attend, capture)
        predicting = slice(first - 1, len(seq) - 1)
        return hidden[predicting], margin[predicting]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden, ORACLE_KERNELS)

    def distributions(self, sequences: Sequence[Sequence[int]], score_from: Sequence[int],
                      temperatures: Sequence[float], processing: Sequence[Processing] | None = None) -> list[torch.Tensor]:
        """fp64 log p_T(. | tokens < i) over the whole vocabulary, [len - score_from, V] per sequence
        (temperature 0 scores at 1, as a greedy token's log-prob does), in each sequence's log-prob mode:
        processed with the same truncation rules as a stack (`kept_tokens`) applied to the oracle's own fp64
        logits (tokens outside the kept set at -inf), raw at temperature 1 untruncated."""
        processing = processing or [Processing()] * len(sequences)
        out = []
        with devices.using(self.device):
            for seq, first, temp, proc in zip(sequences, score_from, temperatures, processing):
                logits = self._logits(self._forward(seq, first)[0])
                out.append(_in_mode(logits, temp, proc, _kept(logits, temp, proc)).cpu())
        return out

    def score(self, sequences: Sequence[Sequence[int]], score_from: Sequence[int],
              temperatures: Sequence[float], processing: Sequence[Processing] | None = None) -> OracleScores:
        """Each scored token's fp64 log-prob in its sequence's mode (see `readings`)."""
        return self.readings(sequences, score_from, temperatures, {"": processing})[""]

    def readings(self, sequences: Sequence[Sequence[int]], score_from: Sequence[int], temperatures: Sequence[float],
                 readings: dict[str, Sequence[Processing] | None]) -> dict[str, OracleScores]:
        """The same sequences scored under several processings (name -> one Processing per sequence, None:
        Processing() each), from one fp64 forward per sequence.

        A token the oracle's truncation drops by less than the dtype's max bound (its tempered log-prob that
        close to the least likely kept token's) sits on the boundary, where a stack's rounding may keep it:
        it is scored as kept (the kept set plus that token) and not counted as dropped, as greedy tokens are
        judged only where the top-2 margin is clear. Results are on the CPU."""
        with devices.using(self.device), torch.no_grad():
            scores = self._readings(sequences, score_from, temperatures, readings)
        return {name: OracleScores(*([t.cpu() for t in getattr(s, f.name)] for f in dataclasses.fields(s)))
                for name, s in scores.items()}

    def _readings(self, sequences, score_from, temperatures, readings) -> dict[str, OracleScores]:
        from tqdm import tqdm

        boundary = fidelity_bounds(self.dtype)[2]
        scores = {name: OracleScores([], [], [], [], []) for name in readings}
        # Work grows with tokens x layers; the bar shows itself only for work longer than a few seconds.
        layers = self.model.config.num_hidden_layers
        bar = tqdm(total=sum(map(len, sequences)) * layers, desc="fp64 oracle", unit="token-layer", unit_scale=True,
                   delay=5, leave=False, file=sys.stderr, dynamic_ncols=True)
        for s, (seq, first, temp) in enumerate(zip(sequences, score_from, temperatures)):
            bar.set_postfix_str(f"sequence {s + 1}/{len(sequences)}, {len(seq)} tokens", refresh=False)
            hidden, routing_margin = self._forward(seq, first, lambda n=len(seq): bar.update(n))
            targets = torch.as_tensor(seq[first:], dtype=torch.long)[:, None]
            for name, processing in readings.items():
                scores[name].routing_margin.append(routing_margin)
            parts = {name: [] for name in readings}
            for rows in range(0, len(targets), LOGIT_POSITIONS):
                logits = self._logits(hidden[rows:rows + LOGIT_POSITIONS])
                for name, processing in readings.items():
                    proc = processing[s] if processing is not None else Processing()
                    parts[name].append(_read(logits, targets[rows:rows + LOGIT_POSITIONS], temp, proc, boundary))
            for name, chunks in parts.items():
                out = scores[name]
                for field, *pieces in zip(("logprobs", "top2_margin", "argmax", "dropped"), *chunks):
                    getattr(out, field).append(torch.cat(pieces))
        bar.close()
        return scores


def _read(logits: torch.Tensor, targets: torch.Tensor, temperature: float, processing: Processing, boundary: float):
    """(log-prob of each target, top-2 margin, argmax, dropped by truncation) of fp64 `logits` [N, V] in mode
    `processing`; a target dropped by less than `boundary` counts as kept (see `Oracle.readings`)."""
    keep = _kept(logits, temperature, processing)
    logp = _in_mode(logits, temperature, processing, keep)
    chosen = logp.gather(1, targets).squeeze(1)
    dropped = torch.zeros_like(chosen, dtype=torch.bool)
    if keep is not None:
        tempered = F.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
        least_kept = tempered.masked_fill(~keep, float("inf")).amin(-1)
        outside = ~keep.gather(1, targets).squeeze(1)
        near = outside & (least_kept - tempered.gather(1, targets).squeeze(1) <= boundary)
        dropped = outside & ~near
        if processing.logprobs_mode == "processed":
            rows = near.nonzero().flatten()
            chosen[rows] = _in_mode(logits[rows], temperature, processing, keep[rows].scatter(1, targets[rows], True)).gather(
                1, targets[rows]).squeeze(1)
    top2 = logp.topk(2, dim=-1).values
    return chosen, top2[:, 0] - top2[:, 1], logp.argmax(-1), dropped


def _kept(logits: torch.Tensor, temperature: float, processing: Processing) -> torch.Tensor | None:
    """The kept set [N, V] of a sampled, truncated row (`kept_tokens` on fp64 logits); None where nothing is cut."""
    from logdiff.kernels.sampling import kept_tokens

    if not (processing.truncates and temperature > 0):
        return None
    rows = len(logits)
    return kept_tokens(logits, torch.full((rows,), float(temperature), dtype=torch.float64),
                       torch.full((rows,), processing.top_k), torch.full((rows,), processing.top_p, dtype=torch.float64),
                       torch.full((rows,), processing.min_p, dtype=torch.float64))


def _in_mode(logits: torch.Tensor, temperature: float, processing: Processing, keep: torch.Tensor | None) -> torch.Tensor:
    """fp64 log-probs [N, V] in the processing's mode: raw at temperature 1 whole; processed at the temperature
    (0 scores at 1) over `keep` (None: every token)."""
    if processing.logprobs_mode == "raw":
        return F.log_softmax(logits, dim=-1)
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return F.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)


@dataclass(frozen=True)
class Fidelity:
    """How far one side's log-probs are from the oracle's, and whether C0 holds for it."""

    side: str  # rollout | trainer | prompt
    max_abs_error: float  # over every token (routing ties included)
    mean_abs_error: float
    median_abs_error: float
    median_signed_error: float  # the median of logp - logp_fp64: rounding moves a log-prob either way, a wrong model one way
    q90_clear_error: float  # over tokens whose expert choice is clear of a tie
    max_clear_error: float
    worst: tuple[int, int] | None  # (sequence, response position) of the largest error clear of a tie
    routing_ties: int  # tokens at a routing tie
    bounds: tuple[float, float, float, float]  # FIDELITY_BOUNDS: median, q90, max at no tie, signed median
    greedy_mismatch: tuple[int, int, int, int] | None = None  # (seq, pos, token, oracle argmax)
    rounded_to: str | None = None  # the model dtype, when every recorded log-prob lies on its grid
    signs: tuple[int, int] = (0, 0)  # tokens above and below the oracle (equal ones in neither)

    @property
    def sign_test_p(self) -> float:
        """Two-sided sign test: the chance that rounding alone puts the signs at least this far from even."""
        above, below = self.signs
        n, k = above + below, min(above, below)
        if n == 0:
            return 1.0
        tail = sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2))
                   for i in range(k + 1))
        return min(1.0, 2 * tail)

    @property
    def holds(self) -> bool:
        return self.problem() is None

    def problem(self) -> str | None:
        """One line saying why C0 fails for this side, or None (NaN errors count as inf, see fidelity)."""
        median_bound, q90_bound, max_bound, signed_bound = self.bounds
        if self.rounded_to is not None:
            return (f"C0 ({self.side}): every nonzero log-prob is exactly a {self.rounded_to} value: they were rounded "
                    f"to the model dtype (an fp32 log-prob lands on that grid by chance with probability "
                    f"{GRID_CHANCE[self.rounded_to]} each); compute and return them in fp32")
        if self.greedy_mismatch is not None:
            s, p, token, best = self.greedy_mismatch
            return (f"C0 ({self.side}): greedy token at seq {s} pos {p} is {token}, but the fp64 oracle's argmax is {best} "
                    f"with a top-2 margin above {max_bound:g} and no routing tie")
        if not self.median_abs_error <= median_bound:
            return (f"C0 ({self.side}): the median |logp - logp_fp64| over the tokens is {self.median_abs_error:.3g}, "
                    f"bound {median_bound:g} (90th percentile {self.q90_clear_error:.3g}): the stack does not compute the model")
        if not abs(self.median_signed_error) <= signed_bound and self.sign_test_p < SIGN_TEST_ALPHA:
            above, below = self.signs
            return (f"C0 ({self.side}): the median of logp - logp_fp64 over the tokens is {self.median_signed_error:+.3g}, bound "
                    f"±{signed_bound:g} (median |logp - logp_fp64| {self.median_abs_error:.3g}), {above} above the oracle and "
                    f"{below} below (sign test p {self.sign_test_p:.2g}): rounding moves log-probs either way, these move one "
                    "way: the stack does not compute the model")
        if not self.q90_clear_error <= q90_bound:
            return (f"C0 ({self.side}): the 90th percentile of |logp - logp_fp64| over the tokens clear of a routing tie is "
                    f"{self.q90_clear_error:.3g}, bound {q90_bound:g} (median {self.median_abs_error:.3g}): the stack does not "
                    "compute the model on a tenth of the tokens or more")
        if not self.max_clear_error <= max_bound:
            s, p = self.worst
            return (f"C0 ({self.side}): |logp - logp_fp64| reaches {self.max_clear_error:.3g} at seq {s} pos {p}, where "
                    f"no expert choice is near a tie, bound {max_bound:g}: the stack does not compute the model there")
        return None

    def to_dict(self) -> dict:
        return {"side": self.side, "max_abs_error": self.max_abs_error, "mean_abs_error": self.mean_abs_error,
                "median_abs_error": self.median_abs_error, "q90_clear_error": self.q90_clear_error,
                "max_clear_error": self.max_clear_error, "worst": self.worst, "routing_ties": self.routing_ties,
                "median_signed_error": self.median_signed_error, "signs_above_below": list(self.signs),
                "sign_test_p": self.sign_test_p,
                "bounds": dict(zip(("median", "q90", "max_at_no_tie", "median_signed"), self.bounds)),
                "greedy_mismatch": self.greedy_mismatch, "rounded_to": self.rounded_to, "holds": self.holds}


# Log-probs rounded to the model dtype on both paths sit inside every low-precision error bound, but all
# of them lie on the dtype's grid, where fp32 values computed in fp32 land by chance with probability
# 2^-(23 - mantissa bits) each: with GRID_TOKENS of them that cannot be chance.
GRID_TOKENS = 8
GRID_CHANCE = {"bf16": "2^-16", "fp16": "2^-13"}
_GRID_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def rounded_to_model_dtype(logprobs: Sequence[torch.Tensor], dtype: torch.dtype) -> str | None:
    """The model dtype's name if every nonzero log-prob (at least GRID_TOKENS) is exactly one of its values."""
    if dtype not in _GRID_DTYPES:
        return None
    values = torch.cat([x.detach().float().flatten() for x in logprobs]) if logprobs else torch.zeros(0)
    values = values[values != 0]
    if values.numel() < GRID_TOKENS or not torch.isfinite(values).all():
        return None
    return _GRID_DTYPES[dtype] if torch.equal(values.to(dtype).float(), values) else None


def fidelity(side: str, logprobs: Sequence[torch.Tensor], oracle: OracleScores, dtype: torch.dtype,
             tokens: Sequence[Sequence[int]] | None = None, greedy: Sequence[bool] | None = None) -> Fidelity:
    """`side`'s log-probs against the oracle's. With `tokens` and `greedy`: greedy tokens must be the oracle's
    argmax wherever its top-2 margin exceeds the max bound and no routing tie is near (there rounding may pick either)."""
    bounds = fidelity_bounds(dtype)
    signed = [torch.nan_to_num(mine.detach().double() - exact, nan=torch.inf) for mine, exact in zip(logprobs, oracle.logprobs)]
    errors = [e.abs() for e in signed]
    clear = [margin >= ROUTING_TIE[dtype] for margin in oracle.routing_margin]
    every = torch.cat(errors) if errors else torch.zeros(0, dtype=torch.float64)
    clear_of_ties = every[torch.cat(clear)] if errors else every
    worst_at, worst_clear = None, 0.0
    for s, (err, ok) in enumerate(zip(errors, clear)):
        if ok.any() and (worst_at is None or float(err[ok].max()) > worst_clear):
            p = int(torch.where(ok, err, -1.0).argmax())
            worst_at, worst_clear = (s, p), float(err[p])
    mismatch = None
    if tokens is not None and greedy is not None:
        for s, (toks, is_greedy) in enumerate(zip(tokens, greedy)):
            if not is_greedy:
                continue
            wrong = (oracle.top2_margin[s] > bounds[2]) & clear[s] & (torch.as_tensor(toks) != oracle.argmax[s])
            if wrong.any():
                p = int(wrong.nonzero()[0])
                mismatch = (s, p, int(toks[p]), int(oracle.argmax[s][p]))
                break

    every_signed = torch.cat(signed) if signed else every

    def stat(f, tokens=every):
        return float(f(tokens)) if tokens.numel() else 0.0

    return Fidelity(side, stat(torch.max), stat(torch.mean), stat(lambda e: e.quantile(0.5)),
                    stat(lambda e: e.quantile(0.5), every_signed),
                    stat(lambda e: e.quantile(0.9), clear_of_ties), worst_clear, worst_at, sum(int((~ok).sum()) for ok in clear),
                    bounds, mismatch, rounded_to_model_dtype(logprobs, dtype),
                    (int((every_signed > 0).sum()), int((every_signed < 0).sum())))


def readings_of(processing: Processing) -> dict[str, Processing]:
    """What recorded log-probs can mean, the asked-for reading first: its name -> its Processing."""
    raw = dataclasses.replace(processing, logprobs_mode="raw")
    processed = dataclasses.replace(processing, logprobs_mode="processed")
    return {
        f"{processing.logprobs_mode} ({processing.truncation()})": processing,
        **{name: p for name, p in (
            ("raw (log_softmax of the logits at temperature 1, untruncated)", raw),
            ("processed (the tempered distribution and its truncation)", processed),
            ("the tempered distribution without its truncation", Processing()),
        ) if p != processing},
    }


def mode_mismatch(side: str, logprobs: Sequence[torch.Tensor], scores: dict[str, OracleScores],
                  dtype: torch.dtype) -> str | None:
    """C15: one line if the median of `side`'s |logp - logp_fp64| against the oracle's first reading (the
    asked-for one, see `readings_of`) exceeds the dtype's median bound, naming the reading they fit when one
    does; else None. The median, as in C0: a mode changes the bulk of the tokens, rounding does not."""
    bound = fidelity_bounds(dtype)[0]
    values = torch.cat([x.detach().double() for x in logprobs])
    error = {name: float((values - torch.cat(s.logprobs)).abs().nan_to_num(torch.inf).quantile(0.5))
             for name, s in scores.items()}
    asked, *others = scores
    if error[asked] <= bound:
        return None
    if not others:
        return (f"C15 ({side}): median |logp - fp64| {error[asked]:.3g} against the requests' {asked}, bound {bound:g}")
    fits = min(others, key=error.get)
    if error[fits] <= bound:
        return (f"C15 ({side}): log-probs read as {fits} (median |logp - fp64| {error[fits]:.3g}), not as the requests' "
                f"{asked} (median |logp - fp64| {error[asked]:.3g}, bound {bound:g}): log-prob mode mismatch")
    return (f"C15 ({side}): log-probs fit no reading: median |logp - fp64| {error[asked]:.3g} against the requests' "
            f"{asked}, {error[fits]:.3g} against {fits} (bound {bound:g})")


SAMPLING_ALPHA = 1e-3  # significance of each sampling test; the draws are seeded, so a verdict reproduces
PIT_BINS = 10


@dataclass(frozen=True)
class SamplingFit:
    """Seeded draws against the oracle's tempered distributions at their positions.

    z: the draws' summed log-likelihood under the oracle, centred on its expectation (minus the summed
    entropies) and scaled by its exact standard deviation. A temperature applied twice makes the draws
    likelier than expected (z > 0), one not applied at all (or one applied as its inverse) less likely.
    pit_chi2: Pearson's chi-square of the randomised probability integral transforms (tokens ordered by
    the oracle's probability) over PIT_BINS equal bins: any other departure from the distribution.
    """

    draws: int
    z: float
    pit_chi2: float
    pit_p_value: float

    @property
    def z_critical(self) -> float:
        return float(torch.special.ndtri(torch.tensor(1 - SAMPLING_ALPHA / 2, dtype=torch.float64)))

    @property
    def holds(self) -> bool:
        return abs(self.z) <= self.z_critical and self.pit_p_value >= SAMPLING_ALPHA

    def problem(self) -> str | None:
        if abs(self.z) > self.z_critical:
            way = "likelier" if self.z > 0 else "less likely"
            return (f"C0 (sampling): {self.draws} seeded draws are {way} under the fp64 oracle's tempered distribution "
                    f"than a sample from it (z = {self.z:.1f}, |z| > {self.z_critical:.2f} at alpha {SAMPLING_ALPHA:g}): "
                    "the temperature is not applied as the model's")
        if self.pit_p_value < SAMPLING_ALPHA:
            return (f"C0 (sampling): {self.draws} seeded draws do not follow the fp64 oracle's tempered distribution "
                    f"(PIT chi-square {self.pit_chi2:.1f}, p = {self.pit_p_value:.2g} < {SAMPLING_ALPHA:g})")
        return None


def sampling_fit(tokens: Sequence[Sequence[int]], logp_rows: Sequence[torch.Tensor], seed: int = 0) -> SamplingFit:
    """`tokens[s][i]` drawn from exp(`logp_rows[s][i]`) (fp64 [V] log-probs at that position)?"""
    logp = torch.cat(list(logp_rows))
    drawn = torch.as_tensor([t for toks in tokens for t in toks], dtype=torch.long)
    p = logp.exp()
    finite = torch.where(p > 0, logp, 0.0)  # a truncated distribution's impossible tokens add nothing (0 * -inf)
    mean = (p * finite).sum(-1)  # E[log p(x)] = -H
    var = (p * finite.square()).sum(-1) - mean.square()
    chosen = logp.gather(1, drawn[:, None]).squeeze(1)
    z = float((chosen - mean).sum() / var.sum().sqrt())
    # Randomised PIT over tokens sorted by probability: u = F(before x) + V * p(x) is uniform under the model.
    order = p.argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1).gather(1, drawn[:, None]).squeeze(1)
    sorted_p = p.gather(1, order)
    before = (sorted_p.cumsum(-1) - sorted_p).gather(1, rank[:, None]).squeeze(1)
    noise = torch.rand(len(drawn), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    u = (before + noise * p.gather(1, drawn[:, None]).squeeze(1)).clamp(0, 1 - 1e-12)
    counts = torch.bincount((u * PIT_BINS).long(), minlength=PIT_BINS).double()
    expected = len(drawn) / PIT_BINS
    chi2 = float(((counts - expected).square() / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((PIT_BINS - 1) / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    return SamplingFit(len(drawn), z, chi2, p_value)
