"""`logdiff check`: the property x verdict table, the exit status, the result files and badges, and
one-line errors for bad input (before any test runs)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from logdiff.cli.main import main
from logdiff.conformance.check import RESULT_FILES
from logdiff.conformance.test_c03_rollout_trainer import CASES as C3_CASES

REPO = Path(__file__).resolve().parent.parent


def check(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "logdiff", "check", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """reference-no-blocks through C3: the ablation must fail the workloads with contexts over 64 tokens."""
    out = tmp_path_factory.mktemp("check") / "no-blocks"
    return check("--stack", "reference-no-blocks", "--property", "C3", "--out", str(out)), out


def test_failing_property_exits_1_with_table_and_divergence(failing):
    result, _ = failing
    assert result.returncode == 1, result.stderr[-3000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith("C3 "))
    assert "rollout = trainer" in row and row.split()[-3] == "fail"  # then the two figures
    assert "FAIL (differ) test_c3_rollout_matches_trainer[breaks-no-blocks]" in result.stdout
    assert "logprobs differ at seq 0 pos" in result.stdout
    tests = len(C3_CASES) + 2  # the fixed workloads, the generated edges and the generated regimes
    assert f"[{tests - 1:>3}/{tests}] C3   test_c3_rollout_matches_trainer_generated:" in result.stderr  # progress
    assert f"[{tests:>3}/{tests}] C3   test_c3_rollout_matches_trainer_generated_regimes:" in result.stderr
    assert re.search(r"\[  1/\d+\] C3 .*; \d+s elapsed, ~\S+ left\)", result.stderr)  # and an estimate of the rest


def test_result_files_record_the_verdicts(failing):
    _, out = failing
    envelope = json.loads((out / "check.json").read_text())
    assert envelope["command"] == "check" and envelope["schema"] == "logdiff/result/v1"
    [stack] = envelope["stacks"]
    assert stack["name"] == "reference-no-blocks" and stack["verdict"] == "fail"
    assert stack["describe"]["versions"]["torch"].startswith("2.13.0")
    c3 = stack["properties"]["C3"]
    assert c3["tests"] == len(C3_CASES) + 2 and c3["fail"] >= 1 and c3["fail"] + c3["pass"] == len(C3_CASES) + 2
    broken = next(t for t in stack["tests"] if t["id"] == "test_c3_rollout_matches_trainer[breaks-no-blocks]")
    assert broken["outcome"] == "fail" and "logprobs differ at seq" in broken["message"]
    assert stack["max_abs_logdiff"] == c3["max_abs_diff"] > 0
    assert "| C3 " in (out / "check.md").read_text() and "## Failures" in (out / "check.md").read_text()
    badge = (out / "conformance.svg").read_text()
    assert badge.startswith("<?xml") and "1 fail" in badge
    assert f"{stack['max_abs_logdiff']:.3g}" in (out / "logdiff.svg").read_text()


def test_xfailed_gaps_exit_0(failing, tmp_path):
    _, out = failing
    failed = [t["id"] for t in json.loads((out / "check.json").read_text())["stacks"][0]["tests"] if t["outcome"] == "fail"]
    xfails = tmp_path / "xfails.txt"
    xfails.write_text("\n".join(failed) + "\n")
    result = check("--stack", "reference-no-blocks", "--property", "C3", "--xfails-file", str(xfails),
                   "--out", str(tmp_path / "r"))
    assert result.returncode == 0, result.stdout[-3000:]
    stack = json.loads((tmp_path / "r" / "check.json").read_text())["stacks"][0]
    assert stack["properties"]["C3"]["verdict"] == "xfail" and stack["properties"]["C3"]["xfail"] == len(failed)
    assert "1 xfail" in (tmp_path / "r" / "conformance.svg").read_text()


def test_passing_property_exits_0_with_green_badges_under_logdiff_out(tmp_path):
    """Without --out a user's run writes under ./logdiff-out/check/<stack>, never the repository's results/."""
    result = check("--stack", "reference", "--property", "C12", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"\[\s*(\d+)/\1\] C12 ", result.stderr)  # the last progress line
    out = tmp_path / "logdiff-out" / "check" / "reference"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(RESULT_FILES)
    stack = json.loads((out / "check.json").read_text())["stacks"][0]
    assert stack["verdict"] == "pass" and stack["max_abs_logdiff"] == 0.0
    assert "1 pass" in (out / "conformance.svg").read_text()
    assert ">0<" in (out / "logdiff.svg").read_text()


@pytest.mark.parametrize("args, message", [
    (["--stack", "no-such-stack"], "unknown stack 'no-such-stack'"),
    (["--stack", "reference", "--property", "C16"], "unknown property 'C16'; choose from C0, C1"),
    (["--stack", "reference", "--xfails-file", "no/such/file.txt"], "--xfails-file no/such/file.txt is not a file"),
    (["--stack", "reference", "--out", "pyproject.toml"], "--out pyproject.toml exists and is not a directory"),
    (["--stack", "reference", "--layers", "1"], "--layers cuts the model --model names; pass --model"),
    (["--stack", "reference", "--model", "qwen3-moe-tiny", "--layers", "5"], "--layers 5 is outside 1..2"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, monkeypatch, args, message):
    monkeypatch.chdir(REPO)
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_printed_reproduce_and_locate_lines_run_as_printed_from_any_directory(failing, tmp_path):
    """The summary's reproduce line, and the failure's `logdiff run` / `logdiff bisect` lines, each run in a shell
    from an empty folder (the `logdiff` of this environment on PATH) and fail the same way (exit 1)."""
    result, _ = failing
    summary = result.stdout[result.stdout.index("logdiff check: stack reference-no-blocks"):]
    first = next(line for line in summary.splitlines() if line.startswith("first failure (differ): "))
    test_id = first.removeprefix("first failure (differ): ").split(": ")[0]
    [check_line] = [line.strip().removeprefix("reproduce: ") for line in summary.splitlines()
                    if "reproduce: logdiff check" in line]
    assert check_line == f"logdiff check --stack reference-no-blocks -k '{test_id}'"
    failure = result.stdout[result.stdout.index(f"FAIL (differ) {test_id}"):]
    run_line, bisect_line = (next(line.split(": ", 1)[1].strip() for line in failure.splitlines() if line.strip().startswith(k))
                             for k in ("reproduce: logdiff run", "locate:"))
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    for line in (check_line, run_line, bisect_line):
        out = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 1, (line, out.stderr[-2000:])
    rerun = json.loads((tmp_path / "logdiff-out" / "check" / "reference-no-blocks" / "check.json").read_text())["stacks"][0]
    assert [(t["id"], t["outcome"]) for t in rerun["tests"]] == [(test_id, "fail")]


def test_summary_is_last_and_separates_differences_from_errors(failing):
    result, out = failing
    summary = result.stdout[result.stdout.index("logdiff check: stack reference-no-blocks"):].splitlines()
    assert len(summary) <= 25  # one screen
    header = summary[1]
    for column in ("differ", "error", "max |a-b| bitwise pairs", "max |logp-fp64|"):
        assert column in header
    assert summary[-1] == f"files: {out}/ check.json check.md conformance.svg logdiff.svg"
    assert "verdict: fail: C3 fails" in summary
    assert any(line.startswith("first failure (differ): test_c3_rollout_matches_trainer") for line in summary)


def test_check_runs_the_transformers_stack_from_a_checkout(tmp_path):
    """pytest's default import mode would put the checkout's root on sys.path, where kernels/ shadows Hugging Face's
    `kernels` that transformers imports: `check --stack hf` ended in an INTERNALERROR."""
    result = check("--stack", "hf", "-k", "test_c3_rollout_matches_trainer[dense]", cwd=tmp_path)
    assert result.returncode == 1 and "INTERNALERROR" not in result.stderr, result.stderr[-3000:]
    assert "first failure (differ): test_c3_rollout_matches_trainer[dense]" in result.stdout


def test_model_option_runs_every_workload_on_that_model_and_says_so(tmp_path):
    """--model and --layers: a failure reproduces on the model it ran on, cut as it was; C9, which builds its own
    weights, is skipped."""
    result = check("--stack", "reference-no-blocks", "--model", "qwen3-dense-tiny", "--layers", "1", "--property", "C3",
                   "--property", "C9", "-k", "breaks-no-blocks or c9", "--out", str(tmp_path))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "reproduce: logdiff check --stack reference-no-blocks --model qwen3-dense-tiny --layers 1 -k" in result.stdout
    assert re.search(r"reproduce: logdiff run --stack reference-no-blocks --model qwen3-dense-tiny --layers 1 ", result.stdout)
    c9 = json.loads((tmp_path / "check.json").read_text())["stacks"][0]["properties"]["C9"]
    assert c9["verdict"] == "skipped", c9


def test_an_unknown_model_is_one_line(tmp_path):
    result = check("--stack", "reference", "--model", "qwen3-nonexistent", "--out", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "qwen3-nonexistent" in result.stderr
