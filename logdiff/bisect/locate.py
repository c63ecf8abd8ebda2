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

The two sides need not be a rollout and a trainer: `bisect_sides` compares any two (stack, path) pairs,
e.g. the rollout sharded over two ranks against the rollout on one process (C8). A side that ran on
several ranks (logdiff.parallel) is compared as one process computes it, its ranks' parts put together;
a finding then also names the collective the op ends in there and the ranks whose own copy differs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from logdiff.api import Stack, TrainerInputs, processing_kwargs
from logdiff.bisect.capture import (
    CONTEXT,
    LAYER_POINTS,
    Recorder,
    assemble,
    captured_inputs,
    point_names,
    rank_part,
    split_name,
)
from logdiff.config import ModelConfig
from logdiff.errors import UserError
from logdiff.metrics import Comparison, Divergence, bits, compare, hex_bits
from logdiff.runner import engine_options
from logdiff.workload import Workload

KERNEL_PATH = "kernel path"
UPSTREAM = "upstream / framework"
ROLLOUT, TRAINER = "rollout", "trainer"


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
    """A capture point that differs at `position`, what its inputs look like there, and the class. When a
    side ran on several ranks: which (`side`), its ranks whose own copy of the point differs there, the
    collective the point's op ends in on them (None: the op is each rank's own, e.g. a column-parallel GEMM),
    and the rank named: the one that ran the expert of the first differing element for expert outputs,
    else the first whose copy differs."""

    point: str
    position: int
    diff: RowDiff
    inputs: list[InputStatus]
    klass: str
    side: str | None = None
    ranks: list[int] = field(default_factory=list)
    world: int = 1
    collective: str | None = None
    rank: int | None = None
    expert: int | None = None


@dataclass(frozen=True)
class Side:
    """One path (ROLLOUT or TRAINER) of one stack: what bisect runs, replays with capture on and compares."""

    label: str  # how the report names it: "rollout", "trainer TP2", ...
    stack: Stack
    path: str


class Captured:
    """One side's replay: the rows of every point as one process computes them (on several ranks: the
    ranks' parts put together) and each rank's own copy, to tell on which ranks a point differs."""

    def __init__(self, label: str, recorder: Recorder, config: ModelConfig):
        self.label, self.config = label, config
        self.copies = recorder.ranks or [recorder]
        self.tp, self.ep, self.collectives = self.copies[0].tp, self.copies[0].ep, self.copies[0].collectives
        self.rows: dict[str, dict[int, torch.Tensor]] = {}
        for name in set.intersection(*(set(c.rows) for c in self.copies)):
            positions = set.intersection(*(set(c.rows[name]) for c in self.copies))
            self.rows[name] = {p: assemble([c.rows[name][p] for c in self.copies], name, config, self.tp)
                               for p in sorted(positions)}

    def differing_ranks(self, name: str, position: int, other: torch.Tensor) -> list[int]:
        """The ranks whose own copy of `name` at `position` differs from their part of `other` (a whole row)."""
        return [rank for rank, copy in enumerate(self.copies)
                if not diff_rows(copy.rows[name][position], rank_part(other, name, self.config, rank, self.tp)).equal]


@dataclass
class Bisection:
    stack: str
    about: str  # what ran, for the report's header: the workload, or the bundles' model and sequences
    comparison: Comparison
    logdiff: list[list[float]]  # |rollout - trainer| per sequence and response token
    divergence: Divergence | None = None
    position: int | None = None  # of the row whose next-token log-prob diverges first
    at_token: dict[str, RowDiff] = field(default_factory=dict)  # every point captured on both paths, in order
    first: Finding | None = None
    origin: Finding | None = None  # where an upstream difference came in
    num_layers: int = 0
    sides: tuple[str, str] = (ROLLOUT, TRAINER)  # what the values named rollout and trainer come from
    captured: str = "replayed with capture on: both sides gave the run's tokens and log-probs bit for bit"

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
            "sides": dict(zip((ROLLOUT, TRAINER), self.sides)),
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
    """Where `stack`'s rollout engine and trainer part ways on `workload`."""
    return bisect_sides(Side(ROLLOUT, stack, ROLLOUT), Side(TRAINER, stack, TRAINER), workload, progress)


def bisect_sides(a: Side, b: Side, workload: Workload, progress=lambda message: None) -> Bisection:
    """Where side `a` and side `b` part ways; the result holds a's values as `rollout`, b's as `trainer`.
    Trainer sides score the sequences of the first rollout side (of b's stack when neither is one)."""
    for side in (a, b):
        if not side.stack.supports_capture:
            raise UserError(
                f"stack {side.stack.name!r} does not implement the capture hook (supports_capture, a capture= keyword "
                "on rollout and trainer_logprobs, see logdiff.api.Stack); add it to bisect this stack"
            )
    name = a.stack.name
    progress(f"{name}: {a.label} and {b.label}")
    source = next((s for s in (a, b) if s.path == ROLLOUT), Side(ROLLOUT, b.stack, ROLLOUT))
    outputs = source.stack.rollout(workload.requests(), engine_options(workload))
    scored = TrainerInputs.after(workload.requests(), outputs)
    ran = [([o.tokens for o in outputs], [o.logprobs for o in outputs]) if s is source else _run(s, workload, scored)
           for s in (a, b)]
    comparison = compare(ran[0][1], ran[1][1])
    config = workload.spec.config()
    result = Bisection(
        name, workload.describe(), comparison,
        logdiff=[(x.float() - y.detach().float()).abs().tolist() for x, y in zip(ran[0][1], ran[1][1])],
        divergence=comparison.first_divergence, num_layers=config.num_hidden_layers, sides=(a.label, b.label),
    )
    if result.divergence is None:
        return result
    d = result.divergence
    result.position = scored.score_from[d.seq] + d.pos - 1
    first, second = (_replay(side, workload, scored, before, d.seq, result.position, config, progress)
                     for side, before in zip((a, b), ran))
    return locate_first_point(result, first, second, config)


def locate_first_point(result: Bisection, first: Captured, second: Captured, config: ModelConfig) -> Bisection:
    """Fills `result` (its divergence and position set) from both sides' captured rows: every point at the
    row, the first that differs and its class, and where an upstream difference came in. Live bisect and
    offline bundles (logdiff.bisect.bundle) share it, so both report a divergence the same way."""
    names = [n for n in point_names(config.num_hidden_layers) if result.position in first.rows.get(n, {})
             and result.position in second.rows.get(n, {})]
    result.at_token = {n: diff_rows(first.rows[n][result.position], second.rows[n][result.position]) for n in names}
    point = next((n for n in names if not result.at_token[n].equal), None)
    if point is None:
        return result
    result.first = _examine(point, result.position, first, second, config)
    if result.first.klass == UPSTREAM:
        result.origin = _origin(names, result.position, first, second, config)
    return result


def _run(side: Side, workload: Workload, scored: TrainerInputs, capture: Recorder | None = None):
    """(tokens per request or None for a trainer, log-probs per request)."""
    if side.path == ROLLOUT:
        outputs = side.stack.rollout(workload.requests(), engine_options(workload), capture=capture)
        return [o.tokens for o in outputs], [o.logprobs for o in outputs]
    scorer = side.stack.trainer_logprobs
    return None, scorer(scored.sequences, scored.score_from, scored.temperatures, capture=capture,
                        **processing_kwargs(side.stack, scorer, scored.processing))


def _replay(side: Side, workload, scored, before, request: int, position: int, config, progress) -> Captured:
    """`side` again on the whole workload (same batch: split-KV and padding depend on it), keeping the
    rows of `request` up to `position`; it must give the bits it gave before."""
    progress(f"{side.stack.name}: replaying the {side.label} with capture on (sequence {request}, positions 0..{position})")
    recorder = Recorder(request, position)
    tokens, values = _run(side, workload, scored, recorder)
    if tokens != before[0] or not _same_bits(values, before[1]):
        raise NotReproduced(f"the {side.label} of stack {side.stack.name!r} gave other tokens or log-probs when replayed")
    return Captured(side.label, recorder, config)


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


def _examine(name: str, position: int, first: Captured, second: Captured, config: ModelConfig) -> Finding:
    captured = set(first.rows) & set(second.rows)
    inputs = []
    for source, scope in captured_inputs(name, captured, config):
        lo = 0 if scope == CONTEXT else position
        missing, differing = [], []
        for p in range(lo, position + 1):
            a, b = first.rows[source].get(p), second.rows[source].get(p)
            if a is None or b is None:
                missing.append(p)
            elif not diff_rows(a, b).equal:
                differing.append(p)
        inputs.append(InputStatus(source, scope, (lo, position), differing, missing))
    # A point with no inputs (tokens, positions) is an input of the forward itself: the framework feeds it.
    klass = KERNEL_PATH if inputs and all(i.equal for i in inputs) else UPSTREAM
    diff = diff_rows(first.rows[name][position], second.rows[name][position])
    # The ranks named are those of the side that ran on more of them (the first side on a tie).
    sharded, other = (first, second) if len(first.copies) >= len(second.copies) else (second, first)
    if len(sharded.copies) == 1:
        return Finding(name, position, diff, inputs, klass)
    ranks = sharded.differing_ranks(name, position, other.rows[name][position])
    layer, point = split_name(name)
    ids = sharded.rows.get(f"layers.{layer}.topk_ids", {}).get(position)
    expert = rank = None
    if point == "experts" and sharded.ep > 1 and ids is not None and diff.index is not None:
        # Expert outputs [k, H] are gathered onto every rank; the element was computed where its expert lives.
        expert = int(ids[diff.index // config.hidden_size])
        rank = expert // (config.num_experts // sharded.ep)
    return Finding(name, position, diff, inputs, klass, side=sharded.label, ranks=ranks, world=len(sharded.copies),
                   collective=sharded.collectives.get(point), rank=rank if rank is not None else next(iter(ranks), None),
                   expert=expert)


def _origin(names: list[str], upto: int, first: Captured, second: Captured, config: ModelConfig) -> Finding | None:
    """The first point, in forward order, that differs at any position <= `upto`, at its first such position."""
    for name in names:
        a, b = first.rows[name], second.rows[name]
        for p in sorted(set(a) & set(b)):
            if not diff_rows(a[p], b[p]).equal:
                return _examine(name, p, first, second, config)
    return None
