"""The Eager-mode throughput cases, and how one is timed on one stack.

`logdiff bench`, the pytest-benchmark files in perf/ and the asv benchmarks all time these cases
through the stack API only, so every stack (built-in or third-party) is timed doing the same calls:

  trainer      forward + backward of the trainer over whole sequences; tokens/s counts every token
  prefill      rollout of one token per request; tokens/s counts prompt tokens
  decode-bB    rollout at batch B: time of an N-token rollout minus the time of a 1-token rollout of
               the same requests (the prefill, the fastest of one run before, one after and up to three
               more while the two fastest disagree), so tokens/s counts the B x (N - 1) decode tokens
  rl-step      rollout, then the trainer's recompute of the rollout's log-probs; tokens/s counts
               response tokens

All requests of a case share one prompt length and join at once (greedy, no stagger), so every stack
gets the same work, and `max_model_len` is the case's own context rounded up to 128 (the setting most
favourable to `naive`, whose attention spans max_model_len).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from logdiff.api import Request, Stack, TrainerInputs, Unsupported
from logdiff.workload import Workload


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # trainer | prefill | decode | rl-step
    batch: int
    prompt_len: int
    new_tokens: int

    def workload(self, model: str, dtype: str, seed: int = 0) -> Workload:
        return Workload(model=model, dtype=dtype, batch_size=self.batch, prompt_lens=(self.prompt_len,),
                        max_new_tokens=self.new_tokens, stagger=0, seed=seed)

    @property
    def counted_tokens(self) -> int:
        """The tokens its tokens/s counts."""
        if self.kind == "trainer":
            return self.batch * (self.prompt_len + self.new_tokens)
        if self.kind == "prefill":
            return self.batch * self.prompt_len
        if self.kind == "decode":
            return self.batch * (self.new_tokens - 1)
        return self.batch * self.new_tokens

    def describe(self) -> str:
        if self.kind == "trainer":
            return f"forward+backward, {self.batch} x {self.prompt_len + self.new_tokens} tokens"
        if self.kind == "prefill":
            return f"{self.batch} prompts x {self.prompt_len} tokens"
        return f"batch {self.batch}, prompt {self.prompt_len}, {self.new_tokens} new tokens"


DECODE_BATCHES = (1, 8, 32, 64)
PREFILL_RETRIES = 3

CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("trainer", "trainer", batch=4, prompt_len=128, new_tokens=128),
        Case("prefill", "prefill", batch=8, prompt_len=128, new_tokens=1),
        *(Case(f"decode-b{b}", "decode", batch=b, prompt_len=64, new_tokens=32) for b in DECODE_BATCHES),
        Case("rl-step", "rl-step", batch=8, prompt_len=64, new_tokens=32),
    )
}


@dataclass
class Measurement:
    seconds: float
    tokens: int
    token_ids: list[list[int]] | None  # what a rollout case generated; None for the trainer
    recomputed: tuple | None = None  # rl-step: (TrainerInputs, rollout log-probs, trainer log-probs), for the oracle

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def measure(stack: Stack, case: Case, workload: Workload) -> Measurement:
    """Times `case` once on `stack`."""
    requests = workload.requests()
    if case.kind == "trainer":
        # Whole sequences of prompt + response length; the response part is scored.
        whole = dataclasses.replace(workload, prompt_lens=(case.prompt_len + case.new_tokens,)).requests()
        return Measurement(_time_trainer_step(stack, [r.prompt for r in whole], case.prompt_len, whole[0]),
                           case.counted_tokens, None)
    if case.kind == "prefill":
        seconds, outputs = _time_rollout(stack, _with_new_tokens(requests, 1))
        return Measurement(seconds, case.counted_tokens, outputs)
    if case.kind == "decode":
        # The prefill is timed before and after the full rollout and the faster taken: one slow prefill
        # (another job, a page fault) would otherwise be subtracted whole and could leave a negative time.
        # While the two fastest prefills disagree by more than the decode time, it is timed again, at most
        # PREFILL_RETRIES times: one stall (an engine in another process still busy, seen at 1 s against
        # 0.03 s) then costs a retry, not the case.
        prefill = _with_new_tokens(requests, 1)
        prefills = [_time_rollout(stack, prefill)[0]]
        full, outputs = _time_rollout(stack, requests)
        prefills.append(_time_rollout(stack, prefill)[0])
        while True:
            fastest, second = sorted(prefills)[:2]
            decode = full - fastest
            if second - fastest <= decode:
                return Measurement(decode, case.counted_tokens, outputs)
            if len(prefills) == 2 + PREFILL_RETRIES:
                raise Unsupported(f"decode time not resolved: the prefill took {', '.join(f'{t:.3g}' for t in prefills)} s, "
                                  f"its two fastest further apart than the {decode:.3g} s left for the decode (a "
                                  "prefill this slow and uneven leaves the decode inside its noise)")
            prefills.append(_time_rollout(stack, prefill)[0])
    start = time.perf_counter()
    rollout = stack.rollout(requests)
    scored = TrainerInputs.after(requests, rollout)
    trainer = scored.score(stack)
    return Measurement(time.perf_counter() - start, case.counted_tokens, [o.tokens for o in rollout],
                       (scored, [o.logprobs for o in rollout], trainer))


def _with_new_tokens(requests: list[Request], n: int) -> list[Request]:
    return [dataclasses.replace(r, max_new_tokens=n) for r in requests]


def _time_rollout(stack: Stack, requests: list[Request]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = stack.rollout(requests)
    seconds = time.perf_counter() - start
    return seconds, [o.tokens for o in outputs]


def _time_trainer_step(stack: Stack, sequences, score_from: int, sampled: Request) -> float:
    """Forward + backward of the summed log-probs with respect to every trainer parameter, scored as `sampled`
    was sampled (its temperature, at least 1: greedy scores at 1; its truncation and log-prob mode)."""
    params = list(stack.trainer_parameters().values())
    for p in params:
        p.requires_grad_(True)
    try:
        start = time.perf_counter()
        scored = TrainerInputs([list(s) for s in sequences], [score_from] * len(sequences),
                               [sampled.temperature or 1.0] * len(sequences), [sampled.processing] * len(sequences))
        logprobs = scored.score(stack, grad=True)
        torch.cat(logprobs).sum().backward()
        return time.perf_counter() - start
    finally:
        for p in params:
            p.grad = None
            p.requires_grad_(False)


def token_agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How `other`'s generated ids compare with `reference`'s: same count per request (the same work),
    fraction of equal ids, and the first (request, index) where they differ."""
    same_counts = [len(a) for a in reference] == [len(b) for b in other]
    total = sum(len(a) for a in reference)
    equal = sum(x == y for a, b in zip(reference, other) for x, y in zip(a, b))
    first = next(((i, j) for i, (a, b) in enumerate(zip(reference, other)) for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return {"same_counts": same_counts, "equal_ids": equal, "ids": total,
            "first_difference": None if first is None else {"request": first[0], "index": first[1]}}
