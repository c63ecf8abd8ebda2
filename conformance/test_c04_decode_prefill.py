"""C4: decode = prefill. The log-probs the rollout engine recorded token by token while decoding equal
the ones it computes when scoring the finished sequence in one prefill (vLLM's prompt_logprobs)."""

import pytest

from logdiff.runner import engine_options

from .runs import rollout_and_sequences
from .workloads import WORKLOADS, with_dtype

CASES = {
    "joins-mid-decode": WORKLOADS["joins-mid-decode"],
    "sampled": WORKLOADS["sampled"],
    "block-edges-bf16": with_dtype(WORKLOADS["block-edges"], "bf16"),
    "prefill-9k": WORKLOADS["prefill-9k"],
}


@pytest.mark.parametrize("workload", list(CASES))
def test_c4_decode_matches_prefill(stack_for, bitwise, workload):
    w = CASES[workload]
    stack = stack_for(w)
    outputs, sequences, score_from, temperatures = rollout_and_sequences(stack, w)
    prefill = stack.prompt_logprobs(sequences, score_from, temperatures, engine_options(w))
    bitwise.logprobs([o.logprobs for o in outputs], prefill, ("decode", "one prefill"))
