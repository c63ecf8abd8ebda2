"""The exit status, the same for every command: 0 every stack passed, 1 a stack failed a property, 2 bad input or
nothing could run (a missing engine, a stack that declined everything, an unsupported degree), decided before
any work where it can be, in one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from logdiff.api import Unsupported
from logdiff.cli.main import build_parser, main
from logdiff.cli.options import EXIT_CODES

TESTS = Path(__file__).resolve().parent
QUICK = ["--batch-size", "1", "--prompt-lens", "3", "--max-new-tokens", "2"]


def declining_stack(spec, dtype, max_model_len):
    """declines every model, dtype and property"""
    raise Unsupported("this stand-in declines everything")


def logdiff(*args, cwd):
    # the tests folder on the path for `test_exit_codes:declining_stack`, after whatever the caller set
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "logdiff", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": path, "LOGDIFF_VLLM_PYTHON": sys.executable})


def test_every_command_documents_the_exit_codes():
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    assert set(subcommands) == {"run", "list", "analyze", "bisect", "capture", "check", "bench", "train"}
    for p in (parser, *subcommands.values()):
        assert EXIT_CODES in p.format_help()


@pytest.mark.parametrize("command", ["run", "check", "bench", "bisect", "capture", "train"])
def test_a_missing_engine_is_one_line_exit_2_before_any_work(tmp_path, command):
    out = logdiff(command, "--stack", "vllm", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("logdiff: error: stack 'vllm' cannot run here: no vllm in ") and out.stderr.count("\n") == 1
    assert not out.stdout and not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_an_unsupported_degree_is_exit_2(capsys):
    assert main(["run", *QUICK, "--tp", "3"]) == 2
    out = capsys.readouterr().out
    assert out.count("skipped: TP 3 / EP 1: supported TP degrees") == 2


def test_a_stack_that_declines_everything_is_exit_2(tmp_path):
    run = logdiff("run", *QUICK, "--stack", "test_exit_codes:declining_stack", cwd=tmp_path)
    assert run.returncode == 2 and "skipped: this stand-in declines everything" in run.stdout, run.stderr
    check = logdiff("check", "--stack", "test_exit_codes:declining_stack", "--property", "C3", "--property", "C12",
                    "--workload-examples", "0", cwd=tmp_path)
    assert check.returncode == 2, check.stdout[-3000:]
    assert "nothing ran: stack test_exit_codes:declining_stack declined every property" in check.stdout
    bench = logdiff("bench", "--stack", "test_exit_codes:declining_stack", "--case", "decode-b1", "--repeats", "1",
                    "--model", "qwen3-moe-tiny", "--dtype", "fp32", cwd=tmp_path)
    assert bench.returncode == 2 and "skipped: this stand-in declines everything" in bench.stdout, bench.stderr[-3000:]


def test_a_stack_that_passes_is_exit_0_and_one_that_fails_exit_1(capsys):
    assert main(["run", *QUICK, "--stack", "reference"]) == 0
    assert main(["run", *QUICK, "--prompt-lens", "130", "--stack", "reference", "--stack", "reference-no-blocks"]) == 1
