"""`logdiff bench` end to end on a tiny model, its statistics, its same-work check and its bad input."""

import json
import re
import time

import pytest
import torch

from logdiff.api import RolloutOutput, Unsupported
from logdiff.bench.cases import CASES, measure, token_agreement
from logdiff.bench.stats import claim_reading, paired_ratio, spread
from logdiff.cli.main import main


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--model", "qwen3-moe-tiny", "--dtype", "fp32", "--stack", "reference", "--stack", "naive",
                 "--case", "decode-b1", "--case", "decode-b8", "--case", "trainer", "--repeats", "2", "--out", str(out)])
    return code, out


def test_bench_writes_envelope_badge_and_plot(bench_run):
    code, out = bench_run
    assert code == 0
    data = json.loads((out / "bench-qwen3-moe-tiny-fp32.json").read_text())
    assert data["schema"] == "logdiff/result/v1" and data["command"] == "bench"
    assert [s["name"] for s in data["stacks"]] == ["reference", "naive"]
    for stack in data["stacks"]:
        assert set(stack["cases"]) == {"decode-b1", "decode-b8", "trainer"}
        assert all(v > 0 for case in stack["cases"].values() for v in case["tokens_per_s"])
        assert all(len(case["tokens_per_s"]) == 2 for case in stack["cases"].values())
    claim = [r for r in data["ratios"] if r["reading"] == "the claim"]
    assert {r["case"] for r in claim} == {"decode-b1", "decode-b8", "trainer"}
    assert all(r["min"] <= r["median"] <= r["max"] for r in claim)
    assert len(data["loadavg"]["before"]) == 3 and data["platform"]["threads"] >= 1
    limits = data["limits"]
    assert limits["machine"]["bandwidth_bytes_per_s"] > 0 and limits["machine"]["gemm_flop_per_s"] > 0
    assert {limits["cases"][c]["limit"] for c in ("decode-b1", "decode-b8", "trainer")} == {"memory bandwidth", "GEMM peak"}
    assert all(0 < limits["cases"][c]["fraction"][s]["median"] for c in limits["cases"] for s in ("reference", "naive"))
    assert data["peers"]["figures"] and "own hardware" in data["peers"]["note"]
    # greedy fp32 on the same weights: naive generated exactly the reference's tokens
    check = data["checks"]["decode-b8"]["tokens"]["naive"]
    assert check["same_counts"] and check["equal_ids"] == check["ids"] == 8 * 31 + 8
    assert (out / "speedup-qwen3-moe-tiny-fp32.svg").read_text().lstrip().startswith("<?xml")
    assert (out / "throughput-qwen3-moe-tiny-fp32.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_prints_ratios_and_peers(bench_run, capsys):
    code = main(["bench", "--model", "qwen3-moe-tiny", "--dtype", "fp32", "--stack", "reference", "--stack", "naive",
                 "--case", "decode-b1", "--repeats", "1", "--out", str(bench_run[1])])
    text = capsys.readouterr().out
    assert code == 0
    assert "the claim (reference/naive)" in text and "decode-b1" in text
    assert "published figures, each on its authors' own hardware" in text and "VeXact" in text
    assert "the limit: memory bandwidth" in text and "tokens/s (memory bandwidth)" in text


def test_bench_on_a_cut_model_names_its_depth(tmp_path, capsys):
    assert main(["bench", "--model", "qwen3-moe-tiny", "--layers", "1", "--stack", "reference", "--stack", "naive",
                 "--case", "decode-b1", "--repeats", "1", "--out", str(tmp_path)]) == 0
    assert "qwen3-moe-tiny (--layers 1)" in capsys.readouterr().out
    data = json.loads((tmp_path / "bench-qwen3-moe-tiny-1l-bf16.json").read_text())
    assert data["workload"]["layers"] == 1


def test_bench_profile_writes_each_stacks_ops(tmp_path):
    code = main(["bench", "--model", "qwen3-moe-tiny", "--dtype", "fp32", "--stack", "reference", "--stack", "baseline",
                 "--case", "decode-b1", "--repeats", "1", "--profile", "--threads", "1", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "bench-qwen3-moe-tiny-fp32.json").read_text())
    gemm_op = {"reference": "logdiff::", "baseline": "aten::mm"}  # logdiff::mm, or grouped_mm for the experts
    for stack in ("reference", "baseline"):
        text = (tmp_path / f"profile-decode-b1-{stack}.txt").read_text()
        assert f"stack {stack}" in text and gemm_op[stack] in text and "Input Shapes" in text
        assert data["profiles"]["decode-b1"][stack].endswith(f"profile-decode-b1-{stack}.txt")
    # the reference's decode GEMMs run on their rows (one token, or its top-2 expert rows): nothing is padded to 16.
    # Whether they rank among the 30 slowest ops is the CPU's matter (after the few-row streaming, not always).
    padded = r"logdiff::\w+ .*\[\[16, 64\]"
    assert not re.search(padded, (tmp_path / "profile-decode-b1-reference.txt").read_text())


@pytest.mark.parametrize("args,message", [
    (["--repeats", "0"], "--repeats 0 is not positive"),
    (["--case", "decode-b3"], "unknown case 'decode-b3'"),
    (["--stack", "no-such-stack"], "unknown stack 'no-such-stack'"),
    (["--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["--threads", "0"], "--threads 0 is not positive"),
    (["--layers", "9"], "--layers 9 is outside 1..4"),
])
def test_bench_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_paired_ratio_takes_per_repeat_ratios():
    s = paired_ratio([10.0, 20.0, 30.0], [5.0, 20.0, 10.0])  # ratios 2, 1, 3
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert spread([4.0])["q1"] == spread([4.0])["q3"] == 4.0
    assert claim_reading(1.1, 1.2, 1.6) == "below the claimed range"
    assert claim_reading(1.4, 1.2, 1.6) == "within the claimed range"


def test_token_agreement_catches_less_work_and_other_ids():
    ref = [[1, 2, 3], [4, 5, 6]]
    assert token_agreement(ref, [[1, 2, 3], [4, 5]])["same_counts"] is False
    other = token_agreement(ref, [[1, 2, 3], [4, 9, 6]])
    assert other["same_counts"] and other["equal_ids"] == 5 and other["first_difference"] == {"request": 1, "index": 1}


class UnevenPrefill:
    """A stack whose 1-token rollouts (prefills) take the given times in turn around a 0.03 s rollout."""

    def __init__(self, *prefills):
        self.prefills = iter(prefills)
        self.calls = 0

    def rollout(self, requests):
        steps = requests[0].max_new_tokens
        self.calls += steps == 1
        time.sleep(next(self.prefills) if steps == 1 else 0.03)
        return [RolloutOutput([0] * r.max_new_tokens, torch.zeros(r.max_new_tokens)) for r in requests]


def test_a_decode_inside_the_prefills_noise_is_not_reported_as_a_figure():
    """Prefills of 0.2 s and 0.01 s, again and again: the 0.02 s left for the decode stays inside their noise."""
    case = CASES["decode-b1"]
    stack = UnevenPrefill(0.2, 0.01, 0.2, 0.2, 0.2)
    with pytest.raises(Unsupported, match=r"decode time not resolved: the prefill took (\S+, ){4}\S+ s, its two fastest"):
        measure(stack, case, case.workload("qwen3-moe-tiny", "fp32"))
    assert stack.calls == 5


def test_one_stalled_prefill_costs_a_retry_not_the_figure():
    case = CASES["decode-b1"]
    stack = UnevenPrefill(0.2, 0.01, 0.01)
    assert measure(stack, case, case.workload("qwen3-moe-tiny", "fp32")).seconds > 0
    assert stack.calls == 3


def test_bench_times_sharded_stacks(tmp_path, capsys):
    """`--tp 2`: both stacks run on two torch.distributed ranks; the trainer case needs autograd, which the
    sharded trainer does not offer, so it is skipped with the reason, never timed as something else."""
    args = ["bench", "--tp", "2", "--model", "qwen3-dense-tiny", "--dtype", "fp32", "--stack", "reference",
            "--stack", "baseline", "--case", "prefill", "--case", "trainer", "--repeats", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    env = json.loads((tmp_path / "bench-qwen3-dense-tiny-fp32-trainertp2-rollouttp2.json").read_text())
    assert env["workload"]["parallel"] == {"trainer_tp": 2, "rollout_tp": 2, "ep": 1}
    for stack in env["stacks"]:
        assert stack["cases"]["prefill"]["tokens_per_s"][0] > 0 and "trainer" in stack["skipped"]
    assert "sharded trainer_tp 2 rollout_tp 2 ep 1" in capsys.readouterr().out
