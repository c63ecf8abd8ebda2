"""C5: chunked-prefill invariance. Prefilling prompts in chunks (aligned or not with the 128-key KV
block, down to one token per forward) gives the same tokens and log-probs as prefilling each prompt at once."""

import pytest

from logdiff.api import EngineOptions
from logdiff.runner import engine_options
from logdiff.workload import Workload

from .generated import for_each_workload, workloads
from .runs import rollout
from .workloads import WORKLOADS

WORKLOAD = Workload(prompt_lens=(127, 128, 129, 300, 17), batch_size=5, max_new_tokens=6, stagger=1)


@pytest.fixture(scope="module")
def whole_prompts(stack_builder):
    return rollout(stack_builder(WORKLOAD), WORKLOAD.requests())


@pytest.mark.parametrize("chunk", [1, 7, 100, 128])
def test_c5_chunked_prefill_invariance(stack_for, bitwise, whole_prompts, chunk):
    chunked = rollout(stack_for(WORKLOAD), WORKLOAD.requests(), EngineOptions(prefill_chunk=chunk))
    bitwise.rollouts(whole_prompts, chunked, ("whole-prompt prefill", f"prefill in chunks of {chunk}"))


def test_c5_chunked_prefill_invariance_past_8192_tokens(stack_for, bitwise):
    """One prefill step of 9,100 prompt tokens against chunks of 100 per prompt (2,000 tokens a step)."""
    w = WORKLOADS["prefill-9k"]
    stack, requests = stack_for(w), w.requests()
    whole, chunked = rollout(stack, requests), rollout(stack, requests, EngineOptions(prefill_chunk=100))
    bitwise.rollouts(whole, chunked, ("one 9,100-token prefill step", "prefill in chunks of 100"))


def test_c5_chunked_prefill_invariance_generated(stack_for, bitwise, pytestconfig):
    def check(w):
        stack, requests = stack_for(w), w.requests()
        whole = rollout(stack, requests, EngineOptions(page_size=w.block_size))
        chunked = rollout(stack, requests, engine_options(w))
        bitwise.rollouts(whole, chunked, ("whole-prompt prefill", f"prefill in chunks of {w.prefill_chunk}"))

    for_each_workload(pytestconfig, check, workloads().filter(lambda w: w.prefill_chunk is not None))
