"""C7: continuous batching. A request's tokens and log-probs do not depend on who else is running when
it joins, nor on requests leaving the batch while it decodes, nor on joining in a prefill step of 9,100
prompt tokens (past the 8,192 at which engines cap a step or change kernels): each equals the request run
alone."""

import dataclasses

import pytest

from logdiff.runner import engine_options
from logdiff.workload import Workload

from .generated import for_each_workload, workloads
from .runs import rollout
from .workloads import WORKLOADS, all_at_once

PROMPTS = Workload(prompt_lens=(17, 129, 64, 300), batch_size=4, max_new_tokens=8).requests()
JOINS = ((0, 8), (0, 8), (2, 8), (5, 8))  # (arrival step, new tokens) per request
SCHEDULES = {  # name: (schedule, temperature)
    "joins": (JOINS, 0.0),
    "joins-and-leaves": (((0, 10), (1, 4), (3, 7), (4, 3)), 0.0),
    "joins-sampled": (JOINS, 1.0),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_c7_continuous_batching(stack_for, bitwise, schedule):
    stack = stack_for(Workload())
    steps, temperature = SCHEDULES[schedule]
    requests = [
        dataclasses.replace(r, arrival=arrival, max_new_tokens=new, temperature=temperature)
        for r, (arrival, new) in zip(PROMPTS, steps)
    ]
    scheduled = rollout(stack, requests)
    alone = [rollout(stack, [dataclasses.replace(r, arrival=0)])[0] for r in requests]
    bitwise.rollouts(scheduled, alone, (f"schedule {schedule}", "alone"))


def test_c7_a_9k_token_prefill_step_joins_running_decodes(stack_for, bitwise):
    big_step = WORKLOADS["prefill-9k"]
    stack = stack_for(big_step)
    running = [dataclasses.replace(r, arrival=0) for r in PROMPTS[:2]]
    joining = [dataclasses.replace(r, arrival=2) for r in big_step.requests()]
    scheduled = rollout(stack, running + joining)
    alone = [rollout(stack, [dataclasses.replace(r, arrival=0)])[0] for r in running + joining]
    bitwise.rollouts(scheduled, alone, ("20 prompts of 9,100 tokens joining 2 decodes at step 2", "alone"))


def test_c7_continuous_batching_generated(stack_for, bitwise, pytestconfig):
    def check(w):
        stack, requests = stack_for(w), w.requests()
        scheduled = rollout(stack, requests, engine_options(w))
        at_once = rollout(stack, all_at_once(requests), engine_options(w))
        bitwise.rollouts(scheduled, at_once, (f"joining every {w.stagger} steps", "all at once"))

    for_each_workload(pytestconfig, check, workloads().filter(lambda w: w.stagger > 0 and w.batch_size > 1))
