"""Trainer x rollout chosen independently (`--rollout R --trainer T`, the stack `R+T`), and C13 (trainer layout
invariance) with its negative controls."""

import json

import pytest
import torch

from logdiff import stacks
from logdiff.api import Request, RolloutOnly, TrainerLayout, TrainerOnly
from logdiff.cli.main import main
from logdiff.conformance import test_c13_trainer_layout as c13
from logdiff.conformance.bitwise import Bitwise, PropertyViolation
from logdiff.conformance.plugin import MAX_MODEL_LEN
from logdiff.errors import UserError
from logdiff.stacks import PairedStack, StackCache
from logdiff.weights import ModelSpec

SPEC = ModelSpec("qwen3-moe-tiny")
RUN = ["--batch-size", "2", "--prompt-lens", "5,130", "--max-new-tokens", "4"]


def test_a_pair_runs_one_stacks_engine_against_anothers_trainer():
    pair = stacks.build("baseline+reference", SPEC, torch.float32, 256)
    assert isinstance(pair, PairedStack) and pair.name == "baseline+reference"
    assert (pair.rollout_side.name, pair.trainer_side.name) == ("baseline", "reference")
    assert pair.supports_capture and pair.trainer_layouts == pair.trainer_side.trainer_layouts
    requests = [Request(tuple(range(1, 9)), 3)]
    out = pair.rollout(requests)
    assert torch.equal(out[0].logprobs, pair.rollout_side.rollout(requests)[0].logprobs)
    scored = pair.trainer_logprobs([list(requests[0].prompt) + out[0].tokens], [8], [0.0])
    assert torch.equal(scored[0], pair.trainer_side.trainer_logprobs([list(requests[0].prompt) + out[0].tokens], [8], [0.0])[0])
    described = pair.describe()
    assert described["rollout"]["name"] == "baseline" and described["trainer"]["name"] == "reference"


def test_a_named_pair_takes_another_trainer_by_plus():
    """`vllm` is vLLM's engine with the reference trainer; `vllm+hf` keeps the engine and takes hf's trainer."""
    pair = stacks.resolve("vllm+hf")(SPEC, torch.float32, 256)
    assert pair.name == "vllm+hf" and pair.rollout_side.name == "vllm" and pair.trainer_side.name == "hf"
    assert pair.rollout_side.child is None  # nothing started


class Echo(RolloutOnly):
    name = "echo"

    def rollout(self, requests, options=None):
        raise AssertionError("not called")


class Scorer(TrainerOnly):
    name = "scorer"

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False):
        return [torch.zeros(len(s) - f) for s, f in zip(sequences, score_from)]


def echo(spec, dtype, max_model_len):
    """a rollout engine registered alone"""
    return Echo()


def scorer(spec, dtype, max_model_len):
    """a trainer registered alone"""
    return Scorer()


echo.side, scorer.side = "rollout", "trainer"


@pytest.mark.parametrize("name, side", [("test_pairs:scorer", "trainer"), ("test_pairs:echo", "rollout")])
def test_a_side_registered_alone_runs_only_in_a_pair(name, side):
    with pytest.raises(UserError, match=f"is a {side} only: pair it with a"):
        stacks.require(name)
    assert stacks.resolve(f"reference+{name}" if side == "trainer" else f"{name}+reference")


def test_run_with_rollout_and_trainer_reports_the_pair(tmp_path, capsys):
    path = tmp_path / "run.json"
    code = main(["run", "--rollout", "reference", "--trainer", "hf", *RUN, "--json", str(path)])
    entry = json.loads(path.read_text())["stacks"][-1]
    assert entry["name"] == "reference+hf"
    assert code == (0 if entry["bitwise_equal_tokens"] == entry["tokens"] else 1)
    assert entry["describe"]["trainer"]["attn_implementation"] == "sdpa" and "kernels" in entry["describe"]["rollout"]
    assert "reference+hf: rollout = reference: ran GEMM" in capsys.readouterr().out


def test_a_missing_side_defaults_to_the_reference(tmp_path):
    path = tmp_path / "run.json"
    assert main(["run", "--stack", "reference", "--trainer", "reference", *RUN, "--json", str(path)]) == 0
    assert [s["name"] for s in json.loads(path.read_text())["stacks"]] == ["reference", "reference+reference"]


@pytest.mark.parametrize("argv, message", [
    (["check", "--stack", "reference", "--trainer", "hf"], "pass either --stack reference or --rollout/--trainer"),
    (["check"], "no stack to check: pass --stack NAME, or --rollout R --trainer T"),
    (["run", "--stack", "test_pairs:scorer", *RUN], "is a trainer only: pair it with a rollout, --trainer test_pairs:scorer"),
    (["run", "--rollout", "nosuch", *RUN], "unknown stack 'nosuch'"),
])
def test_pair_mistakes_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_layouts_split_forwards_by_micro_batch_and_token_budget():
    lengths = [5, 300, 7, 129, 1]
    assert TrainerLayout().forwards(lengths) == [[0, 1, 2, 3, 4]]
    assert TrainerLayout(micro_batch=2).forwards(lengths) == [[0, 1], [2, 3], [4]]
    assert TrainerLayout(token_budget=300).forwards(lengths) == [[0], [1], [2, 3, 4]]
    assert TrainerLayout(micro_batch=2, token_budget=310).forwards(lengths) == [[0, 1], [2, 3], [4]]
    assert TrainerLayout(micro_batch=2, padding="left", extra_padding=5).describe() == "micro-batch 2, left padding +5"


def c13_fixtures(name):
    cache = StackCache()
    return {"trainer_for": lambda w: cache.get(name, w.spec, w.torch_dtype, MAX_MODEL_LEN), "bitwise": Bitwise()}


def test_c13_holds_for_the_reference_trainer():
    c13.test_c13_trainer_layout_invariance(**c13_fixtures("reference"), workload="block-edges")


@pytest.mark.parametrize("stack, layouts", [
    ("baseline", ["micro-batch all, packed vs micro-batch 1, packed"]),  # MKL rounds by M
    ("hf", ["micro-batch all, right padding +0 vs micro-batch 1, right padding +0",
            "micro-batch all, right padding +0 vs micro-batch all, left padding +0"]),
])
def test_c13_names_the_layouts_that_change_a_trainers_bits(stack, layouts):
    with pytest.raises(PropertyViolation) as failed:
        c13.test_c13_trainer_layout_invariance(**c13_fixtures(stack), workload="block-edges")
    assert all(pair in str(failed.value) for pair in layouts) and "logprobs differ at seq" in str(failed.value)


def test_c13_skips_a_trainer_without_knobs():
    with pytest.raises(pytest.skip.Exception, match="stack scorer's trainer exposes no layout knob"):
        c13.test_c13_trainer_layout_invariance(trainer_for=lambda w: Scorer(), bitwise=Bitwise(), workload="block-edges")
