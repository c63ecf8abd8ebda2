"""C13: trainer layout invariance. A sequence's trainer log-probs do not depend on how the trainer lays the batch
out for its forwards: micro-batch size (1, 2, all), padding side and amount, packed (remove-padding, varlen) vs
padded, a token budget per forward (verl's dynamic batch size). Each knob the trainer exposes
(`Stack.trainer_layouts`) is moved alone away from the trainer's default layout, knob by knob; a trainer without
any skips with that reason. Neighbours and order are C2's."""

import inspect
from dataclasses import replace

import pytest

from logdiff.api import TrainerLayout

from .bitwise import PropertyViolation
from .workloads import WORKLOADS, scored_sequences, with_dtype

pytestmark = pytest.mark.check_only

CASES = {
    "block-edges": WORKLOADS["block-edges"],  # six lengths around the KV block: micro-batches of unequal lengths
    "batch-20": WORKLOADS["batch-20"],
    "block-edges-bf16": with_dtype(WORKLOADS["block-edges"], "bf16"),
    "dense": WORKLOADS["dense"],
}


def default_layout(knobs: dict[str, tuple]) -> TrainerLayout:
    """The trainer's own layout: the first value of each knob it names."""
    return replace(TrainerLayout(), **{knob: values[0] for knob, values in knobs.items()})


def moved(knobs: dict[str, tuple], knob: str, longest: int) -> list[TrainerLayout]:
    """The layouts that move `knob` alone; token budgets at or above the longest sequence (none is smaller: a
    trainer may refuse one), the tightest (the longest sequence) always among them."""
    default = default_layout(knobs)
    values = list(knobs[knob][1:])
    if knob == "token_budget":
        values = sorted({v for v in values if v >= longest} | {longest})
    return [replace(default, **{knob: v}) for v in values if v != getattr(default, knob)]


@pytest.mark.parametrize("workload", list(CASES))
def test_c13_trainer_layout_invariance(trainer_for, bitwise, workload):
    w = CASES[workload]
    trainer = trainer_for(w)
    knobs = trainer.trainer_layouts
    if not knobs:
        pytest.skip(f"stack {trainer.name}'s trainer exposes no layout knob (trainer_layouts: micro-batch size, padding, "
                    "token budget)")
    if "layout" not in inspect.signature(trainer.trainer_logprobs).parameters:
        pytest.skip(f"stack {trainer.name} names trainer layouts, but its trainer_logprobs takes no layout=")
    sequences, score_from, temperatures = scored_sequences(w)
    default = default_layout(knobs)
    expected = trainer.trainer_logprobs(sequences, score_from, temperatures, layout=default)
    broken = []  # every knob is tried: which of them change bits is the finding
    for knob in knobs:
        for layout in moved(knobs, knob, max(len(s) for s in sequences)):
            got = trainer.trainer_logprobs(sequences, score_from, temperatures, layout=layout)
            try:
                bitwise.logprobs(expected, got, (default.describe(), layout.describe()))
            except PropertyViolation as e:
                broken.append(str(e))
    if broken:
        raise PropertyViolation("\n".join(broken))
