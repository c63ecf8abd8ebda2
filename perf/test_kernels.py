"""Kernel-level throughput at the shapes of one qwen3-30b-a3b layer (pytest-benchmark): attention for
training, prefill and paged decode, and the MoE layer, on the reference, baseline and naive kernel
sets in bf16. Each benchmark checks its output against the reference kernels' (same computation, so
no kernel set wins by skipping work)."""

import pytest
import torch

from logdiff.bench.kernel_cases import KERNEL_CASES, measure_kernel
from logdiff.stacks import KERNEL_STACKS

INPUTS: dict[str, dict] = {}
REFERENCE_OUT: dict[str, torch.Tensor] = {}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("stack_name", KERNEL_STACKS)
def test_kernel(benchmark, case, stack_name):
    spec = KERNEL_CASES[case]
    if case not in INPUTS:
        INPUTS.clear()  # one case's inputs at a time (the MoE weights are 1.2 GB)
        INPUTS[case] = spec.inputs(torch.bfloat16)
    outputs = []
    benchmark.pedantic(lambda: outputs.append(measure_kernel(spec, stack_name, INPUTS[case])), rounds=3, iterations=1,
                       warmup_rounds=1)
    seconds = [s for s, _ in outputs[1:]]
    benchmark.extra_info["tokens_per_s"] = spec.tokens / sorted(seconds)[len(seconds) // 2]
    benchmark.extra_info["case"] = spec.describe
    out = outputs[-1][1].float()
    reference = REFERENCE_OUT.setdefault(case, out)
    # bf16 outputs of differently ordered reductions: equal up to a few bf16 ulps of the output scale
    assert (out - reference).abs().max() <= 0.05 * reference.abs().max(), f"{stack_name} computed something else"
