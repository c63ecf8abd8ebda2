"""`logdiff bisect` end to end: the text report, the JSON and the two pictures, and bad input."""

import json

import pytest

from logdiff.api import Stack
from logdiff.cli.main import main
from logdiff.kernels import reference_kernels
from logdiff.kernels.ablations import BREAKS_ON
from logdiff.stacks import KernelStack

NO_BLOCKS = ["--stack", "reference-no-blocks", "--batch-size", "1", "--prompt-lens", "100", "--max-new-tokens", "4"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_text_json_and_pictures(tmp_path, capsys):
    path = tmp_path / "no-blocks.json"
    assert main(["bisect", *NO_BLOCKS, "--json", str(path)]) == 1  # the paths diverge
    out = capsys.readouterr().out
    assert "first capture point that differs for this row: layers.0.attention  ->  kernel path" in out
    assert "rollout -" in out and "(0x" in out and "at the final log-prob" in out
    env = json.loads(path.read_text())
    assert env["command"] == "bisect" and env["workload"]["prompt_lens"] == [100]
    b = env["bisect"]
    assert b["first"]["point"] == "layers.0.attention" and b["first"]["klass"] == "kernel path"
    assert b["first"]["diff"]["rollout_bits"] != b["first"]["diff"]["trainer_bits"]
    assert b["divergence"]["seq"] == 0 and b["position"] == 99 + b["divergence"]["pos"] and len(b["logdiff"][0]) == 4
    grid = b["grid"]
    assert grid["layers"] == [0, 1] and grid["max_abs_diff"][grid["points"].index("attention")][0] > 0
    assert grid["max_abs_diff"][grid["points"].index("q_proj")][0] == 0.0
    for picture in env["pictures"].values():
        assert (tmp_path / picture).read_bytes().startswith(PNG_MAGIC)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "no-blocks-first-divergence.png", "no-blocks-logdiff.png", "no-blocks.json"]


def test_nothing_to_bisect_on_the_reference(tmp_path, capsys):
    path = tmp_path / "ref.json"
    fields = BREAKS_ON["reference-no-blocks"]
    assert main(["bisect", "--stack", "reference", "--prompt-lens", str(fields["prompt_lens"][0]), "--batch-size", "1",
                 "--max-new-tokens", "2", "--json", str(path)]) == 0
    assert "nothing to bisect" in capsys.readouterr().out
    env = json.loads(path.read_text())
    assert env["bisect"]["first"] is None and env["pictures"]["first_divergence"] is None
    assert (tmp_path / "ref-logdiff.png").exists() and not (tmp_path / "ref-first-divergence.png").exists()


class NoCaptureStack(Stack):
    def __init__(self, spec, dtype, max_model_len):
        self.inner = KernelStack(spec, dtype, max_model_len, reference_kernels())

    def rollout(self, requests, options=None):
        return self.inner.rollout(requests)

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False):
        return self.inner.trainer_logprobs(sequences, score_from, temperatures, grad)


@pytest.mark.parametrize("args, message", [
    (["--json", "/no/such/dir/b.json"], "--json folder /no/such/dir does not exist"),
    (["--stack", "baseline"], "bisect examines one stack, got 2"),
    (["--prefill-chunk", "0"], "prefill chunk 0 is not positive"),
    (["--path", "rollout", "--trainer-tp", "2"], "--path rollout compares the rollout with itself; --trainer-tp does not apply"),
    (["--path", "trainer"], "give it one, e.g. --trainer-tp 2"),
    (["--tp", "3"], "cannot run sharded as {'trainer_tp': 3, 'rollout_tp': 3, 'ep': 1} (TP 3 / EP 1: supported TP degrees"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert main(["bisect", *NO_BLOCKS, *args]) == 2
    assert message in _error_line(capsys)


def test_a_stack_without_the_capture_hook_is_refused(capsys):
    assert main(["bisect", "--stack", "test_bisect_cli:NoCaptureStack", "--max-new-tokens", "2"]) == 2
    assert "does not implement the capture hook" in _error_line(capsys)


def test_a_workload_the_stack_declines_is_one_line(capsys):
    assert main(["bisect", "--stack", "hf", "--prefill-chunk", "8", "--max-new-tokens", "2", "--batch-size", "1"]) == 2
    assert "cannot run this workload" in _error_line(capsys)


def _error_line(capsys) -> str:
    """stderr holds progress lines and exactly one error line, the last; no traceback."""
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("logdiff: error:")] == err[-1:] and "Traceback" not in "".join(err)
    return err[-1]
