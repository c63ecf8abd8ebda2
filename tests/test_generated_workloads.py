"""Generated workloads (logdiff.conformance.generated): the shrink budget bounds how long a failure is
shrunk without changing the verdict, and several distinct failures are named one by one."""

import pytest
from hypothesis import strategies as st

from logdiff.conformance.generated import DistinctFailures, for_each_workload
from logdiff.workload import Workload

BATCHES = st.builds(Workload, batch_size=st.integers(1, 32))


class Options(dict):
    """The catalogue's command-line options, as pytest's config hands them to a test."""

    def getoption(self, name):
        return self[name]


def options(shrink_seconds=None, examples=20):
    return Options({"--workload-seed": 0, "--workload-examples": examples, "--workload-shrink-seconds": shrink_seconds})


def run(config, fails) -> tuple[list[Workload], BaseException]:
    """Every workload the check ran, in order, and what for_each_workload raised."""
    ran = []

    def check(w):
        ran.append(w)
        if fails(w):
            raise ValueError(f"batch {w.batch_size}")

    with pytest.raises(Exception) as e:
        for_each_workload(config, check, BATCHES)
    return ran, e.value


def test_without_a_budget_a_failure_is_shrunk_to_the_minimal_workload():
    ran, error = run(options(), lambda w: w.batch_size >= 5)
    assert str(error) == "batch 5" and ran[-1].batch_size == 5
    assert error.workloads == [Workload(batch_size=5)]  # what the reproducer lines name


def test_a_zero_budget_runs_nothing_after_the_first_failure():
    ran, error = run(options(shrink_seconds=0), lambda w: w.batch_size >= 5)
    assert ran[-1].batch_size >= 5 and all(w.batch_size < 5 for w in ran[:-1])  # not even the replays hypothesis asks for
    assert str(error) == f"batch {ran[-1].batch_size}"  # still a failure: the verdict does not depend on the budget
    assert error.workloads == [ran[-1]]


def test_a_budget_shrinks_until_it_is_spent():
    ran, error = run(options(shrink_seconds=3600), lambda w: w.batch_size >= 5)
    assert str(error) == "batch 5" and ran[-1].batch_size == 5


def test_distinct_failures_are_named_one_by_one():
    def check(w):
        if w.batch_size < 16:
            raise ValueError("small batch")
        raise RuntimeError("large batch")

    named = r"^2 distinct failures: \(1\) \w+Error: \w+ batch; \(2\) \w+Error: \w+ batch\n"  # notes follow
    with pytest.raises(DistinctFailures, match=named) as e:
        for_each_workload(options(), check, BATCHES)
    assert {"ValueError", "RuntimeError"} <= {word.rstrip(":") for word in str(e.value).split()}
    assert [w.batch_size < 16 for w in e.value.workloads] in ([True, False], [False, True])
    assert sum("Falsifying example" in note or "Failing test case" in note for note in e.value.__notes__) == 2
