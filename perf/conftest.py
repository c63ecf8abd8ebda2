"""Stacks for the pytest-benchmark files, built once per (stack, model, dtype, context)."""

import pytest

from logdiff.stacks import StackCache

# One model at a time per stack name: qwen3-moe-small in fp32 is ~0.7 GB with its engine copy.
BUILT = StackCache(keep_one_model=True)


@pytest.fixture
def build_stack():
    def build(name, workload):
        return BUILT.get(name, workload.spec, workload.torch_dtype, workload.max_model_len)

    return build
