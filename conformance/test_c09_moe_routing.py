"""C9: MoE routing ties and combine order. On a model (the named config qwen3-moe-tiny-tied) whose router
gives pairs of experts bitwise equal logits on every token (top-4 of 8 experts), the tie-break decides
which experts a token uses and in which order their outputs are summed; rollout and trainer must decide
alike, whatever the batch."""

import pytest

from logdiff.workload import Workload

from .runs import assert_rollout_matches_trainer, rollout
from .workloads import TIED_MODEL, all_at_once


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("check", ["rollout-vs-trainer", "batch-invariance"])
@pytest.mark.own_weights("a router with tied expert pairs")
def test_c9_moe_routing_ties_and_combine_order(stack_for, trainer_for, bitwise, check, dtype):
    w = Workload(model=TIED_MODEL, dtype=dtype, prompt_lens=(17, 129, 64, 200), batch_size=4, max_new_tokens=8, stagger=1)
    stack = stack_for(w)
    if check == "rollout-vs-trainer":
        assert_rollout_matches_trainer(stack, trainer_for(w), w, bitwise)
        return
    requests = all_at_once(w.requests())
    bitwise.rollouts(rollout(stack, requests), [rollout(stack, [r])[0] for r in requests], ("in the batch", "alone"))
