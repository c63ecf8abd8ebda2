"""Workloads drawn from a seed (hypothesis), beside the catalogue's fixed edge workloads: a stack that is
bitwise only on the fixed shapes fails here. `--workload-seed S` and `--workload-examples N` choose them;
a failure is shrunk to a minimal workload (for at most `--workload-shrink-seconds`, if given) and printed
as the `logdiff run` line that reproduces it."""

from __future__ import annotations

import sys
import time

import pytest
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from logdiff.api import Unsupported
from logdiff.workload import Workload

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup  # hypothesis' own dependency before Python 3.11

MAX_PROMPT, MAX_BATCH, MAX_NEW_TOKENS = 300, 32, 8  # within the catalogue's 512-position stacks
# Prompt tokens of one workload, and prefill forwards per prompt: a 2-core budget of about a second an example.
MAX_PROMPT_TOKENS, MAX_CHUNKS = 1536, 24


@st.composite
def workloads(draw, dtypes=("fp32", "bf16", "fp16")) -> Workload:
    batch = draw(st.integers(1, MAX_BATCH))
    longest = min(MAX_PROMPT, MAX_PROMPT_TOKENS // batch)
    prompt_lens = tuple(draw(st.lists(st.integers(1, longest), min_size=1, max_size=min(batch, 6))))
    return Workload(
        model=draw(st.sampled_from(["qwen3-moe-tiny", "qwen3-dense-tiny"])),
        dtype=draw(st.sampled_from(dtypes)),
        batch_size=batch,
        prompt_lens=prompt_lens,
        max_new_tokens=draw(st.integers(1, MAX_NEW_TOKENS)),
        temperature=draw(st.sampled_from([0.0, 0.7, 1.0, 1.3])),
        seed=draw(st.integers(0, 1)),
        block_size=draw(st.sampled_from([1, 7, 16, 64, 128, 256])),
        stagger=draw(st.integers(0, 3)),
        prefill_chunk=draw(st.none() | st.integers(-(-max(prompt_lens) // MAX_CHUNKS), MAX_PROMPT)),
    )


# Regimes where engines switch kernels: contexts to 4,300 positions (past 2048 and 4096) and up to 256 requests
# at once, each drawn log-uniformly (a power of two, then a value up to it) so that short and long, one and
# many, are all common. Prompt tokens per workload are capped to keep an example to seconds on 2 cores.
MAX_REGIME_PROMPT, MAX_REGIME_BATCH, MAX_REGIME_NEW_TOKENS, MAX_REGIME_PROMPT_TOKENS = 4200, 256, 128, 16_000


def _log_uniform(draw, top: int) -> int:
    ceiling = 1 << draw(st.integers(0, top.bit_length() - 1))
    return min(top, draw(st.integers(ceiling // 2 + 1, ceiling)) if ceiling > 1 else 1)


@st.composite
def regime_workloads(draw) -> Workload:
    batch = _log_uniform(draw, MAX_REGIME_BATCH)
    longest = min(MAX_REGIME_PROMPT, MAX_REGIME_PROMPT_TOKENS // batch)
    prompt_lens = tuple(_log_uniform(draw, longest) for _ in range(draw(st.integers(1, min(batch, 4)))))
    return Workload(
        model="qwen3-moe-tiny",
        dtype=draw(st.sampled_from(["fp32", "bf16"])),
        batch_size=batch,
        prompt_lens=prompt_lens,
        max_new_tokens=_log_uniform(draw, MAX_REGIME_NEW_TOKENS),
        temperature=draw(st.sampled_from([0.0, 1.0])),
        stagger=draw(st.integers(0, 2)),
    )


class DistinctFailures(AssertionError):
    """Hypothesis found several distinct failures: the message names each, the notes give each workload."""


def for_each_workload(config, check, strategy=None) -> None:
    """Runs `check(workload)` on `--workload-examples` workloads drawn with `--workload-seed`; on failure
    hypothesis shrinks to a minimal workload and re-raises its error. A workload the stack declines
    (`Unsupported`, e.g. a KV page size its engine lacks) is rejected, not failed; if it declines every
    one, the test is declined (skipped) with the last reason.

    `--workload-shrink-seconds S` bounds the shrinking: S seconds after the first failure, nothing runs any
    more; a workload seen failing raises its first error again (hypothesis asks for the smallest several
    times, through choice sequences that draw the same workload) and every other is rejected. Whether the
    test fails never depends on it, only how small its reproducer is; it matters where an example costs an
    engine restart (vLLM: 20-30 s for each run of a workload that crashes its engine)."""
    __tracebackhide__ = True
    examples = config.getoption("--workload-examples")
    if examples == 0:  # nothing checked: reported as skipped, never as passed
        pytest.skip("--workload-examples 0: no generated workload")
    shrink_seconds = config.getoption("--workload-shrink-seconds")
    failing: dict[Workload, Exception] = {}  # each failing workload's first error
    first_failure: list[float] = []  # time.monotonic() of the first failure, once there is one

    @hypothesis_seed(config.getoption("--workload-seed"))
    # No explain phase: it would run variations of the minimal workload after shrinking, each another rollout.
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False, print_blob=False,
              phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck))
    @given(strategy if strategy is not None else workloads())
    def run(workload):
        if shrink_seconds is not None and first_failure and time.monotonic() - first_failure[0] > shrink_seconds:
            if workload in failing:
                raise failing[workload]  # the same object: hypothesis tells failures apart by where they were raised
            reject()
        try:
            check(workload)
        except Unsupported as e:
            declined.append(e)
            reject()
        except Exception as e:
            e.workloads = [workload]  # what the reproducer lines name (plugin.reproducer)
            failing.setdefault(workload, e)
            first_failure[:] = first_failure or [time.monotonic()]
            raise

    declined: list[Unsupported] = []
    try:
        run()
    except Unsatisfiable:
        raise declined[-1] from None
    except ExceptionGroup as group:  # pytest would only say "Hypothesis found 2 distinct failures"
        raise distinct_failures(group) from group


def distinct_failures(group: ExceptionGroup) -> DistinctFailures:
    """One failure whose message names each of hypothesis' distinct failures (its first line)."""
    lines = [f"({i}) {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
             for i, e in enumerate(group.exceptions, 1)]
    failure = DistinctFailures(f"{len(lines)} distinct failures: " + "; ".join(lines))
    failure.workloads = [w for e in group.exceptions for w in getattr(e, "workloads", [])]
    for i, e in enumerate(group.exceptions, 1):
        for note in getattr(e, "__notes__", []):
            failure.add_note(f"({i}) {note}")
    return failure
