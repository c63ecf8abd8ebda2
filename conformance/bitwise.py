"""Bitwise comparisons for the catalogue. A failure names the first divergent (sequence, position)
with both values and their bit patterns; every comparison is also recorded on the test's report
(`user_properties`), which is where `logdiff check` reads the figures of its table and badges."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from logdiff.api import RolloutOutput
from logdiff.metrics import bits, first_divergence, hex_bits


class PropertyViolation(AssertionError):
    """The stack under test broke the property; the message says where, with the bits."""


class Bitwise:
    def __init__(self, user_properties: list | None = None):
        self.user_properties = user_properties if user_properties is not None else []

    def logprobs(self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], names: tuple[str, str]) -> None:
        """Per-sequence log-prob tensors, bit for bit."""
        __tracebackhide__ = True
        a, b = _detached(a), _detached(b)
        check_logprobs(a, names[0])
        check_logprobs(b, names[1])
        for s, (x, y) in enumerate(zip(a, b)):
            if x.numel() != y.numel():
                raise PropertyViolation(f"{names[0]} has {x.numel()} log-probs for sequence {s}, {names[1]} has {y.numel()}")
        divergence = first_divergence(list(a), list(b))
        summary = self._record(names, torch.cat(list(a)), torch.cat(list(b)))
        if divergence is not None:
            raise PropertyViolation(f"{summary}\n{divergence} (first: {names[0]}, second: {names[1]})")

    def rollouts(self, a: Sequence[RolloutOutput], b: Sequence[RolloutOutput], names: tuple[str, str]) -> None:
        """Sampled tokens equal and their log-probs bit for bit."""
        __tracebackhide__ = True
        token_gap = _first_token_difference(a, b)
        try:
            self.logprobs([o.logprobs for o in a], [o.logprobs for o in b], names)
        except PropertyViolation as e:
            raise PropertyViolation(f"{e}" + (f"\n{token_gap}" if token_gap else "")) from None
        if token_gap:
            raise PropertyViolation(f"{names[0]} vs {names[1]}: {token_gap}")

    def gradients(self, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: tuple[str, str]) -> None:
        """Gradients per parameter, bit for bit; the failure names the parameter and flat index."""
        __tracebackhide__ = True
        flat_a = torch.cat([g.float().flatten() for g in a.values()])
        flat_b = torch.cat([g.float().flatten() for g in b.values()])
        summary = self._record(names, flat_a, flat_b, unit="gradient elements")
        for name, x in a.items():
            y = b[name]
            differ = (bits(x.flatten()) != bits(y.flatten())).nonzero()
            if len(differ):
                i = int(differ[0])
                xi, yi = x.flatten()[i], y.flatten()[i]
                raise PropertyViolation(
                    f"{summary}\ngradients differ at {name}[flat {i}]: {hex_bits(xi)} ({float(xi)!r}) vs "
                    f"{hex_bits(yi)} ({float(yi)!r}) (first: {names[0]}, second: {names[1]})"
                )

    def fidelity(self, sides) -> None:
        """C0: each side (a logdiff.oracle.Fidelity) within its bounds of the fp64 oracle."""
        __tracebackhide__ = True
        for side in sides:
            self.user_properties.append(("fidelity", side.to_dict()))
        problems = [side.problem() for side in sides if not side.holds]
        if problems:
            raise PropertyViolation("\n".join(problems))

    def sampling(self, fit, temperature: float, truncation: str | None = None) -> None:
        """C0, C15: seeded draws follow the oracle's tempered (and truncated) distribution (a logdiff.oracle.SamplingFit)."""
        __tracebackhide__ = True
        self.user_properties.append(("sampling", {"temperature": temperature, "truncation": truncation,
                                                  **dataclasses.asdict(fit)}))
        if not fit.holds:
            raise PropertyViolation(f"at temperature {temperature}{f', {truncation}' if truncation else ''}: {fit.problem()}")

    def _record(self, names, a: torch.Tensor, b: torch.Tensor, unit: str = "log-probs") -> str:
        equal = int((bits(a) == bits(b)).sum())
        diff = (a.float() - b.float()).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        self.user_properties.append(
            ("compared", {"what": f"{names[0]} vs {names[1]}", "values": a.numel(), "bitwise_equal": equal,
                          "max_abs_diff": max_abs})
        )
        return f"{names[0]} vs {names[1]}: {equal}/{a.numel()} {unit} bitwise equal, max |diff| {max_abs:.3g}"


def check_logprobs(values: Sequence[torch.Tensor], who: str) -> None:
    """The Stack API contract: one fp32 vector of finite, non-positive log-probs per sequence. NaNs
    would otherwise compare equal bit for bit and pass."""
    __tracebackhide__ = True
    for s, x in enumerate(values):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 1:
            kind = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise PropertyViolation(f"{who} returned a {kind} for sequence {s}; the Stack API returns 1-D fp32 log-probs")
        bad = (~torch.isfinite(x) | (x > 0)).nonzero()
        if len(bad):
            p = int(bad[0])
            raise PropertyViolation(
                f"{who} log-prob at seq {s} pos {p} is {float(x[p])!r} ({hex_bits(x[p])}), not a log-probability")


def check_rollout(outputs: Sequence[RolloutOutput], requests, who: str = "rollout") -> None:
    """One output per request, `max_new_tokens` tokens each, one log-prob per token."""
    __tracebackhide__ = True
    if len(outputs) != len(requests):
        raise PropertyViolation(f"{who} returned {len(outputs)} outputs for {len(requests)} requests")
    for s, (out, req) in enumerate(zip(outputs, requests)):
        if len(out.tokens) != req.max_new_tokens or out.logprobs.numel() != len(out.tokens):
            raise PropertyViolation(
                f"{who} returned {len(out.tokens)} tokens and {out.logprobs.numel()} log-probs for request {s}, "
                f"which asked for {req.max_new_tokens}"
            )
    check_logprobs([o.logprobs for o in outputs], who)


def _first_token_difference(a: Sequence[RolloutOutput], b: Sequence[RolloutOutput]) -> str | None:
    for s, (x, y) in enumerate(zip(a, b)):
        for p, (tx, ty) in enumerate(zip(x.tokens, y.tokens)):
            if tx != ty:
                return f"sampled tokens differ at seq {s} pos {p}: {tx} vs {ty}"
    return None


def _detached(values):
    return [x.detach() if isinstance(x, torch.Tensor) else x for x in values]
