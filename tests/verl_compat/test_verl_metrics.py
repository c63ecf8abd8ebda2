"""logdiff's framework metrics against verl 0.9.1's own functions on the same log-prob tensors.

The tensors come from real runs of the default workload (`logdiff run`'s) through reference (bitwise
equal), baseline and hf (not), in fp32 and bf16. verl computes with
`verl.trainer.ppo.rollout_corr_helper.compute_offpolicy_metrics` (through verl's own wrapper that adds
the `rollout_corr/` prefix) and `verl.utils.debug.metrics.calculate_debug_metrics` on a DataProto.
Every value must be bit-identical, not merely close.
"""

from __future__ import annotations

import json

import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_corr_metrics_from_logprobs,
)
from verl.utils.debug.metrics import calculate_debug_metrics

from logdiff import stacks
from logdiff.cli.main import main
from logdiff.metrics import pad_sequences, response_mask
from logdiff.runner import StackRun, run_stack
from logdiff.workload import Workload

CASES = [(stack, dtype) for stack in ("reference", "baseline", "hf") for dtype in ("fp32", "bf16")]
# verl logs this flag (1 when the batch has a response token); logdiff rejects such a batch instead.
VERL_ONLY = {"training/rollout_probs_diff_valid"}
# slime's figure, which verl does not compute.
LOGDIFF_ONLY = {"train_rollout_logprob_abs_diff"}


@pytest.fixture(scope="module")
def runs():
    done: dict[tuple[str, str], StackRun] = {}

    def run(stack: str, dtype: str) -> StackRun:
        if (stack, dtype) not in done:
            w = Workload(dtype=dtype)
            done[stack, dtype] = run_stack(stacks.build(stack, w.spec, w.torch_dtype, w.max_model_len), w)
        return done[stack, dtype]

    return run


def verl_metrics(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, responses: torch.Tensor) -> dict:
    metrics = compute_rollout_corr_metrics_from_logprobs(log_prob=old, rollout_log_prob=rollout, response_mask=mask)
    batch = DataProto.from_dict(tensors={
        "old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask, "responses": responses,
    })
    metrics.update(calculate_debug_metrics(batch))
    return metrics


def response_tokens(run: StackRun, width: int) -> torch.Tensor:
    out = torch.zeros(len(run.rollout), width, dtype=torch.long)
    for i, o in enumerate(run.rollout):
        out[i, : len(o.tokens)] = torch.tensor(o.tokens)
    return out


def assert_equal_to_verl(comparisons: list, case: dict, ours: dict, verl: dict) -> None:
    """Records the pair, then checks the names and the bits of every value verl logs."""
    shared = sorted(set(verl) - VERL_ONLY)
    metrics = {
        k: {"logdiff": ours.get(k), "verl": verl[k], "equal": k in ours and float(ours[k]).hex() == float(verl[k]).hex()}
        for k in shared
    }
    comparisons.append({**case, "all_equal": all(m["equal"] for m in metrics.values()), "metrics": metrics})
    assert set(ours) == set(shared) | LOGDIFF_ONLY, f"names differ: {sorted(set(ours) ^ (set(shared) | LOGDIFF_ONLY))}"
    differ = {k: (m["logdiff"], m["verl"]) for k, m in metrics.items() if not m["equal"]}
    assert not differ, f"{case}: logdiff vs verl differ: {differ}"


@pytest.mark.parametrize("stack, dtype", CASES)
def test_logdiff_run_figures_equal_verl(runs, comparisons, stack, dtype):
    """The figures `logdiff run` reports, against verl's on the same right-padded batch."""
    run = runs(stack, dtype)
    rollout = [o.logprobs for o in run.rollout]
    old, roll = pad_sequences([t.detach() for t in run.trainer]), pad_sequences(rollout)
    mask = response_mask(rollout).long()  # verl keeps response_mask as int64
    verl = verl_metrics(old, roll, mask, response_tokens(run, mask.shape[1]))
    case = {"name": f"{stack}-{dtype}", "stack": stack, "dtype": dtype, "input": "logdiff run: its right-padded batch"}
    assert_equal_to_verl(comparisons, case, run.comparison.metrics, verl)
    assert (run.comparison.verdict == "pass") == (stack == "reference")


def ragged_batch(run: StackRun) -> dict[str, torch.Tensor]:
    """verl's layout with responses of different lengths: row i ends 5*i tokens early, 4 spare columns;
    padding holds NaN and -inf, which must not reach any figure."""
    old, roll = pad_sequences([t.detach() for t in run.trainer]), pad_sequences([o.logprobs for o in run.rollout])
    rows, width = old.shape
    lengths = torch.tensor([max(width - 5 * i, 1) for i in range(rows)])
    mask = (torch.arange(width + 4)[None, :] < lengths[:, None]).long()

    def spread(x: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.where(mask.bool(), torch.nn.functional.pad(x, (0, 4)), fill)

    return {"old_log_probs": spread(old, float("nan")), "rollout_log_probs": spread(roll, float("-inf")), "response_mask": mask}


@pytest.mark.parametrize("stack, dtype", CASES)
def test_logdiff_analyze_of_a_verl_batch_equals_verl(runs, comparisons, tmp_path, stack, dtype):
    run = runs(stack, dtype)
    batch = ragged_batch(run)
    torch.save(batch, tmp_path / "batch.pt")
    # analyze exits 1 on a bitwise difference (logdiff.cli.options.exit_status): every stack but reference has one
    assert main(["analyze", str(tmp_path / "batch.pt"), "--json", str(tmp_path / "out.json")]) == (stack != "reference")
    got = json.loads((tmp_path / "out.json").read_text())["stacks"][0]
    verl = verl_metrics(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
                        response_tokens(run, batch["response_mask"].shape[1]))
    case = {"name": f"{stack}-{dtype}", "stack": stack, "dtype": dtype,
            "input": "logdiff analyze: ragged verl batch, NaN/-inf in the padding"}
    assert_equal_to_verl(comparisons, case, got["metrics"], verl)
    assert got["tokens"] == int(batch["response_mask"].sum())


def test_saved_dataproto_is_refused_and_the_export_it_names_works(runs, tmp_path, capsys):
    """verl's own save_to_disk pickles the DataProto; the error's export recipe gives a file analyze reads."""
    batch = DataProto.from_dict(tensors=ragged_batch(runs("hf", "bf16")))
    batch.save_to_disk(tmp_path / "batch.pkl")
    assert main(["analyze", str(tmp_path / "batch.pkl")]) == 2
    err = capsys.readouterr().err
    assert "pickled verl DataProto" in err and err.count("\n") == 1, err
    torch.save({k: batch.batch[k] for k in ("old_log_probs", "rollout_log_probs", "response_mask")}, tmp_path / "batch.pt")
    assert main(["analyze", str(tmp_path / "batch.pt")]) == 1  # hf's log-probs differ: exit 1, verdict fail
    assert "fail" in capsys.readouterr().out
