"""Negative controls of the conformance catalogue: it must catch what is broken, name exactly where, and
pass what is not. Each control calls the catalogue's own test functions (logdiff.conformance) on a
stack, with the fixtures supplied here, so what is checked is exactly what `pytest conformance` runs."""

import dataclasses
import inspect

import pytest
import torch

from logdiff.api import EngineOptions
from logdiff.conformance import test_c01_determinism as c1
from logdiff.conformance import test_c02_batch_invariance as c2
from logdiff.conformance import test_c03_rollout_trainer as c3
from logdiff.conformance import test_c04_decode_prefill as c4
from logdiff.conformance import test_c05_chunked_prefill as c5
from logdiff.conformance import test_c06_kv_layout as c6
from logdiff.conformance import test_c07_continuous_batching as c7
from logdiff.conformance import test_c09_moe_routing as c9
from logdiff.conformance import test_c11_trainer_backward as c11
from logdiff.conformance.bitwise import Bitwise, PropertyViolation
from logdiff.conformance.plugin import MAX_MODEL_LEN
from logdiff.conformance.runs import rollout
from logdiff.conformance.workloads import (
    TIED_EXPERTS,
    WORKLOADS,
    write_tied_router_checkpoint,
)
from logdiff.kernels import reference_kernels
from logdiff.kernels.ablations import ABLATIONS
from logdiff.kernels.moe import softmax
from logdiff.stacks import KernelStack, StackCache
from logdiff.weights import ModelSpec


@pytest.fixture(scope="module")
def built():
    """build(factory_or_name, instance="rollout") -> stack_for(workload), each (stack, model, dtype) built once
    per instance, as the conformance plugin builds the rollout and trainer sides apart."""
    caches = {}

    def build(stack, instance="rollout"):
        cache = caches.setdefault(instance, StackCache())

        def stack_for(workload):
            return cache.get(stack, workload.spec, workload.torch_dtype, MAX_MODEL_LEN)

        return stack_for

    return build


def call(test, built, stack, **params):
    """Runs one catalogue test on `stack` with the fixtures it asks for."""
    fixtures = {"stack_for": built(stack), "trainer_for": built(stack, "trainer"), "fresh_for": built(stack, "fresh"),
                "bitwise": Bitwise()}
    wanted = inspect.signature(test).parameters
    return test(**{k: v for k, v in fixtures.items() if k in wanted}, **params)


def violation(test, built, stack, **params) -> str:
    """Runs one catalogue test, which must fail: its message."""
    with pytest.raises(PropertyViolation) as failed:
        call(test, built, stack, **params)
    return str(failed.value)


# --------------------------------------------------------------------------- ablations and baseline


@pytest.mark.parametrize("ablation", sorted(ABLATIONS))
def test_c3_detects_each_ablation_on_the_workload_it_breaks(built, ablation):
    workload = f"breaks-{ablation.removeprefix('reference-')}"
    message = violation(c3.test_c3_rollout_matches_trainer, built, ablation, workload=workload)
    assert "rollout vs trainer" in message and "logprobs differ at seq" in message
    call(c3.test_c3_rollout_matches_trainer, built, "reference", workload=workload)


BASELINE_BREAKS = [  # (catalogue test, parameters): what baseline's unaligned kernels break by construction
    (c2.test_c2_batch_invariance, dict(path="rollout", workload="block-edges")),  # split-KV count and GEMV follow the batch
    (c3.test_c3_rollout_matches_trainer, dict(workload="joins-mid-decode")),  # padded fused SDPA vs paged decode
    (c4.test_c4_decode_matches_prefill, dict(workload="joins-mid-decode")),  # SDPA prefill vs split-KV decode
    (c7.test_c7_continuous_batching, dict(schedule="joins")),  # the decode batch changes as requests join
]


@pytest.mark.parametrize("test, params", BASELINE_BREAKS, ids=lambda x: x.__name__ if callable(x) else "")
def test_baseline_is_detected(built, test, params):
    assert "differ at seq" in violation(test, built, "baseline", **params)


def test_baseline_passes_what_it_does_not_break(built):
    """Deterministic and indifferent to page size: a suite that failed baseline everywhere would prove nothing."""
    stack_for = built("baseline")
    call(c1.test_c1_run_to_run_determinism, built, "baseline", path="rollout", workload="sampled", instances="same")
    default = rollout(stack_for(c6.WORKLOAD), c6.WORKLOAD.requests())
    c6.test_c6_kv_layout_invariance(stack_for=stack_for, bitwise=Bitwise(), default_layout=default, layout="page-16-shuffled")


def test_c5_detects_baseline_chunked_prefill(built):
    stack_for = built("baseline")
    whole = rollout(stack_for(c5.WORKLOAD), c5.WORKLOAD.requests())
    message = violation(c5.test_c5_chunked_prefill_invariance, built, "baseline", whole_prompts=whole, chunk=100)
    assert "whole-prompt prefill vs prefill in chunks of 100" in message


# --------------------------------------------------------------------------- one ulp in one token

ULP_SEQ, ULP_POS = 1, 3


class OneUlpStack(KernelStack):
    """reference, except that one rollout log-prob (sequence 1, response position 3) is one ulp closer to 0"""

    def rollout(self, requests, options=EngineOptions(), capture=None):
        outputs = super().rollout(requests, options, capture)
        if len(outputs) > ULP_SEQ:
            logprobs = outputs[ULP_SEQ].logprobs.clone()
            logprobs[ULP_POS] = torch.nextafter(logprobs[ULP_POS], torch.tensor(0.0))
            outputs[ULP_SEQ].logprobs = logprobs
        return outputs


def one_ulp_stack(spec, dtype, max_model_len):
    """reference with one rollout log-prob one ulp off (the conformance suite's one-ulp control)"""
    return OneUlpStack(spec, dtype, max_model_len, reference_kernels())


def test_c3_catches_one_ulp_in_one_token_and_names_it(built):
    workload = WORKLOADS["dense"]
    truth = rollout(built("reference")(workload), workload.requests())[ULP_SEQ].logprobs[ULP_POS]
    bumped = torch.nextafter(truth, torch.tensor(0.0))
    assert int(bumped.view(torch.int32)) - int(truth.view(torch.int32)) == -1  # one ulp, in the bits

    bitwise = Bitwise()
    with pytest.raises(PropertyViolation) as failed:
        c3.test_c3_rollout_matches_trainer(stack_for=built(one_ulp_stack), trainer_for=built(one_ulp_stack, "trainer"),
                                           bitwise=bitwise, workload="dense")
    expected = (f"logprobs differ at seq {ULP_SEQ} pos {ULP_POS}: 0x{int(bumped.view(torch.int32)) & 0xFFFFFFFF:08x} "
                f"({float(bumped)!r}) vs 0x{int(truth.view(torch.int32)) & 0xFFFFFFFF:08x} ({float(truth)!r})")
    assert expected in str(failed.value)
    [(_, compared)] = bitwise.user_properties
    assert compared["bitwise_equal"] == compared["values"] - 1
    assert compared["max_abs_diff"] == abs(float(bumped) - float(truth))


# --------------------------------------------------------------------------- C9: MoE routing ties


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> str:
    return str(write_tied_router_checkpoint(tmp_path_factory.mktemp("tied")))


def route_ties_to_higher_id(router_logits, top_k, norm_topk_prob):
    """The reference router with the opposite tie-break: equal probabilities go to the higher expert id."""
    probs = softmax(router_logits)
    weights, flipped = torch.sort(probs.flip(-1), dim=-1, descending=True, stable=True)
    ids, weights = probs.shape[-1] - 1 - flipped[:, :top_k], weights[:, :top_k]
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def tie_flip_stack(spec, dtype, max_model_len):
    """reference trainer; rollout engine that breaks router ties the other way"""
    stack = KernelStack(spec, dtype, max_model_len, reference_kernels())
    stack.ops = dataclasses.replace(stack.ops, name="tie-flip", route=route_ties_to_higher_id)
    return stack


def test_tied_checkpoint_really_ties_at_the_top_k_boundary_and_inside(tied_model):
    spec = ModelSpec(tied_model)
    stack = KernelStack(spec, torch.float32, MAX_MODEL_LEN, reference_kernels())
    seen = {}
    stack.trainer_logprobs([list(range(3, 200))], [1], [1.0], capture=lambda name, t: seen.setdefault(name, t))
    logits, ids = seen["layers.0.router_logits"], seen["layers.0.topk_ids"]
    for a, b in TIED_EXPERTS:
        assert torch.equal(logits[:, a].view(torch.int32), logits[:, b].view(torch.int32))
    chosen = [(ids == a).any(-1).int() + (ids == b).any(-1).int() for a, b in TIED_EXPERTS]
    assert any((c == 1).any() for c in chosen), "no token has a twin pair split by the top-k boundary"
    assert any((c == 2).any() for c in chosen), "no token uses both experts of a twin pair"


def test_c9_catches_a_tie_break_that_differs_between_rollout_and_trainer(built):
    # invisible without exact ties ...
    call(c3.test_c3_rollout_matches_trainer, built, tie_flip_stack, workload="joins-mid-decode")
    # ... caught on the tied model
    violation(c9.test_c9_moe_routing_ties_and_combine_order, built, tie_flip_stack, check="rollout-vs-trainer", dtype="fp32")


# --------------------------------------------------------------------------- C11: a trainer that does not train


class DetachedTrainerStack(KernelStack):
    """reference, but its trainer returns log-probs cut from autograd, as a no_grad recompute would"""

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None):
        return [x.detach() for x in super().trainer_logprobs(sequences, score_from, temperatures, grad, capture)]


def detached_trainer_stack(spec, dtype, max_model_len):
    return DetachedTrainerStack(spec, dtype, max_model_len, reference_kernels())


def test_c11_catches_a_trainer_without_autograd(built):
    assert "without autograd history" in violation(c11.test_c11_trainer_differentiable, built, detached_trainer_stack,
                                                   dtype="bf16")
