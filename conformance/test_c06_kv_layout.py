"""C6: KV layout invariance. The page size of the paged KV cache and the order of the pages in the
block tables change where keys live, never the tokens or log-probs."""

import pytest

from logdiff.api import EngineOptions
from logdiff.workload import Workload

from .generated import for_each_workload
from .runs import rollout

WORKLOAD = Workload(prompt_lens=(1, 127, 129, 300), batch_size=4, max_new_tokens=6, stagger=1)
LAYOUTS = {
    "page-1": EngineOptions(page_size=1),
    "page-16": EngineOptions(page_size=16),
    "page-256": EngineOptions(page_size=256),
    "page-16-shuffled": EngineOptions(page_size=16, shuffle_pages=1),
    "page-128-shuffled": EngineOptions(shuffle_pages=2),
}


@pytest.fixture(scope="module")
def default_layout(stack_builder):
    return rollout(stack_builder(WORKLOAD), WORKLOAD.requests())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_c6_kv_layout_invariance(stack_for, bitwise, default_layout, layout):
    other = rollout(stack_for(WORKLOAD), WORKLOAD.requests(), LAYOUTS[layout])
    bitwise.rollouts(default_layout, other, ("default KV layout", layout))


def test_c6_kv_layout_invariance_generated(stack_for, bitwise, pytestconfig):
    def check(w):
        stack, requests = stack_for(w), w.requests()
        # The shuffled layout first: a stack that declines it declines before running the default one.
        shuffled = rollout(stack, requests, EngineOptions(page_size=w.block_size, prefill_chunk=w.prefill_chunk,
                                                          shuffle_pages=w.seed + 1))
        default = rollout(stack, requests, EngineOptions(prefill_chunk=w.prefill_chunk))
        bitwise.rollouts(default, shuffled, ("default KV layout", f"page {w.block_size}, shuffled block tables"))

    for_each_workload(pytestconfig, check)
