"""Loading weights at scale: `--layers` cuts, sharded checkpoints with their index, memory-mapped tensors that never
write back, one copy of the weights shared by the builds of a spec, and instances that share weight bytes but
not state."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from logdiff.api import EngineOptions, Request
from logdiff.errors import UserError
from logdiff.kernels import reference_kernels
from logdiff.kernels.gemm import tier_for
from logdiff.stacks import KernelStack, StackCache
from logdiff.weights import ModelSpec, own_weights, save_checkpoint

MODEL = "qwen3-moe-tiny"


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def file_digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(ModelSpec(MODEL).build(torch.bfloat16), path)
    return path


def shard(checkpoint, into):
    """`checkpoint` re-saved as two shards and the index published checkpoints carry."""
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        file = f"model-0000{i}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(into / file))
        weight_map |= dict.fromkeys(part, file)
    (into / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (into / "config.json").write_text((checkpoint / "config.json").read_text())
    return into


def test_layers_keeps_the_first_n_decoder_layers_of_a_checkpoint(checkpoint):
    full = ModelSpec(str(checkpoint)).build(torch.bfloat16).state_dict()
    cut = ModelSpec(str(checkpoint), layers=1).build(torch.bfloat16)
    assert cut.config.num_hidden_layers == 1 and cut.config.name.endswith("-1l")
    for name, tensor in cut.state_dict().items():
        assert torch.equal(tensor, full[name]), name  # embeddings, layer 0, final norm and lm_head as stored
    assert not any(name.startswith("model.layers.1.") for name in cut.state_dict())


def test_layers_of_a_named_config_are_the_full_models_first_layers():
    full = ModelSpec(MODEL).build(torch.float32).state_dict()
    cut = ModelSpec(MODEL, layers=1).build(torch.float32).state_dict()
    assert all(torch.equal(cut[name], full[name]) for name in cut if name.startswith("model.layers.0."))


@pytest.mark.parametrize("layers", [0, -1, 3])
def test_a_depth_outside_the_model_is_one_line(layers):
    with pytest.raises(UserError, match=rf"--layers {layers} is outside 1..2"):
        ModelSpec(MODEL, layers=layers).config()


def test_a_sharded_checkpoint_loads_the_same_bits_as_one_file(checkpoint, tmp_path):
    one = ModelSpec(str(checkpoint)).build(torch.bfloat16).state_dict()
    sharded = ModelSpec(str(shard(checkpoint, tmp_path))).build(torch.bfloat16).state_dict()
    assert one.keys() == sharded.keys() and all(torch.equal(one[k], sharded[k]) for k in one)


def test_a_missing_shard_is_named(checkpoint, tmp_path):
    (shard(checkpoint, tmp_path) / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match="lacks shard model-00002-of-00002.safetensors that its index names"):
        ModelSpec(str(tmp_path)).build(torch.bfloat16)


def test_writing_a_loaded_weight_never_reaches_the_file(checkpoint):
    before = file_digest(checkpoint / "model.safetensors")
    model = ModelSpec(str(checkpoint)).build(torch.bfloat16)
    for param in model.parameters():
        param.data.add_(1)  # the mapping is private: pages are copied on write
    assert file_digest(checkpoint / "model.safetensors") == before


def test_builds_of_one_spec_share_weights_until_one_owns_them():
    spec = ModelSpec(MODEL, seed=7)
    a, b = spec.build(torch.float32), spec.build(torch.float32)
    assert all(pa.data_ptr() == pb.data_ptr() for pa, pb in zip(a.parameters(), b.parameters()))
    untouched = state(b)
    own_weights(a)
    for param in a.parameters():
        param.data.add_(1)
    assert all(torch.equal(t, untouched[k]) for k, t in b.state_dict().items())
    assert all(pa.data_ptr() != pb.data_ptr() for pa, pb in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("stack", ["reference", "hf"])
def test_a_trainer_that_updates_its_weights_gets_its_own_copy(stack):
    spec = ModelSpec(MODEL, seed=8)
    trainer_side = StackCache().get(stack, spec, torch.float32, 64)
    other = KernelStack(spec, torch.float32, 64, reference_kernels())
    untouched = state(other.model)
    for param in trainer_side.trainer_parameters().values():
        param.data.mul_(0.5)
    trainer_side.sync_weights()
    assert all(torch.equal(t, untouched[k]) for k, t in other.model.state_dict().items())
    assert all(torch.equal(t, untouched[k]) for k, t in other.engine_model.state_dict().items())


def test_instances_share_weight_bytes_but_not_state():
    """The trainer's log-probs are the same bits whether or not a rollout ran on the instance beside it, and the
    only storages the two sides have in common are the spec's read-only tensors."""
    spec, dtype = ModelSpec(MODEL, seed=9), torch.float32
    requests = [Request(prompt=tuple(range(5, 40)), max_new_tokens=6, seed=1)]
    cache = StackCache()
    rollout_side = cache.get("reference", spec, dtype, 64)
    outputs = rollout_side.rollout(requests, EngineOptions())
    sequences = [[*r.prompt, *o.tokens] for r, o in zip(requests, outputs)]
    fresh = KernelStack(spec, dtype, 64, reference_kernels())
    alone = fresh.trainer_logprobs(sequences, [35], [0.0])
    after_rollout = rollout_side.trainer_logprobs(sequences, [35], [0.0])
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(alone, after_rollout))

    def storages(module):
        return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}

    weights = {p.untyped_storage().data_ptr() for p in spec.build(dtype, rollout_side.ops.inference_weight).parameters()}
    buffers = {b.untyped_storage().data_ptr() for b in rollout_side.model.buffers()}
    assert storages(rollout_side.model) & storages(rollout_side.engine_model) <= weights | buffers


def test_the_reference_its_engine_and_the_oracle_hold_one_copy_of_each_gemm_weight():
    """Memory near the checkpoint by construction: the engine reads the trainer's tensors (already in the GEMM's
    layout) and the oracle shares them, while the baseline keeps its own layout for its library's sake."""
    from logdiff.oracle import Oracle

    spec, dtype = ModelSpec(MODEL, seed=10), torch.bfloat16
    reference = KernelStack(spec, dtype, 64, reference_kernels())
    oracle = Oracle(spec, dtype)
    ptrs = [{name: p.data_ptr() for name, p in m.named_parameters()} for m in (reference.model, reference.engine_model,
                                                                                   oracle.model)]
    assert ptrs[0] == ptrs[1] == ptrs[2]
    gemm = reference.model.model.layers[0].self_attn.q_proj.weight
    assert gemm.mT.is_contiguous() == (tier_for(dtype, dtype) != "amx-bf16")  # K-major on an FMA tier, as stored on AMX
