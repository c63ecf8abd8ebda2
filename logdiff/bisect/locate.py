"""`logdiff bisect`: which op, in which layer, makes a stack's trainer and rollout engine part ways, and why.

It runs the workload, takes the first (sequence, response token) whose log-probs differ, and replays
the same workload (same batch: split-KV and padding depend on it) on both paths with a capture that
keeps only that sequence's rows. The token's log-prob comes from the row at the position before it.
Walking the capture points in forward order, the first whose output for that row differs is
classed by its inputs:

- kernel path: its inputs are bitwise equal on both paths, its outputs are not: the op itself is
  not aligned between the trainer and the rollout engine;
- upstream / framework: its inputs already differ (token ids, positions, the keys of earlier
  positions, routing): the difference came in before this op. bisect then names the op where it
  came in: the first point, in forward order, that differs at any position of the sequence up to the
  token (its inputs are equal there by construction, so that op is the kernel path to fix).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from logdiff.api import Stack
from logdiff.bisect.capture import (
    CONTEXT,
    LAYER_POINTS,
    Recorder,
    captured_inputs,
    point_names,
)
from logdiff.config import ModelConfig
from logdiff.errors import UserError
from logdiff.metrics import Comparison, Divergence, bits, hex_bits
from logdiff.runner import StackRun, engine_options, run_stack
from logdiff.workload import Workload

KERNEL_PATH = "kernel path"
UPSTREAM = "upstream / framework"


class NotReproduced(Exception):
    """The replay with capture on did not give the run's bits: the stack is not run-to-run deterministic."""


@dataclass(frozen=True)
class RowDiff:
    """One capture point's output at one position on both paths."""

    equal: bool
    elements: int
    differing: int
    max_abs_diff: float
    index: int | None = None  # first differing element, flat
    rollout: float | None = None
    trainer: float | None = None
    rollout_bits: str | None = None  # None for integer points (ids, positions)
    trainer_bits: str | None = None
    shapes: str | None = None  # set when the shapes differ


@dataclass(frozen=True)
class InputStatus:
    name: str
    scope: str  # "token" or "context" (positions up to the row's own)
    positions: tuple[int, int]  # first and last position compared
    differing_positions: list[int]
    missing_positions: list[int]

    @property
    def equal(self) -> bool:
        return not self.differing_positions and not self.missing_positions


@dataclass(frozen=True)
class Finding:
    """A capture point that differs at `position`, what its inputs look like there, and the class."""

    point: str
    position: int
    diff: RowDiff
    inputs: list[InputStatus]
    klass: str


@dataclass
class Bisection:
    stack: str
    workload: Workload
    comparison: Comparison
    logdiff: list[list[float]]  # |rollout - trainer| per sequence and response token
    divergence: Divergence | None = None
    position: int | None = None  # of the row whose next-token log-prob diverges first
    at_token: dict[str, RowDiff] = field(default_factory=dict)  # every point captured on both paths, in order
    first: Finding | None = None
    origin: Finding | None = None  # where an upstream difference came in
    num_layers: int = 0

    @property
    def logprob_abs_diff(self) -> float | None:
        return abs(self.divergence.rollout - self.divergence.trainer) if self.divergence else None

    def grid(self) -> tuple[list[str], list[list[float | None]]]:
        """max |diff| at the token per (layer point, layer): 0.0 equal, None not captured on both paths."""
        points = [p for p in LAYER_POINTS if any(f"layers.{i}.{p}" in self.at_token for i in range(self.num_layers))]
        values = [[_size(self.at_token.get(f"layers.{i}.{p}")) for i in range(self.num_layers)] for p in points]
        return points, values

    def to_dict(self) -> dict:
        points, values = self.grid()
        return {
            "stack": self.stack,
            "comparison": self.comparison.to_dict(),
            "logdiff": self.logdiff,
            "divergence": asdict(self.divergence) if self.divergence else None,
            "position": self.position,
            "logprob_abs_diff": self.logprob_abs_diff,
            "first": asdict(self.first) if self.first else None,
            "origin": asdict(self.origin) if self.origin else None,
            "at_token": {name: asdict(d) for name, d in self.at_token.items()},
            "grid": {"points": points, "layers": list(range(self.num_layers)), "max_abs_diff": values},
        }


def _size(diff: RowDiff | None) -> float | None:
    return None if diff is None else 0.0 if diff.equal else diff.max_abs_diff


def bisect(stack: Stack, workload: Workload, progress=lambda message: None) -> Bisection:
    if not stack.supports_capture:
        raise UserError(
            f"stack {stack.name!r} does not implement the capture hook (supports_capture, a capture= keyword on rollout "
            "and trainer_logprobs, see logdiff.api.Stack); add it to bisect this stack"
        )
    progress(f"{stack.name}: rollout + trainer recompute")
    run = run_stack(stack, workload)
    config = workload.spec.config()
    result = Bisection(
        stack.name, workload, run.comparison,
        logdiff=[(o.logprobs.float() - t.detach().float()).abs().tolist() for o, t in zip(run.rollout, run.trainer)],
        divergence=run.comparison.first_divergence, num_layers=config.num_hidden_layers,
    )
    if result.divergence is None:
        return result
    d = result.divergence
    result.position = run.scored.score_from[d.seq] + d.pos - 1
    rollout, trainer = _replay(stack, workload, run, d.seq, result.position, progress)
    names = [n for n in point_names(config.num_hidden_layers) if result.position in rollout.rows.get(n, {})
             and result.position in trainer.rows.get(n, {})]
    result.at_token = {n: diff_rows(rollout.rows[n][result.position], trainer.rows[n][result.position]) for n in names}
    first = next((n for n in names if not result.at_token[n].equal), None)
    if first is None:
        return result
    result.first = _examine(first, result.position, rollout, trainer, config)
    if result.first.klass == UPSTREAM:
        result.origin = _origin(names, result.position, rollout, trainer, config)
    return result


def _replay(stack, workload, run: StackRun, request: int, position: int, progress) -> tuple[Recorder, Recorder]:
    """Both paths again on the whole workload, keeping the rows of `request` up to `position`."""
    requests = workload.requests()
    rollout, trainer = Recorder(request, position), Recorder(request, position)
    progress(f"{stack.name}: replaying the rollout with capture on (sequence {request}, positions 0..{position})")
    again = stack.rollout(requests, engine_options(workload), capture=rollout)
    if [o.tokens for o in again] != [o.tokens for o in run.rollout] or not _same_bits(
            [o.logprobs for o in again], [o.logprobs for o in run.rollout]):
        raise NotReproduced(f"the rollout of stack {stack.name!r} gave other tokens or log-probs when replayed")
    progress(f"{stack.name}: replaying the trainer with capture on")
    scores = stack.trainer_logprobs(run.scored.sequences, run.scored.score_from, run.scored.temperatures,
                                    capture=trainer)
    if not _same_bits(scores, run.trainer):
        raise NotReproduced(f"the trainer of stack {stack.name!r} gave other log-probs when replayed")
    return rollout, trainer


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(bits(x.detach()), bits(y.detach())) for x, y in zip(a, b))


def diff_rows(a: torch.Tensor, b: torch.Tensor) -> RowDiff:
    if a.shape != b.shape or a.dtype != b.dtype:
        return RowDiff(False, max(a.numel(), b.numel()), max(a.numel(), b.numel()), math.inf,
                       shapes=f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    floating = a.is_floating_point()
    differ = (bits(a) != bits(b)) if floating else (a != b)
    count = int(differ.sum())
    if not count:
        return RowDiff(True, a.numel(), 0, 0.0)
    gap = (a.double() - b.double()).abs().flatten()
    i = int(differ.flatten().nonzero()[0])
    x, y = a.flatten()[i], b.flatten()[i]
    return RowDiff(
        False, a.numel(), count, float(gap.nan_to_num(math.inf).max()), i, x.item(), y.item(),
        hex_bits(x) if floating else None, hex_bits(y) if floating else None,
    )


def _examine(name: str, position: int, rollout: Recorder, trainer: Recorder, config: ModelConfig) -> Finding:
    captured = set(rollout.rows) & set(trainer.rows)
    inputs = []
    for source, scope in captured_inputs(name, captured, config):
        lo = 0 if scope == CONTEXT else position
        missing, differing = [], []
        for p in range(lo, position + 1):
            a, b = rollout.rows[source].get(p), trainer.rows[source].get(p)
            if a is None or b is None:
                missing.append(p)
            elif not diff_rows(a, b).equal:
                differing.append(p)
        inputs.append(InputStatus(source, scope, (lo, position), differing, missing))
    # A point with no inputs (tokens, positions) is an input of the forward itself: the framework feeds it.
    klass = KERNEL_PATH if inputs and all(i.equal for i in inputs) else UPSTREAM
    return Finding(name, position, diff_rows(rollout.rows[name][position], trainer.rows[name][position]), inputs, klass)


def _origin(names: list[str], upto: int, rollout: Recorder, trainer: Recorder, config: ModelConfig) -> Finding | None:
    """The first point, in forward order, that differs at any position <= `upto`, at its first such position."""
    for name in names:
        a, b = rollout.rows[name], trainer.rows[name]
        for p in sorted(set(a) & set(b)):
            if not diff_rows(a[p], b[p]).equal:
                return _examine(name, p, rollout, trainer, config)
    return None
