"""`logdiff analyze FILE` on verl-style batches made from a real `logdiff run --dump`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from logdiff.cli.main import main

RUN_ARGS = ["--batch-size", "3", "--prompt-lens", "1,129,17", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One small `logdiff run` of reference and baseline, with its tensors dumped and its JSON written."""
    d = tmp_path_factory.mktemp("run")
    assert main(["run", "--stack", "reference", "--stack", "baseline", *RUN_ARGS,
                 "--dump", str(d), "--json", str(d / "run.json")]) == 1  # baseline fails
    return d


def verl_batch(run_dir, stack: str) -> dict[str, torch.Tensor]:
    """The dump under verl's names and dtypes (verl keeps response_mask as int64)."""
    dump = load_file(run_dir / f"{stack}.safetensors")
    return {
        "old_log_probs": dump["trainer_logprobs"],
        "rollout_log_probs": dump["rollout_logprobs"],
        "response_mask": dump["response_mask"].long(),
    }


def analyze(path, tmp_path) -> dict:
    out = tmp_path / "analyze.json"
    code = main(["analyze", str(path), "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["command"] == "analyze"
    assert code == {"pass": 0, "fail": 1}[data["stacks"][0]["verdict"]]  # the exit status every command gives
    return data["stacks"][0]


def run_result(run_dir, stack: str) -> dict:
    return next(s for s in json.loads((run_dir / "run.json").read_text())["stacks"] if s["name"] == stack)


def one_ulp_down(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.tensor(float("-inf"), dtype=x.dtype))


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("stack", ["reference", "baseline"])
def test_same_figures_and_verdict_as_logdiff_run(run_dir, tmp_path, stack, fmt):
    path = tmp_path / f"batch.{fmt}"
    batch = verl_batch(run_dir, stack)
    torch.save(batch, path) if fmt == "pt" else save_file(batch, str(path))
    got, ran = analyze(path, tmp_path), run_result(run_dir, stack)
    for key in ("tokens", "bitwise_equal_tokens", "max_abs_logdiff", "mean_abs_logdiff", "first_divergence",
                "metrics", "verdict"):
        assert got[key] == ran[key], key
    assert got["verdict"] == ("pass" if stack == "reference" else "fail")


def test_one_ulp_change_fails_at_exactly_that_token(run_dir, tmp_path, capsys):
    batch = verl_batch(run_dir, "reference")
    seq, pos = 2, 5
    batch["rollout_log_probs"][seq, pos] = one_ulp_down(batch["rollout_log_probs"][seq, pos])
    torch.save(batch, tmp_path / "batch.pt")
    got = analyze(tmp_path / "batch.pt", tmp_path)
    assert got["verdict"] == "fail"
    assert got["bitwise_equal_tokens"] == got["tokens"] - 1
    d = got["first_divergence"]
    assert (d["seq"], d["pos"]) == (seq, pos)
    assert abs(int(d["trainer_bits"], 16) - int(d["rollout_bits"], 16)) == 1  # neighbouring floats
    assert f"first divergence at seq {seq} pos {pos}" in capsys.readouterr().out


def test_position_is_the_column_of_the_padded_batch(run_dir, tmp_path):
    """Masked-out columns (a multi-turn batch's tool tokens, right padding) are skipped, whatever they hold."""
    batch = verl_batch(run_dir, "reference")
    width = batch["response_mask"].shape[1]
    padded = {k: torch.nn.functional.pad(v, (0, 3)) for k, v in batch.items()}
    padded["old_log_probs"][:, width:] = float("nan")
    padded["rollout_log_probs"][:, width:] = float("-inf")
    padded["response_mask"][0, 1:3] = 0  # a hole inside sequence 0
    padded["rollout_log_probs"][0, 1:3] = 0.5
    padded["rollout_log_probs"][0, 4] = one_ulp_down(padded["rollout_log_probs"][0, 4])
    torch.save(padded, tmp_path / "batch.pt")
    got = analyze(tmp_path / "batch.pt", tmp_path)
    assert got["tokens"] == int(batch["response_mask"].sum()) - 2
    assert got["bitwise_equal_tokens"] == got["tokens"] - 1
    assert (got["first_divergence"]["seq"], got["first_divergence"]["pos"]) == (0, 4)
    assert all(v == v and abs(v) != float("inf") for v in got["metrics"].values()), got["metrics"]


def test_bf16_rollout_equal_in_value_passes(run_dir, tmp_path):
    """A bf16 side widens exactly to the other side's fp32: equal values compare bit-equal."""
    batch = verl_batch(run_dir, "reference")
    batch["rollout_log_probs"] = batch["rollout_log_probs"].bfloat16()
    batch["old_log_probs"] = batch["rollout_log_probs"].float()
    torch.save(batch, tmp_path / "batch.pt")
    assert analyze(tmp_path / "batch.pt", tmp_path)["verdict"] == "pass"


def _without(key):
    return lambda b: b.pop(key)


def _set(key, value):
    return lambda b: b.__setitem__(key, value(b))


BAD_BATCHES = {
    "missing key": (_without("rollout_log_probs"), "has no tensor rollout_log_probs"),
    "shape mismatch": (_set("old_log_probs", lambda b: b["old_log_probs"][:, :-1]), "must be one padded"),
    "integer log-probs": (_set("rollout_log_probs", lambda b: b["rollout_log_probs"].long()), "not floating point"),
    "empty mask": (_set("response_mask", lambda b: torch.zeros_like(b["response_mask"])), "selects no token"),
    "mask not 0/1": (_set("response_mask", lambda b: b["response_mask"] * 2), "other than 0 and 1"),
    "1-D tensors": (lambda b: b.update({k: v[0] for k, v in b.items()}), "must be one padded"),
}


@pytest.mark.parametrize("case", BAD_BATCHES)
def test_bad_batch_is_a_one_line_error(run_dir, tmp_path, capsys, case):
    change, message = BAD_BATCHES[case]
    batch = verl_batch(run_dir, "reference")
    change(batch)
    torch.save(batch, tmp_path / "batch.pt")
    assert main(["analyze", str(tmp_path / "batch.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("logdiff: error:") and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("content, message", [
    (None, "is not a file"),
    (b"", "not a torch.save file"),
    (b"old_log_probs,rollout_log_probs\n", "not a torch.save file"),
])
def test_unreadable_file_is_a_one_line_error(tmp_path, capsys, content, message):
    path = tmp_path / "batch.pt"
    if content is not None:
        path.write_bytes(content)
    assert main(["analyze", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("logdiff: error:") and err.count("\n") == 1 and message in err, err


def test_not_a_dict_and_bad_safetensors_are_errors(tmp_path, capsys):
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    assert main(["analyze", str(tmp_path / "list.pt")]) == 2
    assert "holds a list, not a dict of tensors" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "bad.safetensors")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_unwritable_json_fails_before_reading(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "absent.pt"), "--json", str(tmp_path / "no" / "such" / "r.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_one_tensor_saved_as_both_is_named(run_dir, tmp_path, capsys):
    batch = verl_batch(run_dir, "reference")
    batch["old_log_probs"] = batch["rollout_log_probs"]  # old_log_probs = rollout_log_probs
    torch.save(batch, tmp_path / "batch.pt")
    got = analyze(tmp_path / "batch.pt", tmp_path)
    assert got["verdict"] == "pass"
    assert any(n.startswith("warning: old_log_probs and rollout_log_probs are the same tensor") for n in got["notes"])
    assert "proves the two recorded tensors agree (consistency), not that either computes the model" in capsys.readouterr().out


def test_a_copy_shows_in_the_masked_padding(run_dir, tmp_path):
    batch = verl_batch(run_dir, "reference")
    pad = torch.full((batch["response_mask"].shape[0], 2), -7.25)  # what the engine left in two padded slots
    rollout = torch.cat([batch["rollout_log_probs"], pad], dim=1)
    batch["response_mask"] = torch.cat([batch["response_mask"], torch.zeros_like(pad, dtype=torch.long)], dim=1)
    batch["rollout_log_probs"], batch["old_log_probs"] = rollout, rollout.clone()
    torch.save(batch, tmp_path / "batch.pt")
    notes = analyze(tmp_path / "batch.pt", tmp_path)["notes"]
    assert any("bitwise identical even in the masked padding" in n for n in notes)


def test_an_honest_recompute_gets_only_the_fidelity_note(run_dir, tmp_path):
    torch.save(verl_batch(run_dir, "reference"), tmp_path / "batch.pt")
    notes = analyze(tmp_path / "batch.pt", tmp_path)["notes"]
    assert len(notes) == 1 and notes[0].startswith("note: a pass here proves")
