"""The comparison with verl's own metric code, and verl's actor as a logdiff trainer, run only where verl 0.9.1 is
installed (`nox -s verl`); the default run has no verl and leaves this folder's tests out rather than skipping them."""

from __future__ import annotations

import importlib.util
import os

import pytest

collect_ignore = [] if importlib.util.find_spec("verl") else ["test_verl_metrics.py", "test_verl_trainer.py"]

# What test_verl_trainer.py measured (the `trainer_findings` fixture), its "summary" lines printed at the end of
# the run: pytest captures the tests' own output.
TRAINER_RECORDS: list[dict] = []


def pytest_terminal_summary(terminalreporter):
    lines = [r["summary"] for r in TRAINER_RECORDS if "summary" in r]
    if lines:
        terminalreporter.section("verl trainer: measured")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def comparisons():
    """Every metric compared, logdiff's value beside verl's; written as a result envelope at the end when
    LOGDIFF_VERL_RESULTS names a file (the nox session points it under results/<machine>/verl/)."""
    records: list[dict] = []
    yield records
    path = os.environ.get("LOGDIFF_VERL_RESULTS")
    if path:
        import tensordict
        import transformers
        import verl

        from logdiff import report
        from logdiff.workload import Workload

        versions = {"verl": verl.__version__, "transformers": transformers.__version__, "tensordict": tensordict.__version__}
        workload = {**Workload().to_dict(), "dtype": sorted({r["dtype"] for r in records})}
        report.write_json(path, report.envelope("verl", workload, records, verl=versions))


@pytest.fixture(scope="session")
def trainer_findings():
    """test_verl_trainer.py's measurements, one record per model and check; written as a result envelope
    (trainer.json) beside LOGDIFF_VERL_RESULTS's metrics.json when that variable is set (the nox session sets it),
    their "summary" lines printed at the end of the run."""
    records = TRAINER_RECORDS
    yield records
    path = os.environ.get("LOGDIFF_VERL_RESULTS")
    if path and records:
        from pathlib import Path

        import tensordict
        import transformers
        import verl

        from logdiff import report

        versions = {"verl": verl.__version__, "transformers": transformers.__version__, "tensordict": tensordict.__version__}
        workload = {k: v for r in records if r["check"] == "workload" for k, v in r.items() if k != "check"}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        report.write_json(Path(path).parent / "trainer.json",
                          report.envelope("verl-trainer", workload, [r for r in records if r["check"] != "workload"],
                                          verl=versions))
