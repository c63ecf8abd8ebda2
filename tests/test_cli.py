"""`logdiff run` and `logdiff list` end to end, and every kind of bad input: one line, exit 2, no file."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from logdiff.cli.main import main
from logdiff.weights import ModelSpec, save_checkpoint

QUICK = ["--batch-size", "2", "--prompt-lens", "3,130", "--max-new-tokens", "4"]


def logdiff(*args):
    return subprocess.run([sys.executable, "-m", "logdiff", *args], capture_output=True, text=True)


def test_default_run_prints_a_row_per_stack():
    out = logdiff("run", *QUICK)
    assert out.returncode == 1, out.stderr  # baseline fails
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.split()[:1] in (["reference"], ["baseline"])}
    assert rows["reference"][-2] == "pass" and rows["reference"][1] == rows["reference"][2]
    assert rows["baseline"][-2] == "fail"
    assert "baseline: C3 (rollout vs trainer): logprobs differ at seq" in out.stdout


def test_json_envelope_and_dump(tmp_path):
    path = tmp_path / "run.json"
    assert main(["run", *QUICK, "--dtype", "bf16", "--stack", "reference", "--stack", "baseline",
                 "--json", str(path), "--dump", str(tmp_path / "dump")]) == 1
    env = json.loads(path.read_text())
    assert env["schema"] and env["suite"]["version"] and env["suite"]["commit"] and env["platform"]["torch"]
    assert env["workload"]["dtype"] == "bf16" and env["workload"]["prompt_lens"] == [3, 130]
    ref, base = env["stacks"]
    assert ref["name"] == "reference" and ref["verdict"] == "pass" and ref["bitwise_equal_tokens"] == ref["tokens"] == 8
    assert ref["first_divergence"] is None and ref["max_abs_logdiff"] == 0
    assert env["memory"]["peak_rss_bytes"] > ref_weights_bytes() and env["memory"]["children_peak_rss_bytes"] >= 0
    assert base["verdict"] == "fail" and base["first_divergence"]["rollout_bits"].startswith("0x")
    for name in ("training/rollout_probs_diff_max", "rollout_corr/k3_kl", "train_rollout_logprob_abs_diff"):
        assert ref["metrics"][name] == 0.0 and name in base["metrics"]
    dumped = load_file(tmp_path / "dump" / "reference.safetensors")
    assert torch.equal(dumped["rollout_logprobs"], dumped["trainer_logprobs"])
    assert dumped["tokens"].shape == (2, 134) and dumped["response_mask"].sum() == 8
    assert not [p for p in tmp_path.rglob(".*")], "temporary files left behind"


def ref_weights_bytes():
    return ModelSpec("qwen3-moe-tiny").checkpoint_bytes(torch.bfloat16)


def test_run_on_a_cut_model_names_its_depth_and_prints_peak_memory(capsys):
    assert main(["run", *QUICK, "--stack", "reference", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-moe-tiny (--layers 1) fp32" in out
    assert "memory: peak RSS" in out and "weights" in out


def test_list_names_stacks_and_models(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "baseline", "naive", "reference-no-mask", "hf", "qwen3-30b-a3b", "qwen3-dense-tiny"):
        assert name in out


def corrupt_checkpoint(tmp_path):
    save_checkpoint(ModelSpec("qwen3-dense-tiny").build(torch.float32), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return tmp_path


def truncated_config(tmp_path):
    save_checkpoint(ModelSpec("qwen3-dense-tiny").build(torch.float32), tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", ')
    return tmp_path


BAD = {
    "unknown stack": (lambda t: ["--stack", "nope"], "unknown stack 'nope'"),
    "bad module stack": (lambda t: ["--stack", "no_such_module:stack"], "cannot import stack module"),
    "unknown model": (lambda t: ["--model", "qwen4"], "unknown model"),
    "unknown dtype": (lambda t: ["--dtype", "fp8"], "unknown dtype 'fp8'"),
    "prompt too long": (lambda t: ["--prompt-lens", "9000"], "exceeds the 8192 positions"),
    "batch size 0": (lambda t: ["--batch-size", "0"], "batch size 0"),
    "negative temperature": (lambda t: ["--temperature", "-1"], "temperature -1.0 is negative"),
    "not a length list": (lambda t: ["--prompt-lens", "a,b"], "not a comma-separated list"),
    "missing checkpoint": (lambda t: ["--model", str(t)], "has no config.json"),
    "corrupt weights": (lambda t: ["--model", str(corrupt_checkpoint(t))], "not a readable safetensors file"),
    "corrupt config": (lambda t: ["--model", str(truncated_config(t))], "is not valid JSON"),
    "depth outside the model": (lambda t: ["--layers", "3"], "--layers 3 is outside 1..2"),
    "json folder missing": (lambda t: ["--json", str(t / "no" / "such" / "r.json")], "does not exist"),
    "json path is a folder": (lambda t: ["--json", str(t)], "is a directory"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, case):
    make_args, message = BAD[case]
    args = make_args(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    assert main(["run", *QUICK, *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("logdiff: error: ") and message in err[-1], err
    assert not any(line.startswith("logdiff: error") for line in err[:-1])
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("args", [["--stack", "nope"], ["--model", "qwen4"]])
def test_bad_input_from_the_shell_has_no_traceback(args):
    out = logdiff("run", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("logdiff: error: ")


@pytest.mark.parametrize("omp, flag, threads", [(None, [], 1), ("3", [], 3), ("3", ["--threads", "2"], 2)])
def test_threads_default_to_omp_num_threads_else_1_and_are_reported(tmp_path, capsys, monkeypatch, omp, flag, threads):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    path = tmp_path / "run.json"
    assert main(["run", *QUICK, "--stack", "reference", *flag, "--json", str(path)]) == 0
    platform = capsys.readouterr().out.splitlines()[1]  # the header's second line
    assert platform.startswith("platform: ") and f", {threads} thread{'s' * (threads > 1)}, " in platform
    assert json.loads(path.read_text())["platform"]["threads"] == threads
    assert torch.get_num_threads() == before  # restored for in-process callers


@pytest.mark.parametrize("omp, flag, message", [
    (None, ["--threads", "0"], "--threads 0 is not positive"),
    ("many", [], "OMP_NUM_THREADS='many' is not a positive integer"),
])
def test_bad_thread_count_is_one_line(capsys, monkeypatch, omp, flag, message):
    if omp:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert main(["run", *QUICK, *flag]) == 2
    assert message in capsys.readouterr().err


def test_every_computing_command_takes_threads_and_states_the_default():
    from logdiff.cli.main import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("run", "check", "bisect", "capture", "bench", "train", "analyze"):
        assert "$OMP_NUM_THREADS if set, else 1: chosen for a shared machine" in " ".join(commands[name].format_help().split())
