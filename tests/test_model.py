"""The model is the real Qwen3 architecture: transformers, given the same config and weights, computes
the same logits (to fp32 rounding) and the same greedy tokens; checkpoints round-trip both ways."""

import pytest
import torch
import transformers

from logdiff.api import Request
from logdiff.baselines.hf import build_hf_model
from logdiff.batch import SeqBatch
from logdiff.engine import RolloutEngine
from logdiff.kernels import reference_kernels
from logdiff.weights import ModelSpec, save_checkpoint

MODELS = ["qwen3-moe-tiny", "qwen3-dense-tiny"]


def our_logits(model, tokens):
    ops = reference_kernels()
    seqs = SeqBatch.from_lengths([tokens.shape[1]] * tokens.shape[0])
    hidden = model.hidden_states(tokens.flatten(), seqs, ops, lambda layer, q, k, v: ops.train_attention(q, k, v, seqs))
    return model.logits(hidden, ops).view(*tokens.shape, -1)


@pytest.mark.parametrize("name", MODELS)
def test_fp32_logits_match_transformers(name):
    spec = ModelSpec(name)
    tokens = torch.randint(spec.config().vocab_size, (2, 150), generator=torch.Generator().manual_seed(1))
    ours = our_logits(spec.build(torch.float32), tokens)
    theirs = build_hf_model(spec, torch.float32, "eager")(input_ids=tokens).logits
    assert ours.abs().max() > 1.0, "random logits should be far from uniform"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_match_transformers_generate(name):
    spec = ModelSpec(name)
    prompt = torch.randint(spec.config().vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    hf = build_hf_model(spec, torch.float32, "eager")
    expected = hf.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)[0, 20:]
    engine = RolloutEngine(spec.build(torch.float32), reference_kernels())
    out = engine.generate([Request(tuple(prompt[0].tolist()), max_new_tokens=24)])[0]
    assert out.tokens == expected.tolist()


@pytest.mark.parametrize("name", MODELS)
def test_checkpoint_round_trips_through_transformers(tmp_path, name):
    spec = ModelSpec(name, seed=3)
    model = spec.build(torch.float32)
    save_checkpoint(model, tmp_path)
    loaded = ModelSpec(str(tmp_path)).build(torch.float32)
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    hf_state = hf.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, hf_state[key]), key
    assert ModelSpec(str(tmp_path)).config().replace(name=name) == spec.config()
