"""Offline bundles: `logdiff capture` then `logdiff bisect --bundle A --bundle B` finds what live bisect finds, with
no model; identical bundles agree; a bad or incomplete bundle is one line and exit 2, never a pass."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from logdiff.baselines.hf import build_hf_model
from logdiff.bisect.bundle import MANIFEST, ROWS, TENSORS, load_bundle
from logdiff.bisect.locate import diff_rows
from logdiff.cli.main import main
from logdiff.kernels.ablations import BREAKS_ON
from logdiff.weights import ModelSpec

NO_ORDER = BREAKS_ON["reference-no-order"]  # batch 1, prompt 200: the decode steps' lone-row GEMMs differ
NO_ORDER_ARGS = ["--stack", "reference-no-order", "--batch-size", str(NO_ORDER["batch_size"]), "--prompt-lens",
                 ",".join(map(str, NO_ORDER["prompt_lens"])), "--max-new-tokens", str(NO_ORDER["max_new_tokens"])]
SMALL = ["--stack", "reference-no-blocks", "--batch-size", "2", "--prompt-lens", "5,100", "--max-new-tokens", "4"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A rollout and a trainer bundle of a small workload on which reference-no-blocks diverges (context > 64)."""
    out = tmp_path_factory.mktemp("small")
    assert main(["capture", *SMALL, "--out", str(out)]) == 0
    return out


def _copy(small, tmp_path, side="rollout"):
    path = tmp_path / side
    shutil.copytree(small / side, path)
    return path


def _edit_manifest(path, change):
    m = json.loads((path / MANIFEST).read_text())
    change(m)
    (path / MANIFEST).write_text(json.dumps(m))


def _edit_tensors(path, change):
    tensors = load_file(str(path / TENSORS))
    change(tensors)
    save_file(tensors, str(path / TENSORS))


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("logdiff: error: "), err
    return err


def test_a_bundle_round_trip_finds_what_live_bisect_finds(tmp_path, capsys):
    live, offline = tmp_path / "live.json", tmp_path / "offline.json"
    assert main(["bisect", *NO_ORDER_ARGS, "--json", str(live)]) == 1
    assert main(["capture", *NO_ORDER_ARGS, "--out", str(tmp_path / "bundles")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'bundles' / 'rollout'}: rollout, " in out and "1 sequences" in out
    assert main(["bisect", "--bundle", str(tmp_path / "bundles" / "rollout"), "--bundle",
                 str(tmp_path / "bundles" / "trainer"), "--json", str(offline)]) == 1
    text = capsys.readouterr().out
    assert "compared from the bundles" in text and "first capture point that differs for this row: " in text
    a, b = (json.loads(p.read_text())["bisect"] for p in (live, offline))
    assert a["first"] is not None
    for key in ("divergence", "position", "first", "origin", "at_token", "grid", "logdiff", "comparison"):
        assert a[key] == b[key], key
    assert json.loads(offline.read_text())["stacks"][0]["provenance"]["platform"]["gemm_tiers"]


def test_identical_bundles_agree_exit_0(small, capsys):
    assert main(["bisect", "--bundle", str(small / "trainer"), "--bundle", str(small / "trainer")]) == 0
    out = capsys.readouterr().out
    assert "agree bit for bit on every token: nothing to bisect" in out and "run: 8 tokens, 8 bitwise equal" in out


def test_the_small_bundles_diverge_at_attention(small, capsys):
    assert main(["bisect", "--bundle", str(small / "rollout"), "--bundle", str(small / "trainer")]) == 1
    assert "first capture point that differs for this row: layers.0.attention  ->  kernel path" in capsys.readouterr().out


def test_the_manifest_says_what_the_bundle_holds(small):
    m = json.loads((small / "rollout" / MANIFEST).read_text())
    tensors = load_file(str(small / "rollout" / TENSORS))
    assert (m["format"], m["version"], m["side"], m["stack"]) == ("logdiff-bundle", 1, "rollout", "reference-no-blocks")
    assert m["model"]["name"] == "qwen3-moe-tiny" and m["model"]["config"]["num_hidden_layers"] == 2
    assert [s["prompt_len"] for s in m["sequences"]] == [5, 100] and [len(s["tokens"]) for s in m["sequences"]] == [9, 104]
    assert set(m["points"]) == {n for n in tensors if not n.endswith(ROWS)}
    assert all(m["points"][n] == str(tensors[n].dtype).removeprefix("torch.") for n in m["points"])
    assert tensors["logprob" + ROWS].tolist() == [[0, 4], [0, 5], [0, 6], [0, 7], [1, 99], [1, 100], [1, 101], [1, 102]]
    assert tensors["tokens"].tolist() == [t for s in m["sequences"] for t in s["tokens"][:-1]]  # the last is never fed
    assert m["provenance"]["stacks"][0]["describe"]["name"] == "reference-no-blocks"


def test_capture_again_replaces_the_bundle_whole_and_leaves_no_temporary_folder(small, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(small, out)
    assert main(["capture", *SMALL, "--side", "trainer", "--max-new-tokens", "2", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["rollout", "trainer"]
    assert [len(s["tokens"]) for s in json.loads((out / "trainer" / MANIFEST).read_text())["sequences"]] == [7, 102]


def test_capture_refuses_to_replace_a_folder_that_is_not_a_bundle(tmp_path, capsys):
    (tmp_path / "rollout").mkdir()
    assert main(["capture", *SMALL, "--side", "rollout", "--out", str(tmp_path)]) == 2
    assert f"{tmp_path / 'rollout'} exists and is not a bundle; choose another --out" in _error_line(capsys)


def _drop_point(name):
    return lambda t: [t.pop(name), t.pop(name + ROWS)]


def _drop_last_logprob(t):
    t["logprob"], t["logprob" + ROWS] = t["logprob"][:-1].clone(), t["logprob" + ROWS][:-1].clone()


def _nan_at_row_3(t):
    t["layers.0.q_proj"][3, 5] = float("nan")


def _row_outside(t):
    t["positions" + ROWS][0, 1] = 500


# (how one bundle is broken, the line that must say so)
BROKEN_ONE = {
    "no manifest": (lambda p: (p / MANIFEST).unlink(), "has no manifest.json; write it with `logdiff capture`"),
    "no tensors": (lambda p: (p / TENSORS).unlink(), "has no tensors.safetensors"),
    "manifest not JSON": (lambda p: (p / MANIFEST).write_text("{"), "manifest.json is not JSON"),
    "tensors unreadable": (lambda p: (p / TENSORS).write_bytes(b"\0" * 16), "tensors.safetensors cannot be read"),
    "other format": (lambda p: _edit_manifest(p, lambda m: m.update(format="x")), 'does not say "format": "logdiff-bundle"'),
    "newer version": (lambda p: _edit_manifest(p, lambda m: m.update(version=2)),
                      "is format version 2; this logdiff reads version 1"),
    "no sequences": (lambda p: _edit_manifest(p, lambda m: m.pop("sequences")), "manifest.json lacks 'sequences' (a JSON list)"),
    "no prompt length": (lambda p: _edit_manifest(p, lambda m: m["sequences"][1].pop("prompt_len")),
                         "manifest.json's sequence 1 needs \"tokens\" (prompt + response ids) and \"prompt_len\""),
    "not qwen3": (lambda p: _edit_manifest(p, lambda m: m["model"]["config"].update(model_type="llama")),
                  "has model_type 'llama'; logdiff supports qwen3 and qwen3_moe checkpoints"),
    "required point missing": (lambda p: _edit_tensors(p, _drop_point("logprob")),
                               "missing capture point logprob (not in tensors.safetensors's 'logprob', "
                               "tensors.safetensors's 'logprob:rows')"),
    "listed point missing": (lambda p: _edit_tensors(p, _drop_point("layers.1.experts")),
                             "missing capture point layers.1.experts"),
    "index missing": (lambda p: _edit_tensors(p, lambda t: t.pop("embedding" + ROWS)),
                      "missing capture point embedding (not in tensors.safetensors's 'embedding:rows')"),
    "dtype not the manifest's": (lambda p: _edit_tensors(p, lambda t: t.update(embedding=t["embedding"].double())),
                                 "point embedding is float64 in tensors.safetensors but float32 in manifest.json"),
    "NaN": (lambda p: _edit_tensors(p, _nan_at_row_3), "point layers.0.q_proj holds NaN at sequence 0 position 3"),
    "row outside": (lambda p: _edit_tensors(p, _row_outside), "point positions has a row at sequence 0 position 500"),
    "logprob incomplete": (lambda p: _edit_tensors(p, _drop_last_logprob),
                           "point logprob lacks sequence 1 position 102 (it scores token 103)"),
}


@pytest.mark.parametrize("case", BROKEN_ONE)
def test_a_bad_bundle_is_one_line_and_exit_2(small, tmp_path, capsys, case):
    path = _copy(small, tmp_path)
    breaks, message = BROKEN_ONE[case]
    breaks(path)
    assert main(["bisect", "--bundle", str(path), "--bundle", str(small / "trainer")]) == 2
    assert message in _error_line(capsys)


def _other_token(m):
    m["sequences"][1]["tokens"][101] = (m["sequences"][1]["tokens"][101] + 1) % 1024


def _narrow_q_proj(t):
    t["layers.0.q_proj"] = t["layers.0.q_proj"][:, :64].clone()


def _first_sequence_only(t):
    for name in [n for n in t if not n.endswith(ROWS)]:
        keep = t[name + ROWS][:, 0] == 0
        t[name], t[name + ROWS] = t[name][keep], t[name + ROWS][keep]


# (how the second bundle is changed, the line that must say the two cannot be compared)
MISMATCHED = {
    "tokens": (lambda p: _edit_manifest(p, _other_token),
               "hold different tokens in sequence 1 (first at position 101, prompt lengths 100 and 100)"),
    "model": (lambda p: _edit_manifest(p, lambda m: m["model"]["config"].update(rope_theta=10.0)),
              "are of different models (rope_theta differ)"),
    "dtype": (lambda p: _edit_manifest(p, lambda m: m["model"].update(dtype="bf16")),
              "are of different dtypes (fp32 vs bf16)"),
    "shape": (lambda p: _edit_tensors(p, _narrow_q_proj),
              "differ in point layers.0.q_proj's rows: [128] float32 vs [64] float32"),
    "sequences": (lambda p: [_edit_manifest(p, lambda m: m["sequences"].pop()), _edit_tensors(p, _first_sequence_only)],
                  "hold 2 and 1 sequences"),
}


@pytest.mark.parametrize("case", MISMATCHED)
def test_bundles_that_cannot_be_compared_are_one_line_and_exit_2(small, tmp_path, capsys, case):
    path = _copy(small, tmp_path, "trainer")
    changes, message = MISMATCHED[case]
    changes(path)
    assert main(["bisect", "--bundle", str(small / "rollout"), "--bundle", str(path)]) == 2
    assert message in _error_line(capsys)


@pytest.mark.parametrize("args, message", [
    (["--bundle", "A"], "--bundle compares two bundles, got 1; pass --bundle A --bundle B"),
    (["--bundle", "A", "--bundle", "B", "--stack", "reference"], "leave out --stack"),
    (["--bundle", "/no/such/bundle", "--bundle", "B"], "bundle /no/such/bundle is not a folder"),
])
def test_bad_bundle_arguments_are_one_line_and_exit_2(capsys, args, message):
    assert main(["bisect", *args]) == 2
    assert message in _error_line(capsys)


def _recipe():
    """docs/bundle-format.md's `write_bundle`, the hooks recipe, as its readers copy it."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "bundle-format.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", doc, re.S) if "def write_bundle" in block)
    namespace = {}
    exec(compile(code, "docs/bundle-format.md", "exec"), namespace)
    return namespace["write_bundle"]


def test_the_documented_hooks_recipe_writes_a_bundle_bisect_reads(tmp_path, capsys):
    args = ["--batch-size", "2", "--prompt-lens", "5,40", "--max-new-tokens", "3"]
    assert main(["capture", "--stack", "hf", "--side", "trainer", *args, "--out", str(tmp_path / "hf")]) == 0
    assert main(["capture", "--stack", "reference", "--side", "rollout", *args, "--out", str(tmp_path / "ref")]) == 0
    model = build_hf_model(ModelSpec("qwen3-moe-tiny"), torch.float32, "sdpa")
    write_bundle = _recipe()
    for source, out in (("hf", "hooks-hf"), ("ref", "hooks-ref")):
        sequences = json.loads((next((tmp_path / source).iterdir()) / MANIFEST).read_text())["sequences"]
        write_bundle(model, [s["tokens"] for s in sequences], [s["prompt_len"] for s in sequences], tmp_path / out)
    # the same forward as logdiff's own hooks on transformers: every point both hold, bit for bit
    ours, theirs = load_bundle(tmp_path / "hf" / "trainer"), load_bundle(tmp_path / "hooks-hf")
    common = set(ours.points) & set(theirs.points)
    assert {"tokens", "positions", "embedding", "layers.1.attention", "layers.1.combine", "logits", "logprob"} <= common
    for name in common:
        a, b = ours.rows_of(name), theirs.rows_of(name)
        assert a.keys() == b.keys() and all(diff_rows(a[k], b[k]).equal for k in a), name
    capsys.readouterr()
    assert main(["bisect", "--bundle", str(tmp_path / "hf" / "trainer"), "--bundle", str(tmp_path / "hooks-hf")]) == 0
    # against another engine's rollout: localised to an op, as live bisect of hf would be
    assert main(["bisect", "--bundle", str(tmp_path / "ref" / "rollout"), "--bundle", str(tmp_path / "hooks-ref")]) == 1
    assert "first capture point that differs for this row: layers.0." in capsys.readouterr().out
