"""C3: rollout = trainer, the headline logdiff = 0. Each token's log-prob as the rollout engine computed
it when sampling equals the trainer's teacher-forced recomputation, bit for bit. The workloads include
the regimes where engines switch kernels (contexts past 2048, the seed's 2048 + 2048 tokens, 256 requests
decoding, 9,100-token prefill steps; generated ones drawn across 1..4,300 positions and 1..256 requests)
and the one on which each ablation of the reference kernels must fail."""

import pytest

from .generated import for_each_workload, regime_workloads
from .runs import assert_rollout_matches_trainer
from .workloads import ABLATION_WORKLOADS, WORKLOADS

CASES = {name: WORKLOADS[name] for name in (
    "joins-mid-decode", "sampled", "long-decode", "dense", "prefill-9k", "long-context", "batch-256", "seed-lengths",
)} | ABLATION_WORKLOADS


@pytest.mark.parametrize("workload", list(CASES))
def test_c3_rollout_matches_trainer(stack_for, trainer_for, bitwise, workload):
    w = CASES[workload]
    assert_rollout_matches_trainer(stack_for(w), trainer_for(w), w, bitwise)


def test_c3_rollout_matches_trainer_generated(stack_for, trainer_for, bitwise, pytestconfig):
    for_each_workload(pytestconfig, lambda w: assert_rollout_matches_trainer(stack_for(w), trainer_for(w), w, bitwise))


def test_c3_rollout_matches_trainer_generated_regimes(stack_for, trainer_for, bitwise, pytestconfig):
    for_each_workload(pytestconfig, lambda w: assert_rollout_matches_trainer(stack_for(w), trainer_for(w), w, bitwise),
                      regime_workloads())
