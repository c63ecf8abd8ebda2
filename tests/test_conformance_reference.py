"""The positive control: the reference stack passes the whole conformance catalogue, every property,
run as a user runs it (`pytest conformance --stack reference`). About a minute on 2 cores; it keeps
kernel changes from silently breaking a property."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_reference_passes_every_property():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "--stack", "reference", "-p", "no:cacheprovider", "-q", "-rfEs"],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-6000:]
    assert " passed" in summary and not any(word in summary for word in ("failed", "skipped", "xfailed", "error"))
