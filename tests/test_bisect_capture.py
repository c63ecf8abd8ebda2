"""The capture plumbing bisect stands on: every point, in forward order; rows mapped to the right
(request, position) through prefill chunks, decode steps, continuous batching and left padding; and
capture that changes no bit of what a stack computes."""

import pytest
import torch

from logdiff.api import TrainerInputs
from logdiff.bisect.capture import SHARDED_POINTS, Recorder, assemble, captured_inputs, point_names, rank_part
from logdiff.bisect.locate import diff_rows
from logdiff.config import NAMED_CONFIGS
from logdiff.runner import engine_options
from logdiff.workload import Workload

# Mixed prompt lengths in one batch (left padding in transformers), a late joiner, chunked prefill.
CHUNKED = dict(batch_size=3, prompt_lens=(5, 30, 17), max_new_tokens=4, stagger=1, prefill_chunk=8)
PADDED = dict(batch_size=3, prompt_lens=(5, 30, 17), max_new_tokens=4, stagger=0)


class Names:
    """A plain capture callable: it never learns rows, and the stacks must still run with it."""

    def __init__(self):
        self.names = []

    def __call__(self, name, tensor):
        self.names.append(name)


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "qwen3-dense-tiny"])
def test_the_trainer_reports_every_point_in_forward_order(stack_cache, model):
    w = Workload(model=model, batch_size=2, prompt_lens=(3, 6), max_new_tokens=2)
    stack = stack_cache("reference", w)
    names = Names()
    stack.trainer_logprobs([[1, 2, 3, 4], [5, 6, 7]], [1, 2], [0.0, 0.0], capture=names)
    config = NAMED_CONFIGS[model]
    unused = {"mlp"} if config.is_moe else {"router_logits", "topk_ids", "topk_weights", "experts", "combine"}
    expected = [n for n in point_names(config.num_hidden_layers) if n.split(".")[-1] not in unused]
    assert names.names == expected


def _replay(stack, w, request, upto):
    rollout, trainer = Recorder(request, upto), Recorder(request, upto)
    outputs = stack.rollout(w.requests(), engine_options(w), capture=rollout)
    scored = TrainerInputs.after(w.requests(), outputs)
    stack.trainer_logprobs(scored.sequences, scored.score_from, scored.temperatures, capture=trainer)
    return rollout, trainer, scored.sequences


# reference: the 30-token prompt, prefilled in 4 chunks; hf: the 5-token prompt, left-padded to 30
@pytest.mark.parametrize("name, fields, request_index", [("reference", CHUNKED, 1), ("hf", PADDED, 0)])
def test_rows_land_at_their_request_and_position(stack_cache, name, fields, request_index):
    w = Workload(**fields)
    stack = stack_cache(name, w)
    prompt_len = w.prompt_lens[request_index]
    upto = prompt_len + w.max_new_tokens - 2  # the row that scores the last response token
    rollout, trainer, sequences = _replay(stack, w, request_index, upto)
    for rec in (rollout, trainer):
        assert sorted(rec.rows["tokens"]) == list(range(upto + 1))
        assert [int(rec.rows["tokens"][p]) for p in range(upto + 1)] == sequences[request_index][: upto + 1]
        assert [int(rec.rows["positions"][p]) for p in range(upto + 1)] == list(range(upto + 1))
        # log-probs exist for the rows that score a response token: the last prompt row onwards
        assert sorted(rec.rows["logprob"]) == list(range(prompt_len - 1, upto + 1))


def test_on_the_aligned_reference_every_captured_row_is_bitwise_equal(stack_cache):
    """A row mapped to the wrong (request, position) would differ; so would a capture that perturbs."""
    w = Workload(**CHUNKED)
    rollout, trainer, _ = _replay(stack_cache("reference", w), w, request=1, upto=30 + w.max_new_tokens - 2)
    assert set(rollout.rows) == set(trainer.rows) == set(point_names(2)) - {"layers.0.mlp", "layers.1.mlp"}
    for name, rows in rollout.rows.items():
        assert rows.keys() == trainer.rows[name].keys()
        assert all(diff_rows(rows[p], trainer.rows[name][p]).equal for p in rows), name


@pytest.mark.parametrize("name, fields", [("reference", CHUNKED), ("baseline", CHUNKED), ("hf", PADDED)])
def test_capture_changes_no_bit(stack_cache, name, fields):
    w = Workload(**fields)
    stack = stack_cache(name, w)
    plain = stack.rollout(w.requests(), engine_options(w))
    captured = stack.rollout(w.requests(), engine_options(w), capture=Recorder(2, 100))
    scored = TrainerInputs.after(w.requests(), plain)
    seqs, score_from, temps = scored.sequences, scored.score_from, scored.temperatures
    for a, b in zip(plain, captured):
        assert a.tokens == b.tokens and torch.equal(a.logprobs.view(torch.int32), b.logprobs.view(torch.int32))
    for a, b in zip(stack.trainer_logprobs(seqs, score_from, temps),
                    stack.trainer_logprobs(seqs, score_from, temps, capture=Recorder(2, 100))):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_plain_callable_capture_sees_the_engine_forward():
    from logdiff import stacks

    w = Workload(batch_size=2, prompt_lens=(3, 4), max_new_tokens=2)
    stack = stacks.build("reference", w.spec, w.torch_dtype, w.max_model_len)
    names = Names()
    stack.rollout(w.requests(), capture=names)
    assert names.names[:3] == ["tokens", "positions", "embedding"]
    assert names.names.count("tokens") == names.names.count("logprob") == 4  # 2 prefills, 2 decode steps


def test_transformers_lacks_rope_and_per_expert_points_so_attention_is_checked_on_their_inputs():
    config = NAMED_CONFIGS["qwen3-moe-tiny"]
    captured = set(point_names(2)) - {f"layers.{i}.{p}" for i in range(2) for p in ("rope_q", "rope_k", "experts", "mlp")}
    assert captured_inputs("layers.1.attention", captured, config) == [
        ("positions", "context"), ("layers.1.v_proj", "context"), ("layers.1.q_norm", "token"), ("layers.1.k_norm", "context"),
    ]
    assert captured_inputs("layers.0.combine", captured, config) == [
        ("layers.0.post_attention_norm", "token"), ("layers.0.topk_ids", "token"), ("layers.0.topk_weights", "token"),
    ]
    assert captured_inputs("layers.1.input_norm", captured, config) == [("layers.0.output", "token")]
    assert captured_inputs("positions", captured, config) == []


def test_recorder_refuses_rows_it_cannot_place():
    rec = Recorder(request=0, upto=3)
    with pytest.raises(RuntimeError, match="before any locate"):
        rec("embedding", torch.zeros(2, 4))
    rec.locate(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), head=torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="3 were located"):
        rec("embedding", torch.zeros(2, 4))
    rec("embedding", torch.arange(3.0)[:, None])
    rec("logits", torch.tensor([[7.0], [8.0]]))
    assert rec.rows["embedding"].keys() == {0, 1} and float(rec.rows["logits"][1]) == 7.0
    with pytest.raises(RuntimeError, match="captured twice"):
        rec("embedding", torch.zeros(3, 1))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_part_is_what_the_rank_holds_and_the_parts_make_the_whole(tp):
    """qwen3-dense-tiny: 4 query heads and 2 KV heads, so at TP4 two ranks share each KV head."""
    config = NAMED_CONFIGS["qwen3-dense-tiny"]
    d = config.head_dim
    rows = {"layers.0.q_proj": torch.arange(4 * d), "layers.0.rope_k": torch.arange(2 * d).view(2, d),
            "logits": torch.arange(config.vocab_size), "layers.0.o_proj": torch.arange(config.hidden_size)}
    for name, whole in rows.items():
        parts = [rank_part(whole, name, config, rank, tp) for rank in range(tp)]
        assert torch.equal(assemble(parts, name, config, tp), whole), name
        if name.split(".")[-1] not in SHARDED_POINTS:
            assert all(p is whole for p in parts)
    kv = [rank_part(rows["layers.0.rope_k"], "layers.0.rope_k", config, rank, tp) for rank in range(tp)]
    assert [int(p[0, 0]) // d for p in kv] == ([0, 1] if tp == 2 else [0, 0, 1, 1])
