"""Truncation (top-k, top-p, min-p) and the two log-prob modes: the kept set and its tie rule, the engine and
the trainer on it, the option checks, and C15's negative controls, each caught with the mode mismatch named
(docs/logprob-semantics.md)."""

import dataclasses

import pytest
import torch
from test_fidelity_controls import (  # noqa: F401 (fixtures: the catalogue's, with the oracle)
    call,
    cheats_importable,
    fixtures,
    violation,
)

from logdiff.api import Processing, Request, Stack, TrainerInputs, Unsupported
from logdiff.cli.main import main
from logdiff.conformance import test_c15_logprob_semantics as c15
from logdiff.kernels import reference_kernels
from logdiff.kernels.sampling import kept_tokens
from logdiff.oracle import Oracle
from logdiff.stacks import KernelStack
from logdiff.weights import ModelSpec


def kept(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    rows = len(logits)
    return kept_tokens(torch.tensor(logits), torch.full((rows,), temperature), torch.full((rows,), top_k),
                       torch.full((rows,), top_p), torch.full((rows,), min_p))


# --------------------------------------------------------------------------- the kept set


def test_top_k_keeps_every_token_tied_with_the_kth():
    assert kept([[3.0, 1.0, 2.0, 2.0, 0.0]], top_k=2).tolist() == [[True, False, True, True, False]]
    assert kept([[3.0, 1.0, 2.0, 2.0, 0.0]], top_k=1).tolist() == [[True, False, False, False, False]]


def test_top_p_keeps_the_smallest_likeliest_set_reaching_p_and_its_ties():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1]])).tolist()
    assert kept(logits, top_p=0.5).tolist() == [[True, False, False, False]]  # 0.5 reaches 0.5
    assert kept(logits, top_p=0.6).tolist() == [[True, True, True, False]]  # the second 0.2 ties with the last kept
    assert kept(logits, top_p=0.95).tolist() == [[True, True, True, True]]


def test_top_p_renormalises_over_what_top_k_kept():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).tolist()
    # over the top-2, 0.4 / 0.7 = 0.57 < 0.6: both stay; over the whole vocabulary 0.4 + 0.3 would be needed too
    assert kept(logits, top_k=2, top_p=0.6).tolist() == [[True, True, False, False]]
    assert kept(logits, top_k=2, top_p=0.55).tolist() == [[True, False, False, False]]


def test_min_p_keeps_tokens_at_least_min_p_times_as_likely_as_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.2, 0.05]])).tolist()
    assert kept(logits, min_p=0.3).tolist() == [[True, True, True, False]]
    assert kept(logits, min_p=0.45).tolist() == [[True, True, False, False]]
    assert kept([[0.0, 0.0, -1.0]], min_p=1.0).tolist() == [[True, True, False]]  # "at least": a tie is kept


def test_the_set_depends_on_the_values_alone_not_on_token_ids():
    logits = torch.randn(3, 64).round(decimals=1)  # many exact ties
    permutation = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    for options in (dict(top_k=7), dict(top_p=0.8), dict(min_p=0.2), dict(top_k=20, top_p=0.7, min_p=0.05)):
        assert torch.equal(kept(logits.tolist(), **options)[:, permutation], kept(logits[:, permutation].tolist(), **options))


def test_a_rows_set_does_not_depend_on_its_batch():
    logits = torch.randn(9, 1024, generator=torch.Generator().manual_seed(2))
    together = kept(logits.tolist(), 0.8, 50, 0.9, 0.05)
    for i in range(9):
        assert torch.equal(kept(logits[i : i + 1].tolist(), 0.8, 50, 0.9, 0.05)[0], together[i])


def test_greedy_rows_keep_everything():
    assert kept([[3.0, 1.0, 2.0]], temperature=0.0, top_k=1, top_p=0.1, min_p=0.9).all()


# --------------------------------------------------------------------------- engine and trainer


@pytest.fixture(scope="module")
def stack():
    return KernelStack(ModelSpec("qwen3-moe-tiny"), torch.float32, 256, reference_kernels())


def requests(**processing):
    gen = torch.Generator().manual_seed(3)
    return [Request(tuple(torch.randint(1024, (n,), generator=gen).tolist()), 12, 0.8, seed=i, arrival=i, **processing)
            for i, n in enumerate((5, 40, 130))]


def test_top_k_1_samples_the_argmax_with_processed_log_prob_exactly_0(stack):
    sampled = stack.rollout(requests(top_k=1))
    greedy = stack.rollout([dataclasses.replace(r, temperature=0.0) for r in requests()])
    assert [o.tokens for o in sampled] == [o.tokens for o in greedy]
    assert all(torch.equal(o.logprobs, torch.zeros(12)) for o in sampled)


def test_raw_log_probs_are_the_untruncated_ones_at_temperature_1(stack):
    asked = requests(top_k=20, top_p=0.9, logprobs_mode="raw")
    outputs = stack.rollout(asked)
    scored = TrainerInputs.after(asked, outputs)
    plain = stack.trainer_logprobs(scored.sequences, scored.score_from, [1.0] * len(asked))
    assert all(torch.equal(o.logprobs, p) for o, p in zip(outputs, plain))
    processed = stack.rollout(requests(top_k=20, top_p=0.9))
    assert [o.tokens for o in processed] == [o.tokens for o in outputs]  # the mode changes what is recorded only
    assert all((p.logprobs > r.logprobs).all() for p, r in zip(processed, outputs))  # T < 1 and truncation: likelier


def test_the_trainer_recomputes_the_truncation_and_scores_a_dropped_token_impossible(stack):
    asked = requests(top_k=5)
    outputs = stack.rollout(asked)
    scored = TrainerInputs.after(asked, outputs)
    assert all(torch.equal(o.logprobs, t) for o, t in zip(outputs, scored.score(stack)))
    # the token no top-5 contains: the least likely one at the first response position
    first = scored.score_from[0]
    prefix = scored.sequences[0][: first + 1]
    unlikely = int(Oracle(stack.spec, torch.float32).distributions([prefix], [first], [0.8])[0][0].argmin())
    forced = [prefix[:first] + [unlikely]]
    logp = stack.trainer_logprobs(forced, [first], [0.8], processing=[Processing(top_k=5)])[0]
    assert logp.item() == float("-inf")


class OldStyleStack(Stack):
    """a stack written before truncation existed: its trainer_logprobs takes no processing="""

    name = "old-style"

    def __init__(self):
        self.base = KernelStack(ModelSpec("qwen3-moe-tiny"), torch.float32, 256, reference_kernels())

    def rollout(self, requests, options=None):
        return self.base.rollout(requests)

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False):
        return self.base.trainer_logprobs(sequences, score_from, temperatures, grad)


def test_a_stack_without_processing_scores_plain_requests_and_declines_truncated_ones():
    old = OldStyleStack()
    plain = requests()
    assert len(TrainerInputs.after(plain, old.rollout(plain)).score(old)) == 3
    truncated = requests(top_p=0.9)
    with pytest.raises(Unsupported, match="old-style's trainer_logprobs takes no processing="):
        TrainerInputs.after(truncated, old.rollout(truncated)).score(old)


# --------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_logdiff_run_with_truncation_passes_for_reference_in_each_mode(capsys, mode):
    assert main(["run", "--stack", "reference", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50",
                 "--logprobs-mode", mode]) == 0
    out = capsys.readouterr().out
    assert f"temperature 0.8, top-k 50, top-p 0.9, {mode} log-probs" in out
    assert next(line.split() for line in out.splitlines() if line.startswith("reference"))[-2] == "pass"


@pytest.mark.parametrize("options, message", [
    (["--top-p", "1.5"], "top-p 1.5 is outside (0, 1]; pass --top-p 1 (off)"),
    (["--top-k", "-1"], "top-k -1 is negative; pass --top-k 0 (off)"),
    (["--min-p", "2"], "min-p 2.0 is outside [0, 1]; pass --min-p 0 (off)"),
    (["--logprobs-mode", "logits"], "argument --logprobs-mode: invalid choice: 'logits'"),
])
def test_bad_truncation_options_are_one_line_errors(capsys, options, message):
    assert main(["run", "--stack", "reference", *options]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- C15's negative controls


def test_c15_names_raw_log_probs_recorded_while_processed_are_asked_for(cheats_importable, fixtures):  # noqa: F811
    import cheats

    message = violation(c15.test_c15_rollout_matches_trainer_in_each_mode, fixtures, cheats.raw_logprobs,
                        truncation="top-k-top-p-min-p", mode="processed")
    assert message.startswith("C15 (rollout): log-probs read as raw (log_softmax of the logits at temperature 1, "
                              "untruncated)") and message.endswith("log-prob mode mismatch")
    call(c15.test_c15_rollout_matches_trainer_in_each_mode, fixtures, cheats.raw_logprobs,
         truncation="top-k-top-p-min-p", mode="raw")  # asked for raw, it is right


@pytest.mark.parametrize("truncation", list(c15.TRUNCATIONS))
def test_c15_names_a_trainer_that_ignores_the_truncation(cheats_importable, fixtures, truncation):  # noqa: F811
    import cheats

    message = violation(c15.test_c15_rollout_matches_trainer_in_each_mode, fixtures, cheats.trainer_ignores_truncation,
                        truncation=truncation, mode="processed")
    assert message.startswith("C15 (trainer): log-probs read as the tempered distribution without its truncation")
    assert message.endswith("log-prob mode mismatch")


def test_c15_catches_a_sampler_that_ignores_the_truncation(cheats_importable, fixtures):  # noqa: F811
    import cheats

    stack = cheats.sampler_ignores_truncation
    message = violation(c15.test_c15_rollout_matches_trainer_in_each_mode, fixtures, stack,
                        truncation="top-p", mode="processed")
    assert message.startswith("C15 (rollout): log-probs read as the tempered distribution without its truncation")
    message = violation(c15.test_c15_sampled_tokens_lie_in_the_kept_set, fixtures, stack, truncation="top-k", mode="raw")
    assert "lies outside the kept set of top-k 20 at temperature 0.8" in message
    message = violation(c15.test_c15_sampling_follows_the_truncated_distribution, fixtures, stack, truncation="top-p")
    assert message.startswith("at temperature 0.8, top-p 0.9: C0 (sampling):")


@pytest.mark.parametrize("degrees, mode", [(["--rollout-tp", "2"], "processed"), (["--trainer-tp", "2"], "raw")])
def test_truncation_is_the_same_at_every_tensor_parallel_degree(capsys, degrees, mode):
    """The kept set is decided on the gathered vocabulary row, so a sharded side keeps what one process keeps."""
    assert main(["run", "--stack", "reference", "--model", "qwen3-dense-tiny", "--batch-size", "3", "--prompt-lens",
                 "7,33,130", "--max-new-tokens", "8", "--temperature", "0.8", "--top-k", "50", "--top-p", "0.9",
                 "--min-p", "0.02", "--logprobs-mode", mode, *degrees]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("reference"))
    assert row[1] == row[2] == "24" and row[-2] == "pass"
