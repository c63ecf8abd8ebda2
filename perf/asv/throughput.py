"""asv benchmarks: the tokens/s of `logdiff bench`'s cases, tracked per commit (`nox -s asv`).

Each benchmark builds its stack, warms it up once and reports the median tokens/s of three timed runs,
measured with logdiff's own timer (decode excludes the prefill, see logdiff.bench_cases). Rollout
cases check the generated token count against the case's.
"""

import statistics

import torch

from logdiff import stacks
from logdiff.bench.cases import CASES, measure
from logdiff.bench.kernel_cases import KERNEL_CASES, measure_kernel
from logdiff.stacks import BENCH_STACKS, KERNEL_STACKS

STACKS = list(BENCH_STACKS)
MODELS = ["qwen3-moe-small:bf16", "qwen3-moe-small:fp32", "qwen3-moe-tiny:fp32"]
TIMED_RUNS = 3


class Throughput:
    params = (MODELS, list(CASES), STACKS)
    param_names = ["model", "case", "stack"]
    unit = "tokens/s"
    timeout = 1800

    def setup(self, model, case, stack):
        name, dtype = model.split(":")
        self.case = CASES[case]
        self.workload = self.case.workload(name, dtype)
        self.stack = stacks.build(stack, self.workload.spec, self.workload.torch_dtype, self.workload.max_model_len)
        measure(self.stack, self.case, self.workload)  # warm-up

    def track_tokens_per_s(self, model, case, stack):
        runs = [measure(self.stack, self.case, self.workload) for _ in range(TIMED_RUNS)]
        for m in runs:
            if m.token_ids is not None and sum(map(len, m.token_ids)) != self.case.batch * max(self.case.new_tokens, 1):
                raise AssertionError(f"{stack} generated {sum(map(len, m.token_ids))} tokens, not the case's")
        return statistics.median(m.tokens_per_s for m in runs)


class Kernels:
    """One qwen3-30b-a3b layer's attention and MoE, bf16 (see logdiff.bench_kernels for the sizes)."""

    params = (list(KERNEL_CASES), list(KERNEL_STACKS))
    param_names = ["case", "kernels"]
    unit = "tokens/s"
    timeout = 1800

    def setup(self, case, kernels):
        self.case = KERNEL_CASES[case]
        self.inputs = self.case.inputs(torch.bfloat16)
        measure_kernel(self.case, kernels, self.inputs)  # warm-up

    def track_tokens_per_s(self, case, kernels):
        seconds = [measure_kernel(self.case, kernels, self.inputs)[0] for _ in range(TIMED_RUNS)]
        return self.case.tokens / statistics.median(seconds)
