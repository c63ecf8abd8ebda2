"""Eager-mode throughput of whole stacks (pytest-benchmark): every case of logdiff.bench_cases on
reference, baseline, naive and hf, for qwen3-moe-small in bf16 and fp32 and qwen3-moe-tiny.

Run by `nox -s perf`; `logdiff bench` measures the same cases interleaved and prints the ratios.
Each benchmark records tokens/s in extra_info and checks it did the reference's work: the same number
of generated tokens, and (fp32, where greedy decoding of the same weights agrees across stacks) the
same token ids.
"""

import statistics

import pytest

from logdiff.bench.cases import CASES, measure, token_agreement
from logdiff.stacks import BENCH_STACKS

STACKS = BENCH_STACKS
MODELS = (("qwen3-moe-small", "bf16"), ("qwen3-moe-small", "fp32"), ("qwen3-moe-tiny", "fp32"))
REFERENCE_IDS: dict[tuple, list[list[int]]] = {}


@pytest.mark.parametrize("model,dtype", MODELS, ids=[f"{m}-{d}" for m, d in MODELS])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stack_name", STACKS)
def test_throughput(benchmark, build_stack, model, dtype, case, stack_name):
    spec = CASES[case]
    workload = spec.workload(model, dtype)
    stack = build_stack(stack_name, workload)
    runs = []

    def run():
        runs.append(measure(stack, spec, workload))

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    timed = runs[1:]
    benchmark.extra_info["tokens_per_s"] = statistics.median(m.tokens_per_s for m in timed)
    benchmark.extra_info["counted_tokens"] = spec.counted_tokens
    benchmark.extra_info["case"] = spec.describe()
    if timed[0].token_ids is None:
        return
    key = (model, dtype, case)
    REFERENCE_IDS.setdefault(key, timed[0].token_ids)  # the first stack to run, reference by parametrize order
    for m in timed:
        agreement = token_agreement(REFERENCE_IDS[key], m.token_ids)
        benchmark.extra_info["equal_ids"] = f"{agreement['equal_ids']}/{agreement['ids']}"
        assert agreement["same_counts"], f"{stack_name} generated a different number of tokens: not the same work"
        if dtype == "fp32":
            assert agreement["equal_ids"] == agreement["ids"], f"{stack_name} generated other ids in fp32: {agreement}"
