"""`logdiff check` as a CI gate: its JUnit XML agrees with check.json and the exit status, a bad --junit-xml is
one line and exit 2 before any work, and docs/ci-gate.md's workflow is valid YAML running a command check accepts."""

import json
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from logdiff.cli.main import build_parser, main

REPO = Path(__file__).resolve().parent.parent
GATE = ["--property", "C3", "--workload-examples", "0"]


def check(*args, cwd):
    return subprocess.run([sys.executable, "-m", "logdiff", "check", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """reference-no-blocks through C3's fixed workloads: some pass, some differ, one is declined."""
    folder = tmp_path_factory.mktemp("gate")
    result = check("--stack", "reference-no-blocks", *GATE, "--out", "out", "--junit-xml", "junit.xml", cwd=folder)
    return result, folder


def test_the_junit_xml_counts_what_check_json_counts(failing):
    result, folder = failing
    assert result.returncode == 1, result.stderr[-3000:]
    [suite] = ET.parse(folder / "junit.xml").getroot().iter("testsuite")
    tests = json.loads((folder / "out" / "check.json").read_text())["stacks"][0]["tests"]
    outcomes = {t["id"]: t["outcome"] for t in tests}
    assert suite.get("name") == "logdiff check reference-no-blocks"
    assert int(suite.get("tests")) == len(tests) and int(suite.get("errors")) == 0
    assert int(suite.get("failures")) == list(outcomes.values()).count("fail") > 0
    assert int(suite.get("skipped")) == list(outcomes.values()).count("skipped")
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert set(cases) == set(outcomes)
    for name, case in cases.items():
        failure = case.find("failure")
        assert (failure is not None) == (outcomes[name] == "fail"), name
        if failure is not None:
            assert re.search(r"logprobs differ at seq \d+ pos \d+: 0x", failure.get("message"))
            assert f"reproduce: logdiff check --stack reference-no-blocks -k '{name}'" in failure.get("message")
    assert not [p for p in folder.iterdir() if p.name.startswith(".junit.xml.")]  # the temporary file was renamed


def test_the_summary_and_check_json_say_what_ran(failing):
    result, folder = failing
    assert ("reference-no-blocks: ran GEMM logdiff GEMM (one fixed K order); attention trainer train_attention, "
            "rollout rollout_attention; alignments off: blocks") in result.stdout
    assert "\nran: mkl " in result.stdout and "fell back: " in result.stdout
    assert "\n  ran: mkl " in result.stderr and "  ran: mkl " in (folder / "out" / "check.md").read_text()  # the header
    envelope = json.loads((folder / "out" / "check.json").read_text())
    assert envelope["stacks"][0]["describe"]["kernels"]["switched_off"] == ["blocks"]
    assert set(envelope["platform"]) >= {"gemm_tiers", "libraries", "isa", "versions", "switches", "fallbacks", "threads"}


def test_a_passing_gate_exits_0_with_no_failure_in_the_xml(tmp_path):
    result = check("--stack", "reference", *GATE, "--out", "out", "--junit-xml", "junit.xml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    [suite] = ET.parse(tmp_path / "junit.xml").getroot().iter("testsuite")
    assert suite.get("failures") == "0" and suite.get("errors") == "0" and int(suite.get("tests")) > 0


@pytest.mark.parametrize("path, message", [
    ("no/such/folder/junit.xml", "--junit-xml folder no/such/folder does not exist"),
    (".", "--junit-xml path . is a directory"),
])
def test_a_bad_junit_path_is_one_line_exit_2_before_any_work(tmp_path, capsys, monkeypatch, path, message):
    monkeypatch.chdir(tmp_path)
    assert main(["check", "--stack", "reference", *GATE, "--junit-xml", path]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_the_documented_workflow_parses_and_runs_a_command_check_accepts():
    doc = (REPO / "docs" / "ci-gate.md").read_text()
    [block] = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    workflow = yaml.safe_load(block)
    [job] = workflow["jobs"].values()
    [gate] = [step["run"] for step in job["steps"] if "logdiff check" in step.get("run", "")]
    words = shlex.split(gate.replace('"$STACK"', job["env"]["STACK"]))
    args = build_parser().parse_args(words[1:])
    assert args.command == "check" and args.stack == "reference" and args.properties == ["C0", "C3"]
    assert args.junit_xml == "logdiff-junit.xml"
    assert any(step.get("with", {}).get("report_paths") == args.junit_xml for step in job["steps"])
