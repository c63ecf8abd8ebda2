"""`logdiff bisect` across ranks: a sharded path is captured on every rank, its ranks' parts are put back
together as one process computes them, and a reduction whose order follows the degree is traced to the
collective it ends in and a rank. The reference, whose reductions run in a fixed order, has nothing to bisect."""

import json

import pytest

from logdiff.bisect.locate import KERNEL_PATH
from logdiff.cli.main import main

DENSE = ["--model", "qwen3-dense-tiny", "--batch-size", "2", "--prompt-lens", "7,33", "--max-new-tokens", "4"]
MOE = ["--model", "qwen3-moe-tiny", "--batch-size", "2", "--prompt-lens", "7,33", "--max-new-tokens", "4"]


def _bisect(tmp_path, capsys, *argv) -> tuple[str, dict]:
    path = tmp_path / "bisect.json"
    code = main(["bisect", *argv, "--json", str(path)])
    b = json.loads(path.read_text())["bisect"]
    assert code == (1 if b["divergence"] else 0)  # diverging paths fail rollout = trainer
    return capsys.readouterr().out, b


def _cause(b: dict) -> dict:
    """The kernel-path finding: the first differing point, or where an upstream difference came in."""
    cause = b["origin"] or b["first"]
    assert cause["klass"] == KERNEL_PATH and all(not i["differing_positions"] for i in cause["inputs"])
    assert cause["diff"]["rollout_bits"] != cause["diff"]["trainer_bits"]
    return cause


@pytest.mark.parametrize("layout, sides, world", [
    (["--trainer-tp", "1", "--rollout-tp", "2"], {"rollout": "rollout TP2", "trainer": "trainer TP1"}, 2),
    # 4 ranks share the 2 KV heads: the parts put together must give one process's keys, or k_proj would differ first
    (["--tp", "4", "--path", "trainer"], {"rollout": "trainer TP4", "trainer": "trainer TP1"}, 4),
])
def test_no_reduce_order_is_traced_to_a_row_parallel_all_reduce(tmp_path, capsys, layout, sides, world):
    out, b = _bisect(tmp_path, capsys, "--stack", "reference-no-reduce-order", *DENSE, *layout)
    print(out)
    cause = _cause(b)
    assert b["sides"] == sides and cause["point"].rsplit(".", 1)[-1] in ("o_proj", "mlp")
    assert cause["collective"].endswith("all_reduce (row-parallel reduction)")
    assert cause["side"] == sides["rollout"] and cause["world"] == world and cause["rank"] in cause["ranks"]
    layer = cause["point"].split(".")[1]
    assert f"collective: layer {layer} {cause['collective']}, rank {cause['rank']}" in out


def test_baseline_rollout_tp2_against_tp1_is_traced_to_a_native_all_reduce(tmp_path, capsys):
    out, b = _bisect(tmp_path, capsys, "--stack", "baseline", *DENSE, "--rollout-tp", "2", "--path", "rollout")
    print(out)
    cause = _cause(b)
    assert b["sides"] == {"rollout": "rollout TP2", "trainer": "rollout TP1"}
    assert "all_reduce" in cause["collective"] and cause["rank"] in cause["ranks"]


def test_an_expert_gemm_that_follows_the_rows_is_traced_to_the_rank_that_ran_the_expert(tmp_path, capsys):
    """An expert sees the same rows on any EP degree; what follows the degree is grouped_experts' choice of
    one batched GEMM over the experts a rank holds (rows: the largest expert's count) or one GEMM per
    expert (rows: its own count). reference-no-order's GEMM reduces a lone last row differently, so on
    every CPU a rank that chooses otherwise than one process does changes some expert row (1 of 96
    log-probs differ here)."""
    workload = ["--model", "qwen3-moe-tiny", "--batch-size", "4", "--prompt-lens", "3,8", "--max-new-tokens", "24"]
    out, b = _bisect(tmp_path, capsys, "--stack", "reference-no-order", *workload, "--ep", "2", "--path", "rollout")
    print(out)
    cause = _cause(b)
    assert cause["point"].endswith(".experts") and "all_to_all" in cause["collective"]
    experts_per_rank = 8 // 2
    assert cause["rank"] == cause["expert"] // experts_per_rank


def test_the_reference_has_nothing_to_bisect_across_degrees(capsys):
    """Trainer on one process, rollout on 2 tensor- and expert-parallel ranks: the same bits."""
    assert main(["bisect", "--stack", "reference", *MOE, "--trainer-tp", "1", "--rollout-tp", "2", "--ep", "2"]) == 0
    assert "rollout TP2 EP2 and trainer TP1 EP2 agree bit for bit on every token: nothing to bisect" in capsys.readouterr().out
