"""The example plugin (examples/logdiff-example-stack) as a third party ships it: built and installed
with pip, found through the `logdiff.stacks` entry point, run through the catalogue. A property it
declines is reported as skipped, with its reason."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """An environment where the example package is installed (into its own folder on PYTHONPATH)."""
    work = tmp_path_factory.mktemp("example")
    source = shutil.copytree(REPO / "examples" / "logdiff-example-stack", work / "src")  # builds write beside the source
    site = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def test_plugin_stack_is_listed(plugin_env):
    result = subprocess.run([sys.executable, "-m", "logdiff", "list"], env=plugin_env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "example" in result.stdout and "logdiff_example_stack:RecomputeStack" in result.stdout


def test_plugin_runs_through_the_catalogue(plugin_env):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "--stack", "example", "-p", "no:cacheprovider", "-rA",
         "-k", "test_c3_rollout_matches_trainer and dense or test_c11_trainer_differentiable"],
        cwd=REPO, env=plugin_env, capture_output=True, text=True, timeout=600,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    assert "logdiff conformance: stack example, device cpu" in out
    assert "PASSED conformance/test_c03_rollout_trainer.py::test_c3_rollout_matches_trainer[dense]" in out
    assert "stack example declines: stack example does not expose its trainer's parameters" in out
    summary = out.strip().splitlines()[-1]
    assert "1 passed" in summary and "2 skipped" in summary and "failed" not in summary
