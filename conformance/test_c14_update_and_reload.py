"""C14: update and reload. What an RL loop does between rollouts keeps logdiff = 0: after an optimizer step taken
by the trainer (`trainer_parameters`) and synced into the rollout engine through the stack's own weight-update path
(`sync_weights`, in place, as verl's FSDP -> vLLM `load_weights`), rollout = trainer is still bit for bit; a
checkpoint of the updated weights, saved and loaded into a new instance, gives that instance the same bits; and a
step at learning rate 0 changes no log-prob bit (drift at lr 0 is a bug: open-instruct#1473, slime#1695). Each test
works on its own instance of the stack (its weights change)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from logdiff.api import TrainerInputs
from logdiff.metrics import compare
from logdiff.runner import engine_options
from logdiff.train import MasterWeightAdamW

from .bitwise import PropertyViolation
from .runs import rollout
from .workloads import WORKLOADS, scored_sequences, with_dtype

pytestmark = pytest.mark.check_only

CASES = {
    "block-edges-sampled": WORKLOADS["block-edges-sampled"],
    "dense": WORKLOADS["dense"],
    "block-edges-sampled-bf16": with_dtype(WORKLOADS["block-edges-sampled"], "bf16"),
}
LEARNING_RATE = 1e-3


def optimizer_step(stack, workload, learning_rate: float) -> None:
    """One AdamW step (fp32 master weights, rounded into the model's dtype) that raises the log-probs of the
    workload's scored tokens, then the stack's weight sync into its engine."""
    params = stack.trainer_parameters()
    sequences, score_from, temperatures = scored_sequences(workload)
    for p in params.values():
        p.requires_grad_(True)
    try:
        loss = -torch.cat(stack.trainer_logprobs(sequences, score_from, temperatures, grad=True)).float().sum()
        loss.backward()
        MasterWeightAdamW(params, learning_rate, max_grad_norm=1.0).step()
    finally:
        for p in params.values():
            p.requires_grad_(False)
            p.grad = None
    stack.sync_weights()


def trainer_logprobs(stack, workload):
    return stack.trainer_logprobs(*scored_sequences(workload))


def rollout_and_trainer(stack, workload) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    requests = workload.requests()
    outputs = rollout(stack, requests, engine_options(workload))
    return [o.logprobs for o in outputs], TrainerInputs.after(requests, outputs).score(stack)


@pytest.mark.parametrize("workload", list(CASES))
def test_c14_rollout_matches_trainer_after_an_update(own_for, bitwise, workload):
    w = CASES[workload]
    stack = own_for(w)
    before = compare(*rollout_and_trainer(stack, w))
    scored_before = trainer_logprobs(stack, w)
    optimizer_step(stack, w, LEARNING_RATE)
    if all(torch.equal(a, b) for a, b in zip(scored_before, trainer_logprobs(stack, w))):
        raise PropertyViolation(f"an optimizer step at lr {LEARNING_RATE:g} changed no trainer log-prob: the step "
                                "did not reach the weights the trainer scores with")
    try:
        bitwise.logprobs(*rollout_and_trainer(stack, w), ("rollout after the update and its sync", "trainer after it"))
    except PropertyViolation as e:
        # Before the update too (C3's gap), or only after it (the sync): the two figures side by side tell which.
        raise PropertyViolation(f"{e}\nbefore any update: {before.bitwise_equal_tokens}/{before.tokens} log-probs bitwise "
                                f"equal, max |diff| {before.max_abs_logdiff:.3g}") from None


@pytest.mark.parametrize("workload", list(CASES))
def test_c14_a_reloaded_checkpoint_gives_the_same_bits(own_for, bitwise, workload, tmp_path):
    w = CASES[workload]
    updated = own_for(w)
    optimizer_step(updated, w, LEARNING_RATE)
    path = tmp_path / "model.safetensors"
    save_file({name: p.detach().clone().contiguous() for name, p in updated.trainer_parameters().items()}, str(path))
    reloaded = own_for(w)
    saved = load_file(str(path))
    with torch.no_grad():
        for name, p in reloaded.trainer_parameters().items():
            p.copy_(saved[name])
    reloaded.sync_weights()
    requests = w.requests()
    expected = rollout(updated, requests, engine_options(w))
    bitwise.rollouts(expected, rollout(reloaded, requests, engine_options(w)), ("updated", "reloaded from its checkpoint"))
    scored = TrainerInputs.after(requests, expected)
    bitwise.logprobs(scored.score(updated), scored.score(reloaded), ("updated trainer", "reloaded trainer"))


@pytest.mark.parametrize("workload", list(CASES))
def test_c14_a_step_at_learning_rate_0_changes_no_bit(own_for, bitwise, workload):
    w = CASES[workload]
    stack = own_for(w)
    requests = w.requests()
    rollout_before, trainer_before = rollout(stack, requests, engine_options(w)), trainer_logprobs(stack, w)
    optimizer_step(stack, w, 0.0)
    bitwise.rollouts(rollout_before, rollout(stack, requests, engine_options(w)), ("rollout before", "after a step at lr 0"))
    bitwise.logprobs(trainer_before, trainer_logprobs(stack, w), ("trainer before", "after a step at lr 0"))
