"""Tensor and expert parallelism: the negative controls of C8 (baseline's native all_reduce and the
reference without its fixed reduction order are caught, with the first divergence named), the ablation
leaves single-process properties alone, and `logdiff run --trainer-tp 1 --rollout-tp 2` is bitwise."""

import json

import pytest
import torch

from logdiff.api import Unsupported
from logdiff.cli.main import main
from logdiff.comm import SINGLE_PROCESS
from logdiff.conformance import test_c03_rollout_trainer as c3
from logdiff.conformance import test_c08_parallel as c8
from logdiff.conformance.bitwise import Bitwise, PropertyViolation
from logdiff.kernels.ablations import BREAKS_C8_ON
from logdiff.kernels.linear import fixed_order_row_linear, linear
from logdiff.stacks import StackCache
from logdiff.workload import Workload


@pytest.fixture(scope="module")
def cache():
    return StackCache()


def stack_for(cache, name):
    return lambda w: cache.get(name, w.spec, w.torch_dtype, 512)


@pytest.mark.parametrize("name", ["baseline", "reference-no-reduce-order"])
def test_c8_catches_a_degree_dependent_reduction(cache, name):
    fields, degrees = BREAKS_C8_ON["reference-no-reduce-order"]
    w = Workload(**fields)
    stack = stack_for(cache, name)(w)
    with pytest.raises(PropertyViolation) as failed:
        c8.assert_degree_invariant(stack, w, Bitwise(), [dict(trainer_tp=d, rollout_tp=d) for d in degrees])
    message = str(failed.value)
    print(message)
    assert "rollout TP1 vs rollout TP2" in message and "logprobs differ at seq" in message
    reference = stack_for(cache, "reference")(w)
    c8.assert_degree_invariant(reference, w, Bitwise(), [dict(trainer_tp=d, rollout_tp=d) for d in degrees])


def test_no_reduce_order_breaks_only_parallel_invariance(cache):
    """One process: the ablation is the reference GEMM itself, so C3 holds."""
    c3.test_c3_rollout_matches_trainer(stack_for=stack_for(cache, "reference-no-reduce-order"),
                                       trainer_for=stack_for(StackCache(), "reference-no-reduce-order"), bitwise=Bitwise(),
                                       workload="breaks-no-order")


def test_a_sharded_path_refuses_a_capture_it_cannot_hand_back(cache):
    """Each rank fills its own copy of the capture; one without add_ranks could not receive them."""
    w = Workload(model="qwen3-dense-tiny", batch_size=1, prompt_lens=(3,), max_new_tokens=1)
    stack = stack_for(cache, "reference")(w).parallel(rollout_tp=2)
    with pytest.raises(Unsupported, match="this capture has no add_ranks"):
        stack.rollout(w.requests(), capture=lambda name, tensor: None)


def test_fixed_order_row_linear_is_a_k_split_sum_close_to_the_gemm():
    x, w = torch.randn(5, 128), torch.randn(64, 128)
    out = fixed_order_row_linear(x, w, SINGLE_PROCESS)
    chunks = [linear(xc.contiguous(), wc.contiguous()) for xc, wc in zip(x.chunk(4, -1), w.chunk(4, -1))]
    assert torch.equal(out, chunks[0] + chunks[1] + chunks[2] + chunks[3])
    torch.testing.assert_close(out, x @ w.T)


def test_run_trainer_tp1_rollout_tp2_is_bitwise_for_reference(tmp_path, capsys):
    path = tmp_path / "run.json"
    argv = ["run", "--stack", "reference", "--model", "qwen3-moe-tiny", "--batch-size", "2", "--prompt-lens", "7,33",
            "--max-new-tokens", "4", "--trainer-tp", "1", "--rollout-tp", "2", "--json", str(path)]
    assert main(argv) == 0
    assert "parallel {'trainer_tp': 1, 'rollout_tp': 2, 'ep': 1}" in capsys.readouterr().out
    [result] = json.loads(path.read_text())["stacks"]
    assert result["verdict"] == "pass" and result["describe"]["parallel"] == {"trainer": 1, "rollout": 2, "ep": 1}


def test_a_tied_lm_head_scores_only_its_ranks_vocabulary(capsys):
    """Qwen3-0.6B ties its lm_head to the embedding table. A tensor-parallel rank's engine once re-tied its
    vocabulary slice to the whole table, so every rank summed exp over all of V: log 2 off at TP2."""
    argv = ["run", "--stack", "reference", "--model", "qwen3-0.6b", "--layers", "2", "--batch-size", "1", "--prompt-lens", "7",
            "--max-new-tokens", "2", "--trainer-tp", "1", "--rollout-tp", "2"]
    assert main(argv) == 0, capsys.readouterr().out
