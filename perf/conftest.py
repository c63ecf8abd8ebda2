"""Stacks for the pytest-benchmark files, built once per (stack, model, dtype, context)."""

import pytest

from logdiff import stacks

BUILT: dict[tuple, object] = {}


@pytest.fixture
def build_stack():
    def build(name, workload):
        key = (name, workload.model, workload.dtype, workload.max_model_len)
        if key not in BUILT:
            # One model at a time per stack name: qwen3-moe-small in fp32 is ~0.7 GB with its engine copy.
            for old in [k for k in BUILT if k[0] == name]:
                del BUILT[old]
            BUILT[key] = stacks.build(name, workload.spec, workload.torch_dtype, workload.max_model_len)
        return BUILT[key]

    return build
