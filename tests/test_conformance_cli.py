"""`pytest conformance --stack NAME`, as a user runs it: the header names the stack, a failure prints
the first divergent (sequence, position) with both bit patterns, `--xfails-file` turns a known gap into
xfail, and a bad stack name is a one-line usage error."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ONE_ULP = "test_conformance_controls:one_ulp_stack"  # tests/test_conformance_controls.py
SELECTION = "test_c3_rollout_matches_trainer and dense or test_c1_run_to_run_determinism and trainer-sampled-same"


def pytest_conformance(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "-p", "no:cacheprovider", "-rA", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.fixture(scope="module")
def one_ulp_run():
    return pytest_conformance("--stack", ONE_ULP, "-k", SELECTION)


def test_header_names_the_stack_its_versions_and_device(one_ulp_run):
    assert f"logdiff conformance: stack {ONE_ULP}, device cpu" in one_ulp_run.stdout
    assert "versions: logdiff" in one_ulp_run.stdout and "torch 2.13.0" in one_ulp_run.stdout


def test_failure_names_the_divergent_token_with_its_bits(one_ulp_run):
    out = one_ulp_run.stdout
    assert one_ulp_run.returncode == 1, out[-3000:]
    assert "FAILED conformance/test_c03_rollout_trainer.py::test_c3_rollout_matches_trainer[dense]" in out
    assert "PASSED conformance/test_c01_determinism.py::test_c1_run_to_run_determinism[trainer-sampled-same]" in out
    assert "rollout vs trainer: 23/24 log-probs bitwise equal" in out
    assert "logprobs differ at seq 1 pos 3: 0x" in out


def test_xfails_file_marks_known_gaps(tmp_path):
    xfails = tmp_path / "xfails.txt"
    xfails.write_text("# known gap of the one-ulp control\ntest_c03_rollout_trainer.py::test_c3_rollout_matches_trainer[dense]\n")
    result = pytest_conformance("--stack", ONE_ULP, "-k", SELECTION, "--xfails-file", str(xfails))
    assert result.returncode == 0, result.stdout[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert "1 passed" in summary and "1 xfailed" in summary and "failed" not in summary.replace("xfailed", "")


def test_unknown_stack_is_a_one_line_usage_error():
    result = pytest_conformance("--stack", "no-such-stack", "--collect-only")
    assert result.returncode == 4
    assert "unknown stack 'no-such-stack'; choose one of" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--layers", "1"], "--layers cuts the model --model names; pass --model"),
    (["--model", "qwen3-moe-tiny", "--layers", "9"], "--layers 9 is outside 1..2"),
    (["--device", "gpu"], "--device 'gpu': logdiff runs on cpu, cuda, npu, xpu"),
])
def test_bad_model_depth_or_device_is_a_one_line_usage_error(args, message):
    result = pytest_conformance(*args, "--collect-only")
    assert result.returncode == 4 and message in result.stderr and "Traceback" not in result.stderr
