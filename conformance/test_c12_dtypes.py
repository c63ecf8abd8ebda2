"""C12: dtype coverage. Rollout = trainer holds in fp32, bf16 and fp16 alike, for the MoE model (prompts
around the KV block, sampling, staggered joins) and the dense one; log-probs come back as fp32 whatever
the model dtype."""

import pytest

from .runs import assert_rollout_matches_trainer
from .workloads import WORKLOADS, with_dtype

MODELS = {"moe": WORKLOADS["block-edges-sampled"], "dense": WORKLOADS["dense"]}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("model", list(MODELS))
def test_c12_dtype_coverage(stack_for, trainer_for, bitwise, model, dtype):
    w = with_dtype(MODELS[model], dtype)
    assert_rollout_matches_trainer(stack_for(w), trainer_for(w), w, bitwise)
