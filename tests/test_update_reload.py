"""C14 (update and reload) and its negative controls: a stale weight sync, a sync through a lower dtype."""

import pytest
from test_fidelity_controls import cheats_importable  # noqa: F401 (a fixture)

from logdiff.api import Stack, Unsupported
from logdiff.conformance import test_c14_update_and_reload as c14
from logdiff.conformance.bitwise import Bitwise, PropertyViolation
from logdiff.conformance.plugin import MAX_MODEL_LEN
from logdiff.kernels import reference_kernels
from logdiff.stacks import KernelStack, resolve


def fixtures(name):
    def own_for(w):
        return resolve(name)(w.spec, w.torch_dtype, MAX_MODEL_LEN)

    return {"own_for": own_for, "bitwise": Bitwise()}


@pytest.mark.parametrize("test", [c14.test_c14_rollout_matches_trainer_after_an_update,
                                  c14.test_c14_a_step_at_learning_rate_0_changes_no_bit])
def test_c14_holds_for_the_reference(test):
    test(**fixtures("reference"), workload="dense")


def test_c14_a_checkpoint_round_trip_holds_for_the_reference(tmp_path):
    c14.test_c14_a_reloaded_checkpoint_gives_the_same_bits(**fixtures("reference"), workload="dense", tmp_path=tmp_path)


@pytest.mark.parametrize("cheat, test, names", [
    ("cheats:stale_sync", c14.test_c14_rollout_matches_trainer_after_an_update,
     "first: rollout after the update and its sync, second: trainer after it)\nbefore any update: 24/24 log-probs bitwise equal"),
    ("cheats:lossy_sync", c14.test_c14_rollout_matches_trainer_after_an_update,
     "first: rollout after the update and its sync"),
    ("cheats:lossy_sync", c14.test_c14_a_step_at_learning_rate_0_changes_no_bit,
     "first: rollout before, second: after a step at lr 0"),
])
def test_c14_catches_a_broken_weight_sync(cheats_importable, cheat, test, names):  # noqa: F811
    with pytest.raises(PropertyViolation) as failed:
        test(**fixtures(cheat), workload="dense")
    assert names in str(failed.value) and "logprobs differ at seq" in str(failed.value)


@pytest.mark.parametrize("test", [c14.test_c14_rollout_matches_trainer_after_an_update,
                                  c14.test_c14_a_step_at_learning_rate_0_changes_no_bit])
def test_c14_a_pair_syncs_through_the_engines_load_weights(test):
    """Two instances, one the engine and one the trainer: the update reaches the engine only through load_weights."""
    test(**fixtures("reference+reference"), workload="dense")


def test_c14_a_pair_of_other_stacks_keeps_its_bits_at_learning_rate_0():
    c14.test_c14_a_step_at_learning_rate_0_changes_no_bit(**fixtures("hf+reference"), workload="block-edges-sampled")


class FrozenEngine(KernelStack):
    def load_weights(self, weights):
        Stack.load_weights(self, weights)


def frozen_engine(spec, dtype, max_model_len):
    return FrozenEngine(spec, dtype, max_model_len, reference_kernels(name="frozen-engine"))


def test_c14_skips_a_pair_whose_engine_cannot_take_new_weights():
    with pytest.raises(Unsupported, match="frozen-engine's rollout engine cannot take new weights in place"):
        c14.test_c14_a_step_at_learning_rate_0_changes_no_bit(**fixtures("test_update_reload:frozen_engine+reference"),
                                                              workload="dense")
