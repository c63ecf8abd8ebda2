"""Proof on known causes: bisect names the op each ablation changes, in the layer where it first shows,
with the right class; and it reports what it really finds for `baseline` and for transformers."""

import pytest
import torch
import torch.nn.functional as F

from logdiff.baselines.hf import HFStack
from logdiff.baselines.hf_capture import capture_hooks
from logdiff.bisect.capture import capture_logprobs
from logdiff.bisect.locate import KERNEL_PATH, UPSTREAM, bisect
from logdiff.kernels.ablations import BREAKS_ON
from logdiff.workload import Workload


def _bisect(stack_cache, name, **fields):
    w = Workload(**fields)
    result = bisect(stack_cache(name, w), w)
    _check_consistent(result)
    return result


def _check_consistent(b):
    """What must hold whatever the cause: the named point is the first to differ at the row, its class
    follows from its inputs, and the row scores the first divergent token of the run."""
    d = b.divergence
    assert (d.seq, d.pos) == (b.comparison.first_divergence.seq, b.comparison.first_divergence.pos)
    names = list(b.at_token)
    first = names.index(b.first.point)
    assert all(b.at_token[n].equal for n in names[:first]) and not b.at_token[b.first.point].equal
    assert b.first.position == b.position and not b.at_token["logprob"].equal
    assert b.first.klass == (KERNEL_PATH if b.first.inputs and all(i.equal for i in b.first.inputs) else UPSTREAM)
    assert (b.origin is not None) == (b.first.klass == UPSTREAM)
    assert b.logprob_abs_diff == abs(d.rollout - d.trainer) > 0


# (ablation, first point, why that op in that layer)
GEMM_POINTS = {"q_proj", "k_proj", "v_proj", "o_proj", "router_logits", "experts", "mlp", "logits"}
ABLATION_FINDINGS = [
    # The trainer attends from a left-padded buffer with an additive mask; the rollout is reference.
    ("reference-no-mask", "layers.0.attention"),
    # A GEMM's lone last row reduces K in two halves: the decode steps' one-row GEMMs, and any expert whose
    # row count is odd on one side only (then at a prompt row that attention carries to the scored one).
    ("reference-no-order", "a GEMM"),
    # The rollout merges 64-key blocks, the trainer 128-key blocks.
    ("reference-no-blocks", "layers.0.attention"),
    # The rollout rounds P to bf16 before P.V.
    ("reference-no-precision", "layers.0.attention"),
]


@pytest.mark.parametrize("name, point", ABLATION_FINDINGS)
def test_each_ablation_is_traced_to_the_op_it_changes(stack_cache, name, point):
    b = _bisect(stack_cache, name, **BREAKS_ON[name])
    if point == "a GEMM":
        cause = b.origin or b.first
        assert cause.klass == KERNEL_PATH and cause.point.split(".")[-1] in GEMM_POINTS
    else:
        cause = b.first
        assert (b.first.klass, b.origin, b.first.point) == (KERNEL_PATH, None, point)
    assert all(i.equal for i in cause.inputs) and cause.inputs
    prompt_len = b.position + 1 - b.divergence.pos
    if name == "reference-no-blocks":
        assert b.position >= 64  # a row that sees a second 64-key block
    if name == "reference-no-mask":
        assert prompt_len == 5  # the short sequence, the one the trainer left-pads


def test_the_reference_has_nothing_to_bisect(stack_cache):
    w = Workload(**BREAKS_ON["reference-no-order"])
    b = bisect(stack_cache("reference", w), w)
    assert b.divergence is None and b.first is None and b.comparison.verdict == "pass"


def test_baseline_prefill_is_traced_to_the_fused_sdpa_or_the_lm_head(stack_cache):
    """The short prompt's first response token already differs. Where is the CPU's choice: the fused SDPA over
    a different padding (layer 0's attention on; seen with AVX-512), else the lm_head GEMM on 2 rows, whose bits
    follow MKL's kernel for them (the AVX2-only EPYC's SDPA gives this row the same bits either way). Either
    way it is a kernel path whose inputs are equal."""
    b = _bisect(stack_cache, "baseline", batch_size=2, prompt_lens=(20, 30), max_new_tokens=4, stagger=0)
    assert b.divergence.seq == 0 and b.divergence.pos <= 1
    assert b.first.point in ("layers.0.attention", "logits") and b.first.klass == KERNEL_PATH
    assert all(i.equal for i in b.first.inputs) and b.first.inputs


def test_baseline_alone_is_traced_to_an_unpadded_gemm(stack_cache):
    """One 20-token request: the baseline's GEMMs run torch's kernels at whatever row count they get, and
    those counts differ between the rollout (20 prompt tokens, then 1-token decode steps) and the trainer
    (24 tokens). Torch's GEMMs are not row-invariant, so the difference comes in at a GEMM whose inputs
    are equal: at the scored row, or at an earlier row whose difference attention carries forward. Which
    GEMM depends on the CPU's kernels (an expert GEMM here with AMX, the lm_head elsewhere); on an AVX2-only
    EPYC the fused SDPA over the trainer's 24 rows already reduces differently from the rollout's attention."""
    b = _bisect(stack_cache, "baseline", batch_size=1, prompt_lens=(20,), max_new_tokens=4)
    cause = b.origin or b.first
    assert cause.klass == KERNEL_PATH and cause.point.split(".")[-1] in GEMM_POINTS | {"attention"}
    assert all(i.equal for i in cause.inputs) and cause.inputs
    assert b.position == 19 + b.divergence.pos


HF_WORKLOAD = dict(batch_size=2, prompt_lens=(20, 30), max_new_tokens=8, stagger=0)


def test_hf_fp32_differs_in_a_layer_0_kernel(stack_cache):
    """generate left-pads the 20-token prompt to 30; the trainer right-pads: sdpa and GEMMs over other
    shapes. Which op differs first is the CPU's choice (sdpa with AVX2 MKL, the q GEMM elsewhere); either
    way its inputs are equal and its output is not."""
    b = _bisect(stack_cache, "hf", **HF_WORKLOAD)
    assert b.divergence.seq == 0 and b.position == 19 + b.divergence.pos
    assert b.first.klass == KERNEL_PATH and b.first.point in ("layers.0.attention", "layers.0.q_proj")
    if b.first.point == "layers.0.attention":
        assert {i.name for i in b.first.inputs} == {"positions", "layers.0.q_norm", "layers.0.k_norm", "layers.0.v_proj"}


def test_hf_bf16_shows_upstream_in_layer_1_from_layer_0_attention_at_an_earlier_prompt_row(stack_cache):
    """In bf16 layer 0's attention rounds to the same bits at the scored row, but not at an earlier prompt row
    (9 with AVX-512, 16 on an AVX2-only EPYC): layer 1 then attends to keys that already differ (upstream), and
    bisect names where they came in."""
    b = _bisect(stack_cache, "hf", dtype="bf16", **HF_WORKLOAD)
    assert (b.divergence.seq, b.position) == (0, 19)
    assert (b.first.point, b.first.klass) == ("layers.1.attention", UPSTREAM)
    keys = next(i for i in b.first.inputs if i.name == "layers.1.k_norm")
    assert keys.scope == "context" and keys.differing_positions and max(keys.differing_positions) < 19
    assert (b.origin.point, b.origin.klass) == ("layers.0.attention", KERNEL_PATH)
    assert b.origin.position == min(keys.differing_positions) < 19


class LeftPaddedTrainer(HFStack):
    """A framework bug, not a kernel: the trainer left-pads and passes no position_ids, so transformers
    counts the padding too and every row of a shorter sequence gets a shifted RoPE position."""

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None):
        width = max(len(s) for s in sequences)
        pads = [width - len(s) for s in sequences]
        ids = torch.tensor([[0] * pad + list(s) for s, pad in zip(sequences, pads)])
        mask = (torch.arange(width)[None, :] >= torch.tensor(pads)[:, None]).long()
        with capture_hooks(self.model, capture, list(range(len(sequences)))):
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        out = [F.log_softmax(logits[i, pad + first - 1 : -1].float(), dim=-1).gather(1, ids[i, pad + first :, None]).squeeze(1)
               for i, (pad, first) in enumerate(zip(pads, score_from))]
        capture_logprobs(capture, list(range(len(sequences))), [first - 1 for first in score_from], out)
        return out


def test_a_framework_bug_is_classed_upstream(stack_cache):
    w = Workload(batch_size=2, prompt_lens=(20, 30), max_new_tokens=4, stagger=2)
    b = bisect(LeftPaddedTrainer(w.spec, w.torch_dtype, w.max_model_len), w)
    _check_consistent(b)
    assert b.divergence.seq == 0
    assert (b.first.point, b.first.klass, b.first.inputs) == ("positions", UPSTREAM, [])
    assert b.first.diff.rollout == b.position and b.first.diff.trainer == b.position + 10
    assert (b.origin.point, b.origin.position) == ("positions", 0)


def test_rows_kept_in_an_engines_process_replay_as_if_captured_here():
    """What vLLM's worker does (logdiff.bisect.hooks.RowFilter: one request's rows, shipped back, replayed) leaves a
    bisect Recorder holding exactly what hooking the model in this process gives it."""
    from logdiff.bisect.capture import Recorder, replay
    from logdiff.bisect.hooks import RowFilter

    w = Workload(batch_size=2, prompt_lens=(9, 14), max_new_tokens=3)
    stack = HFStack(w.spec, w.torch_dtype, w.max_model_len)
    outputs = stack.rollout(w.requests())
    sequences = [list(r.prompt) + o.tokens for r, o in zip(w.requests(), outputs)]
    here, kept = Recorder(request=1, upto=15), RowFilter(request=1, upto=15)
    for capture in (here, kept):
        stack.trainer_logprobs(sequences, [len(r.prompt) for r in w.requests()], [0.0, 0.0], capture=capture)
    shipped = Recorder(request=1, upto=15)
    replay(shipped, kept.result())
    assert set(shipped.rows) == set(here.rows) and len(here.rows["tokens"]) == 16
    assert sorted(here.rows["logprob"]) == [13, 14, 15]
    for name, rows in here.rows.items():
        assert rows.keys() == shipped.rows[name].keys() and all(torch.equal(rows[p], shipped.rows[name][p]) for p in rows), name


def test_a_module_shared_by_layers_is_refused_not_recorded_twice():
    from logdiff.bisect.hooks import RowFilter

    kept = RowFilter(request=None, upto=None)
    kept.locate(torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([1]))
    kept("layers.0.rope_q", torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="reported twice in one forward"):
        kept("layers.0.rope_q", torch.ones(2, 4))
