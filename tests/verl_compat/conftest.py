"""The comparison with verl's own metric code runs only where verl 0.9.1 is installed (`nox -s verl`);
the default run has no verl and leaves this folder's tests out rather than skipping them."""

from __future__ import annotations

import importlib.util
import os

import pytest

collect_ignore = [] if importlib.util.find_spec("verl") else ["test_verl_metrics.py"]


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
