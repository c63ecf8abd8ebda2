"""Ratios with spread, from interleaved repeats, and the targets and readings they are judged by.

Repeat r times every stack back to back (A B A B ...), so the ratio of two stacks' throughputs within
one repeat sees the same machine state; the spread of those per-repeat ratios is what is reported.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from logdiff.bench.cases import CASES

# (label, numerator stack, denominator stack)
READINGS = (
    ("cost of consistency", "reference", "baseline"),
    ("the claim", "reference", "naive"),
    ("the peer", "reference", "hf"),
)


@dataclass(frozen=True)
class Target:
    """numerator / denominator >= at_least on `case`; denominator "bound": numerator's fraction of the
    machine's limit for the case (limits.case_bound)."""

    case: str
    numerator: str
    denominator: str
    at_least: float

    @property
    def label(self) -> str:
        if self.denominator == "bound":
            return f"{self.case}: {self.numerator} >= {self.at_least:.0%} of the bound"
        return f"{self.case}: {self.numerator} / {self.denominator} >= {self.at_least:g}"


# Targets (issue 19; qwen3-moe-small bf16 and a real-dimension config): consistency at no cost against every
# peer on every case (vLLM's CPU engine on the rollout cases it runs), and decode close to the machine's
# limit. Reported beside the ratios, never asserted.
TARGETS = (
    *(Target(case, "reference", "baseline", 1.0) for case in CASES),
    *(Target(case, "reference", "hf", 1.0) for case in CASES),
    *(Target(case, "reference", "vllm", 1.0) for case in CASES if case == "prefill" or case.startswith("decode")),
    Target("decode-b1", "reference", "bound", 0.5),
)


def spread(values: list[float]) -> dict:
    """Median, quartiles and range of repeated values."""
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median": statistics.median(ordered), "q1": q1, "q3": q3, "min": ordered[0], "max": ordered[-1],
            "n": len(ordered)}


def paired_ratio(numerator: list[float], denominator: list[float]) -> dict:
    """Spread of numerator[r] / denominator[r] over repeats r (throughputs measured side by side)."""
    return spread([a / b for a, b in zip(numerator, denominator)])


def fmt_spread(s: dict, unit: str = "") -> str:
    return f"{s['median']:.3g}{unit} [{s['min']:.3g}-{s['max']:.3g}]"


def claim_reading(ratio: float, low: float, high: float) -> str:
    if ratio < low:
        return "below the claimed range"
    return "within the claimed range" if ratio <= high else "above the claimed range"
