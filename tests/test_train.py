"""`logdiff train`: the reference stack stays exactly on-policy through GRPO updates (which needs the
weight sync), the baseline is off-policy from step 1, the RL pieces do what GRPO says, and the command
writes its JSON and PNG atomically and turns bad input into one line."""

import json

import pytest
import torch

from logdiff.api import EngineOptions, Stack, TrainerInputs, Unsupported
from logdiff.cli.main import main
from logdiff.metrics import compare
from logdiff.train import (
    LOGGED_METRICS,
    TrainConfig,
    build_stack,
    clipped_policy_loss,
    exactly_on_policy,
    group_advantages,
    target_token_reward,
    train_stack,
)

SHORT = TrainConfig(steps=3, prompts=2, group_size=2, prompt_lens=(5, 20), max_new_tokens=6)


def short(**fields) -> TrainConfig:
    return TrainConfig(**{**SHORT.__dict__, **fields})


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_reference_is_exactly_on_policy_at_every_step(dtype):
    config = short(dtype=dtype)
    run = train_stack(build_stack("reference", config), config)
    assert len(run.steps) == config.steps
    for record in run.steps:
        assert record["bitwise_equal_share"] == 1.0, f"step {record['step']}"
        assert record["is_ratio_min"] == record["is_ratio_max"] == 1.0
        assert record["max_abs_logdiff"] == 0.0 and record["routing_flip_share"] == 0.0
        assert all(record[name] == 0.0 for name in LOGGED_METRICS), record
    assert exactly_on_policy(run.steps)


def test_training_moves_the_weights_and_the_engine_follows():
    # Steps after the first are bitwise only because sync_weights loads each update into the engine;
    # this checks the update is real and that without the sync the engine would lag behind.
    config = short(steps=2)
    stack = build_stack("reference", config)
    before = {name: p.clone() for name, p in stack.trainer_parameters().items()}
    train_stack(stack, config)
    after = stack.trainer_parameters()
    assert any(not torch.equal(before[name], after[name]) for name in before)

    requests = config.requests(step=7)

    def mismatch():
        rollout = stack.rollout(requests)
        inputs = TrainerInputs.after(requests, rollout)
        trainer = stack.trainer_logprobs(inputs.sequences, inputs.score_from, inputs.temperatures)
        return compare([o.logprobs for o in rollout], trainer).verdict

    assert mismatch() == "pass"
    with torch.no_grad():
        stack.trainer_parameters()["lm_head.weight"].mul_(1.5)  # a trainer update the engine has not seen
    assert mismatch() == "fail"
    stack.sync_weights()
    assert mismatch() == "pass"


def test_baseline_is_off_policy_from_step_one():
    config = short(steps=2)
    run = train_stack(build_stack("baseline", config), config)
    first = run.steps[0]
    assert first["bitwise_equal_share"] < 1.0
    assert first["train_rollout_logprob_abs_diff"] > 0 and first["rollout_corr/k3_kl"] > 0
    assert first["is_ratio_min"] < 1.0 < first["is_ratio_max"]
    assert not exactly_on_policy(run.steps)


class NoWeightSync(Stack):
    """A third-party stack that exposes its trainer but cannot update its engine's weights."""

    def __init__(self, inner: Stack):
        self.inner, self.name = inner, "no-weight-sync"

    def rollout(self, requests, options=EngineOptions()):
        return self.inner.rollout(requests, options)

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False):
        return self.inner.trainer_logprobs(sequences, score_from, temperatures, grad=grad)

    def trainer_parameters(self):
        return self.inner.trainer_parameters()


def test_a_stack_without_weight_sync_is_declined_before_any_step():
    config = short(steps=1)
    with pytest.raises(Unsupported, match="sync_weights"):
        train_stack(NoWeightSync(build_stack("reference", config)), config)


# --------------------------------------------------------------------------- the RL pieces


def test_reward_counts_target_tokens():
    assert target_token_reward([0, 127, 128, 1023], vocab_size=1024) == 0.5


def test_group_advantages_are_normalised_within_each_group():
    adv = group_advantages(torch.tensor([0.0, 1.0, 0.5, 0.5]), group_size=2)
    assert adv[0] < 0 < adv[1] and abs(float(adv[0] + adv[1])) < 1e-6
    assert torch.equal(adv[2:], torch.zeros(2))  # a group that agrees teaches nothing


def test_clipped_loss_is_the_plain_policy_gradient_when_on_policy():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 2.0])
    loss, clipped = clipped_policy_loss(logp, logp.detach(), advantages, clip=0.2)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-float(advantages.mean())) and float(clipped) == 0.0
    assert torch.allclose(logp.grad, -advantages / 3)
    # Off-policy: a ratio above 1 + eps with a positive advantage is clipped, and passes no gradient.
    logp.grad = None
    loss, clipped = clipped_policy_loss(logp, logp.detach() - torch.tensor([0.5, 0.0, 0.0]), advantages, clip=0.2)
    loss.backward()
    assert float(clipped) == pytest.approx(1 / 3) and float(logp.grad[0]) == 0.0


# --------------------------------------------------------------------------- the command

QUICK = ["--steps", "2", "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--prompt-lens", "5,20"]


def test_command_writes_json_and_png(tmp_path, capsys):
    # exit 1: baseline is not exactly on-policy
    assert main(["train", *QUICK, "--stack", "reference", "--stack", "baseline", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "exact" in out and "wrote" in out
    env = json.loads((tmp_path / "train-qwen3-moe-tiny-bf16.json").read_text())
    assert env["command"] == "train" and env["workload"]["steps"] == 2 and env["workload"]["dtype"] == "bf16"
    ref, base = env["stacks"]
    assert ref["name"] == "reference" and len(ref["steps"]) == 2
    assert ref["summary"]["steps_bitwise_equal"] == 2 and base["summary"]["steps_bitwise_equal"] == 0
    for name in (*LOGGED_METRICS, "is_ratio_min", "is_ratio_max", "reward", "bitwise_equal_share"):
        assert name in ref["steps"][0] and name in base["steps"][0]
    assert (tmp_path / "train-qwen3-moe-tiny-bf16.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"


@pytest.mark.parametrize("bad, message", [
    (["--steps", "0"], "--steps 0 is not positive"),
    (["--group-size", "1"], "--group-size 1 is too small"),
    (["--prompts", "-1"], "--prompts -1 is not positive"),
    (["--dtype", "fp8"], "unknown dtype"),
    (["--lr", "0"], "--lr 0.0 is not positive"),
    (["--clip", "1.5"], "--clip 1.5 is outside"),
    (["--prompt-lens", "0,4"], "must all be >= 1"),
    (["--prompt-lens", "x"], "not a comma-separated list"),
    (["--max-new-tokens", "9000"], "exceeds the 8192 positions"),
    (["--stack", "nope"], "unknown stack 'nope'"),
    (["--threads", "0"], "--threads 0 is not positive"),
    (["--model", "/nonexistent"], "unknown model"),
    (["--layers", "3"], "--layers 3 is outside 1..2"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, bad, message):
    assert main(["train", *QUICK, "--out", str(tmp_path / "out"), *bad]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not list(tmp_path.rglob("*.json")) and not list(tmp_path.rglob("*.png"))


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    taken = tmp_path / "file"
    taken.write_text("")
    assert main(["train", *QUICK, "--out", str(taken)]) == 2
    assert "is not a directory" in capsys.readouterr().err
