import pytest

from logdiff.runner import run_stack
from logdiff.stacks import StackCache
from logdiff.workload import Workload


@pytest.fixture(scope="session")
def stack_cache():
    """stack_cache(name, workload, max_model_len=None): built once per stack, model, dtype and context."""
    cache = StackCache()

    def get(name, workload: Workload, max_model_len=None):
        return cache.get(name, workload.spec, workload.torch_dtype, max_model_len or workload.max_model_len)

    return get


@pytest.fixture(scope="session")
def run(stack_cache):
    def go(name, **fields):
        workload = Workload(**fields)
        workload.validate()
        return run_stack(stack_cache(name, workload), workload)

    return go
