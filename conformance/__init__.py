"""The conformance catalogue: bitwise properties any stack can be run through.

Run it with `pytest conformance --stack NAME` or `logdiff check --stack NAME`. Test functions are named
`test_c<N>_<property>`, so a test's property id is read from its name; CATALOGUE gives each id its
one-line meaning.
"""

import re

CATALOGUE = {
    "C0": "fidelity: rollout, trainer and prompt log-probs near an fp64 oracle of the same weights; sampling follows it",
    "C1": "run-to-run determinism of each path",
    "C2": "batch invariance: a sequence's log-probs do not depend on batch size, position or neighbours",
    "C3": "rollout = trainer: the headline logdiff = 0",
    "C4": "decode = prefill: scoring by incremental decode equals one prefill",
    "C5": "chunked-prefill invariance",
    "C6": "KV layout invariance: page size, permuted block tables",
    "C7": "continuous batching: requests joining and leaving mid-decode",
    "C8": "parallel invariance: TP 1/2/4 and EP 1/2 give the same bits; trainer and rollout sharded differently agree",
    "C9": "MoE routing: tie-breaks and combine order",
    "C10": "sampling: temperature applied identically, seeded sampling batch-invariant",
    "C11": "trainer is differentiable and its backward is deterministic",
    "C12": "dtype coverage: fp32, bf16, fp16",
    "C13": "trainer layout invariance: micro-batch size, padding side and amount, packed vs padded, token budget",
    "C14": "update and reload: rollout = trainer after a step and sync, a checkpoint reloads the same bits, lr 0 changes none",
    "C15": "log-prob semantics: top-k/top-p/min-p truncation, processed and raw modes, rollout = trainer per mode",
}

_TEST_NAME = re.compile(r"test_c(\d+)_")


def property_of(test_name: str) -> str | None:
    """'test_c3_rollout_matches_trainer[x]' -> 'C3'."""
    match = _TEST_NAME.match(test_name)
    return f"C{int(match.group(1))}" if match else None
