"""Verdict integrity: a stack that is consistent but is not the model must fail, loudly. The honest stacks
pass C0 on every C0 workload; each cheat of tests/cheats.py is caught by `logdiff run` and by the
catalogue, with the message a user sees; sampling with a wrong temperature is caught by C0's sampling test."""

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logdiff.cli.main import main
from logdiff.conformance import test_c00_fidelity as c0
from logdiff.conformance import test_c03_rollout_trainer as c3
from logdiff.conformance.bitwise import Bitwise, PropertyViolation
from logdiff.conformance.plugin import MAX_MODEL_LEN, model_len_for
from logdiff.kernels import reference_kernels
from logdiff.kernels.sampling import sample
from logdiff.oracle import Oracle
from logdiff.stacks import KernelStack, StackCache
from logdiff.weights import ModelSpec

REPO = Path(__file__).resolve().parents[1]
CHEATS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def fixtures():
    """The catalogue's fixtures for a stack: rollout and trainer instances apart, one oracle per model."""
    caches, oracles = {}, {}

    def oracle_for(w):
        key = (w.model, w.seed, w.dtype)
        if key not in oracles:
            oracles[key] = Oracle(w.spec, w.torch_dtype)
        return oracles[key]

    def for_stack(stack):
        def builder(instance):
            cache = caches.setdefault(instance, StackCache())
            return lambda w: cache.get(stack, w.spec, w.torch_dtype, model_len_for(w))

        return {"stack_for": builder("rollout"), "trainer_for": builder("trainer"), "oracle_for": oracle_for,
                "bitwise": Bitwise()}

    return for_stack


def call(test, fixtures, stack, **params):
    available = fixtures(stack)
    return test(**{k: v for k, v in available.items() if k in inspect.signature(test).parameters}, **params)


def violation(test, fixtures, stack, **params) -> str:
    with pytest.raises(PropertyViolation) as failed:
        call(test, fixtures, stack, **params)
    return str(failed.value)


# --------------------------------------------------------------------------- honest stacks pass C0


@pytest.mark.parametrize("workload", list(c0.CASES))
@pytest.mark.parametrize("stack", ["reference", "baseline", "naive", "hf"])
def test_honest_stacks_run_the_model(fixtures, stack, workload):
    call(c0.test_c0_runs_the_model, fixtures, stack, workload=workload)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
@pytest.mark.parametrize("stack", ["reference", "baseline"])
def test_honest_sampling_follows_the_model(fixtures, stack, temperature):
    call(c0.test_c0_sampling_follows_the_tempered_distribution, fixtures, stack, temperature=temperature)


def test_oracle_matches_transformers_in_fp32():
    """The oracle is the model: its fp64 log-probs agree with transformers' fp32 forward of the same weights."""
    from logdiff.baselines.hf import build_hf_model

    spec = ModelSpec("qwen3-moe-tiny", 0)
    seq = torch.randint(1024, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = Oracle(spec, torch.float32).score([seq], [1], [1.0]).logprobs[0]
    logits = build_hf_model(spec, torch.float32, "eager").eval()(input_ids=torch.tensor([seq])).logits[0, :-1]
    theirs = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1)
    assert (ours - theirs).abs().max() < 1e-5


def test_the_oracle_declines_a_checkpoint_it_cannot_read(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    from logdiff.api import Unsupported

    with pytest.raises(Unsupported, match="oracle cannot load"):
        Oracle(ModelSpec(str(tmp_path)), torch.float32)


# --------------------------------------------------------------------------- the cheats


@pytest.fixture
def cheats_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(CHEATS))


CHEAT_RUNS = {  # stack, extra `logdiff run` options, what the user sees
    "cheats:constant": ([], "C0 (rollout): the median |logp - logp_fp64| over the tokens is"),
    "cheats:zero_attention": ([], "C0 (rollout): greedy token at seq 0 pos 0 is"),
    "cheats:rounding": ([], "C0 (trainer): the median |logp - logp_fp64| over the tokens is 0.01"),
    "cheats:EchoStack": ([], "C3 (rollout vs trainer): logprobs differ at seq"),
    "cheats:TunedStack": (["--prompt-lens", "33,71"], "C3 (rollout vs trainer): logprobs differ at seq"),
    "cheats:wrong_temperature": (["--temperature", "0.7"], "C0 (rollout): the median |logp - logp_fp64| over the tokens is"),
    "cheats:model_dtype_logprobs": (["--dtype", "bf16"], "C0 (rollout): every nonzero log-prob is exactly a bf16 value"),
    # consistently the wrong model, in the dtype RL trains in
    "cheats:wrong_rope_base": (["--dtype", "bf16"], "C0 (rollout): the median |logp - logp_fp64| over the tokens is"),
    "cheats:dropped_layer": (["--dtype", "bf16"], "C0 (rollout): the median |logp - logp_fp64| over the tokens is"),
    "cheats:truncated_routing": (["--dtype", "bf16"], "C0 (rollout): the median |logp - logp_fp64| over the tokens is"),
    # below bf16's rounding in size, but one-sided: the signed median sees it on greedy decodes
    "cheats:wrong_norm_eps": (["--dtype", "bf16", "--prompt-lens", "120,250", "--batch-size", "2", "--max-new-tokens", "140",
                               "--stagger", "0"], "C0 (rollout): the median of logp - logp_fp64 over the tokens is -0.00"),
    # right at short contexts; positions past 256 round in bf16
    "cheats:rope_angles_in_model_dtype": (["--dtype", "bf16", "--prompt-lens", "2100,1990", "--batch-size", "2",
                                           "--max-new-tokens", "80"], "C0 (rollout): the 90th percentile of |logp - logp_fp64|"),
    # kernel switches in the regimes the edge workloads never reach
    "cheats:long_context_split": (["--prompt-lens", "2100,1990", "--batch-size", "2", "--max-new-tokens", "8"],
                                  "C3 (rollout vs trainer): logprobs differ at seq"),
    "cheats:large_batch_split": (["--prompt-lens", "129,140", "--batch-size", "64", "--max-new-tokens", "2", "--stagger", "0"],
                                 "C3 (rollout vs trainer): logprobs differ at seq"),
    "cheats:raw_logprobs": (["--temperature", "0.8", "--top-k", "50", "--top-p", "0.9"],
                            "C15 (rollout): log-probs read as raw (log_softmax of the logits at temperature 1, untruncated)"),
    "cheats:trainer_ignores_truncation": (["--temperature", "0.8", "--top-p", "0.9"],
                                          "C15 (trainer): log-probs read as the tempered distribution without its truncation"),
}


@pytest.mark.parametrize("stack", list(CHEAT_RUNS))
def test_logdiff_run_fails_each_cheat(cheats_importable, capsys, stack):
    options, message = CHEAT_RUNS[stack]
    assert main(["run", "--stack", stack, *options]) == 1  # a stack failed
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith(stack))
    assert row[-2] == "fail", out
    assert f"{stack}: {message}" in out


def test_the_constant_cheat_is_bitwise_consistent(cheats_importable, capsys):
    """What made it dangerous: every token bitwise equal, so a bitwise-only verdict would pass it."""
    main(["run", "--stack", "cheats:constant", "--dtype", "bf16"])
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("cheats:constant"))
    assert row[1] == row[2] == "192" and row[3] == "0" and row[-2] == "fail"


@pytest.mark.parametrize("stack", ["cheats:constant", "cheats:zero_attention", "cheats:rounding"])
def test_c0_catches_the_consistent_cheats(cheats_importable, fixtures, stack):
    import cheats

    message = violation(c0.test_c0_runs_the_model, fixtures, getattr(cheats, stack.split(":")[1]), workload="block-edges")
    assert message.startswith("C0 (rollout): ") and "C0 (trainer): " in message


WRONG_MODELS = [(cheat, dtype) for cheat in ("wrong_rope_base", "dropped_layer", "truncated_routing", "wrong_norm_eps")
                for dtype in ("fp32", "bf16", "fp16")]


@pytest.mark.parametrize("cheat, dtype", WRONG_MODELS)
def test_c0_catches_a_consistently_wrong_model_in_every_dtype(cheats_importable, fixtures, cheat, dtype):
    """Rollout and trainer agree bit for bit on a model that is not the checkpoint's; the bulk of its tokens
    moves, which a routing near-tie cannot do (the norm epsilon in bf16: by less than rounding, but one way)."""
    import cheats

    workload = "long-decode" if dtype == "fp32" else f"long-decode-{dtype}"
    message = violation(c0.test_c0_runs_the_model, fixtures, getattr(cheats, cheat), workload=workload)
    assert message.startswith("C0 (rollout): ") and "C0 (trainer): the " in message


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_c0_catches_rotary_angles_computed_in_the_model_dtype_at_long_context(cheats_importable, fixtures, dtype):
    """Inside every bound up to a few hundred positions (the edge workloads); past 2048 the rounded positions show
    in the 90th percentile over the tokens clear of a routing tie (bf16 0.053, fp16 0.0127; see logdiff.oracle)."""
    import cheats

    call(c0.test_c0_runs_the_model, fixtures, cheats.rope_angles_in_model_dtype, workload=f"block-edges-sampled-{dtype}")
    message = violation(c0.test_c0_runs_the_model, fixtures, cheats.rope_angles_in_model_dtype, workload=f"long-context-{dtype}")
    assert message.startswith("C0 (rollout): the 90th percentile of |logp - logp_fp64|") and "C0 (trainer): " in message


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.5])
def test_c0_catches_log_probs_recorded_at_another_temperature(cheats_importable, fixtures, temperature):
    import cheats

    message = violation(c0.test_c0_runs_the_model, fixtures, cheats.wrong_temperature, workload=f"sampled-T{temperature}")
    assert message.startswith("C0 (rollout): the median |logp - logp_fp64| over the tokens is") and "C0 (trainer): " in message


@pytest.mark.parametrize("workload", ["block-edges-sampled-bf16", "block-edges-sampled-fp16"])
def test_c0_catches_log_probs_rounded_to_the_model_dtype(cheats_importable, fixtures, workload):
    """Inside every bf16/fp16 error bound, but all on the dtype's grid."""
    import cheats

    message = violation(c0.test_c0_runs_the_model, fixtures, cheats.model_dtype_logprobs, workload=workload)
    dtype = workload.rsplit("-", 1)[1]
    assert message.startswith(f"C0 (rollout): every nonzero log-prob is exactly a {dtype} value") and "C0 (trainer)" in message


def test_isolation_catches_the_echoing_trainer(cheats_importable, fixtures):
    """On one instance the echo passes C3; the catalogue scores the trainer on another instance."""
    import cheats

    stack = cheats.EchoStack(ModelSpec("qwen3-moe-tiny", 0), torch.float32, MAX_MODEL_LEN)
    c3.test_c3_rollout_matches_trainer(stack_for=lambda w: stack, trainer_for=lambda w: stack, bitwise=Bitwise(),
                                       workload="joins-mid-decode")
    message = violation(c3.test_c3_rollout_matches_trainer, fixtures, cheats.EchoStack, workload="joins-mid-decode")
    assert "logprobs differ at seq" in message


def _check(stack, prop, tmp_path, *more):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHEATS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "logdiff", "check", "--stack", stack, "--property", prop, *more,
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_a_failure_names_bisect_only_where_the_stack_can_capture(tmp_path):
    """`logdiff bisect` needs the capture hook: a stack without it gets the reproduce lines but no dead-end locate line."""
    result = _check("cheats:echo_without_capture", "C3", tmp_path, "-k", "joins-mid-decode")
    assert result.returncode == 1, result.stderr
    assert "reproduce: logdiff run --stack cheats:echo_without_capture" in result.stdout
    assert "locate:" not in result.stdout


def test_logdiff_check_fails_a_consistent_cheat_naming_c0(tmp_path):
    result = _check("cheats:rounding", "C0", tmp_path)
    assert result.returncode == 1, result.stderr
    assert "FAIL (differ) test_c0_runs_the_model[block-edges]" in result.stdout
    assert "C0 (rollout): the median |logp - logp_fp64| over the tokens is 0.01" in result.stdout
    assert json.loads((tmp_path / "check.json").read_text())["stacks"][0]["properties"]["C0"]["verdict"] == "fail"


def test_logdiff_check_fails_log_probs_recorded_at_another_temperature(tmp_path):
    result = _check("cheats:wrong_temperature", "C0", tmp_path)
    assert result.returncode == 1, result.stderr
    failed = {line.split()[-1] for line in result.stdout.splitlines() if line.startswith("FAIL ")}
    assert {f"test_c0_runs_the_model[sampled-T{t}]" for t in (0.3, 0.7, 1.5)} <= failed, result.stdout
    assert "test_c0_runs_the_model[block-edges]" not in failed  # greedy: right there
    assert "C0 (rollout): the median |logp - logp_fp64| over the tokens is" in result.stdout


def test_logdiff_check_fails_a_prefill_that_switches_kernels_past_2048_tokens(tmp_path):
    """Bitwise on every workload but the one whose prefill step holds more than 2048 tokens."""
    result = _check("cheats:big_step_prefill", "C4", tmp_path, "--property", "C5", "--property", "C7")
    assert result.returncode == 1, result.stderr
    failed = [line.split()[-1] for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    assert failed == ["test_c4_decode_matches_prefill[prefill-9k]", "test_c5_chunked_prefill_invariance_past_8192_tokens",
                      "test_c7_a_9k_token_prefill_step_joins_running_decodes"], result.stdout
    assert "reproduce: logdiff run --stack cheats:big_step_prefill --batch-size 20 --prompt-lens 440,470" in result.stdout


@pytest.mark.parametrize("cheat, regime", [("long_context_split", "long-context"), ("large_batch_split", "batch-256")])
def test_c3_catches_a_kernel_switch_only_in_its_regime(cheats_importable, fixtures, cheat, regime):
    """Bitwise on every edge workload of C3; the regime workload past the switch catches it."""
    import cheats

    stack = getattr(cheats, cheat)
    for workload in ("joins-mid-decode", "sampled", "long-decode", "prefill-9k"):
        call(c3.test_c3_rollout_matches_trainer, fixtures, stack, workload=workload)
    assert "logprobs differ at seq" in violation(c3.test_c3_rollout_matches_trainer, fixtures, stack, workload=regime)


def _failed(result) -> set[str]:
    return {line.split()[-1] for line in result.stdout.splitlines() if line.startswith("FAIL ")}


@pytest.mark.parametrize("cheat, regime, run_line", [
    ("long_context_split", {"test_c3_rollout_matches_trainer[long-context]", "test_c3_rollout_matches_trainer[seed-lengths]"},
     "--batch-size 2 --prompt-lens 2100,1990"),
    ("large_batch_split", {"test_c3_rollout_matches_trainer[batch-256]"}, "--batch-size 256 --prompt-lens 129,140,200,7"),
])
def test_logdiff_check_fails_a_kernel_switch_in_its_regime_only(tmp_path, cheat, regime, run_line):
    """What the whole catalogue passed before it had regime workloads: now C3 fails there, and only there."""
    result = _check(f"cheats:{cheat}", "C3", tmp_path)
    assert result.returncode == 1, result.stderr
    failed = _failed(result)
    assert regime <= failed <= regime | {"test_c3_rollout_matches_trainer_generated_regimes"}, result.stdout
    assert f"reproduce: logdiff run --stack cheats:{cheat} {run_line}" in result.stdout


def test_logdiff_check_fails_a_wrong_rope_base_in_bf16(tmp_path):
    result = _check("cheats:wrong_rope_base", "C0", tmp_path)
    assert result.returncode == 1, result.stderr
    failed = _failed(result)
    assert {f"test_c0_runs_the_model[{case}-{dtype}]" for case in ("long-decode", "long-context")
            for dtype in ("bf16", "fp16")} <= failed, result.stdout
    assert "C0 (rollout): the median |logp - logp_fp64| over the tokens is" in result.stdout


def test_logdiff_check_fails_the_tuned_stack_on_a_generated_workload(tmp_path):
    """Bitwise on every fixed workload of C3, caught by the generated ones, shrunk to a minimal `logdiff run` line."""
    result = _check("cheats:TunedStack", "C3", tmp_path)
    assert result.returncode == 1, result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    # the regimes' generated workloads (other lengths too) catch it as well
    assert failed == ["FAIL (differ) test_c3_rollout_matches_trainer_generated",
                      "FAIL (differ) test_c3_rollout_matches_trainer_generated_regimes"], result.stdout
    assert "Falsifying example" in result.stdout or "Failing test case" in result.stdout
    assert "reproduce: logdiff run --stack cheats:TunedStack" in result.stdout


# --------------------------------------------------------------------------- sampling with a wrong temperature


def _sampling_stack(effective_temperature):
    def factory(spec, dtype, max_model_len):
        ops = reference_kernels(name="wrong-temperature")
        wrong = lambda logits, t, seeds, index: sample(logits, torch.where(t > 0, effective_temperature(t), t), seeds, index)  # noqa: E731
        return KernelStack(spec, dtype, max_model_len, dataclasses.replace(ops, sample=wrong))

    return factory


TEMPERATURE_TWICE = _sampling_stack(lambda t: t * t)
TEMPERATURE_IGNORED = _sampling_stack(lambda t: torch.ones_like(t))


# Sampling sharper than asked (a lower effective temperature) makes the draws likelier under the oracle's
# tempered distribution; flatter makes them less likely. Squaring 1.5 flattens; ignoring it sharpens.
WRONG_TEMPERATURES = [
    (TEMPERATURE_TWICE, 0.3, "likelier"), (TEMPERATURE_TWICE, 0.7, "likelier"), (TEMPERATURE_TWICE, 1.5, "less likely"),
    (TEMPERATURE_IGNORED, 0.3, "less likely"), (TEMPERATURE_IGNORED, 0.7, "less likely"), (TEMPERATURE_IGNORED, 1.5, "likelier"),
]


def _wrong_temperature_id(case) -> str:
    stack, temperature, _ = case
    return f"{'applied-twice' if stack is TEMPERATURE_TWICE else 'not-applied'}-{temperature}"


@pytest.mark.parametrize("stack, temperature, way", WRONG_TEMPERATURES, ids=map(_wrong_temperature_id, WRONG_TEMPERATURES))
def test_c0_catches_a_wrong_sampling_temperature(fixtures, stack, temperature, way):
    message = violation(c0.test_c0_sampling_follows_the_tempered_distribution, fixtures, stack, temperature=temperature)
    assert f"seeded draws are {way} under the fp64 oracle's tempered distribution" in message
