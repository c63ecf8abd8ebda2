import pytest

from logdiff import stacks
from logdiff.runner import run_stack
from logdiff.workload import Workload


@pytest.fixture(scope="session")
def stack_cache():
    """Stacks are built once per (name, model, dtype, max_model_len): building copies the weights."""
    cache = {}

    def get(name, workload: Workload, max_model_len=None):
        key = (name, workload.model, workload.dtype, workload.seed, max_model_len or workload.max_model_len)
        if key not in cache:
            cache[key] = stacks.build(name, workload.spec, workload.torch_dtype, key[-1])
        return cache[key]

    return get


@pytest.fixture(scope="session")
def run(stack_cache):
    def go(name, **fields):
        workload = Workload(**fields)
        workload.validate()
        return run_stack(stack_cache(name, workload), workload)

    return go
