"""C3: rollout = trainer, the headline logdiff = 0. Each token's log-prob as the rollout engine computed
it when sampling equals the trainer's teacher-forced recomputation, bit for bit. The workloads include
the one on which each ablation of the reference kernels must fail."""

import pytest

from .runs import assert_rollout_matches_trainer
from .workloads import ABLATION_WORKLOADS, WORKLOADS

CASES = {name: WORKLOADS[name] for name in ("joins-mid-decode", "sampled", "long-decode", "dense")} | ABLATION_WORKLOADS


@pytest.mark.parametrize("workload", list(CASES))
def test_c3_rollout_matches_trainer(stack_for, bitwise, workload):
    w = CASES[workload]
    assert_rollout_matches_trainer(stack_for(w), w, bitwise)
