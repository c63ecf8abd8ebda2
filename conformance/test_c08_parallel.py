"""C8: parallel invariance. The log-probs do not depend on how many ranks the model is sharded over:
TP 1, 2 and 4 and EP 1 and 2 give the same bits on each path, and a rollout at one degree equals a
trainer at another (as in an RL job whose trainer and rollout engine are sharded differently). The
ranks are torch.distributed processes (gloo on CPU); a stack declares the degrees it runs at in
`parallel_degrees` and is skipped, with the reason, at any other."""

import pytest

from logdiff.api import Stack, Unsupported
from logdiff.workload import Workload

from .runs import assert_rollout_matches_trainer, rollout_and_sequences

MODELS = {"dense": "qwen3-dense-tiny", "moe": "qwen3-moe-tiny"}


def workload(model: str, dtype: str) -> Workload:
    return Workload(model=MODELS[model], dtype=dtype, batch_size=3, prompt_lens=(7, 33, 129), max_new_tokens=4, stagger=1)


def sharded(stack: Stack, trainer_tp: int = 1, rollout_tp: int = 1, ep: int = 1) -> Stack:
    """The stack at these degrees (itself at degree 1 everywhere); Unsupported when it does not declare them."""
    if trainer_tp == rollout_tp == ep == 1:
        return stack
    degrees = getattr(stack, "parallel_degrees", Stack.parallel_degrees)
    for kind, degree in (("tp", trainer_tp), ("tp", rollout_tp), ("ep", ep)):
        if degree not in degrees.get(kind, (1,)):
            raise Unsupported(f"stack {stack.name} declares {kind} degrees {degrees.get(kind, (1,))}, not {degree}")
    return stack.parallel(trainer_tp=trainer_tp, rollout_tp=rollout_tp, ep=ep)


def assert_degree_invariant(stack: Stack, w: Workload, bitwise, layouts: list[dict]) -> None:
    """Rollout and trainer log-probs at each layout equal those of the first, bit for bit."""
    __tracebackhide__ = True
    # Every layout first: a stack that declines one declines before running any (an engine start can cost 20 s).
    first, *others = [sharded(stack, **layout) for layout in layouts]
    outputs, sequences, score_from, temperatures = rollout_and_sequences(first, w)
    trainer = first.trainer_logprobs(sequences, score_from, temperatures)
    name = _name(layouts[0])
    for layout, other in zip(layouts[1:], others):
        bitwise.rollouts(outputs, rollout_and_sequences(other, w)[0], (f"rollout {name}", f"rollout {_name(layout)}"))
        bitwise.logprobs(trainer, other.trainer_logprobs(sequences, score_from, temperatures),
                         (f"trainer {name}", f"trainer {_name(layout)}"))


def _name(layout: dict) -> str:
    tp = layout.get("trainer_tp", 1)
    return f"TP{tp}" + (f" EP{layout['ep']}" if layout.get("ep", 1) > 1 else "")


CHECKS = ["tp-1-2-4", "ep-1-2", "trainer-tp1-rollout-tp2", "rollout-vs-trainer-tp2"]
# The degrees a failure of each check shows at first: a path against itself at TP1 / EP1 (--path), or
# the rollout against the trainer at their degrees.
REPRODUCE_AT = {
    "tp-1-2-4": ("--tp 2", "--path rollout"),
    "ep-1-2": ("--ep 2", "--path rollout"),
    "trainer-tp1-rollout-tp2": ("--trainer-tp 1 --rollout-tp 2",),
    "rollout-vs-trainer-tp2": ("--tp 2",),
}
CASES = [(check, model) for check in CHECKS for model in MODELS if not (check == "ep-1-2" and model == "dense")]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("check, model", CASES)
def test_c8_parallel_invariance(stack_for, trainer_for, bitwise, parallel_options, check, model, dtype):
    w = workload(model, dtype)
    stack = stack_for(w)
    parallel_options(*REPRODUCE_AT[check])
    if check == "tp-1-2-4":
        assert_degree_invariant(stack, w, bitwise, [dict(trainer_tp=d, rollout_tp=d) for d in (1, 2, 4)])
    elif check == "ep-1-2":
        assert_degree_invariant(stack, w, bitwise, [dict(ep=1), dict(ep=2), dict(trainer_tp=2, rollout_tp=2, ep=2)])
    else:
        trainer_tp = 1 if check == "trainer-tp1-rollout-tp2" else 2
        layout = dict(trainer_tp=trainer_tp, rollout_tp=2)
        assert_rollout_matches_trainer(sharded(stack, **layout), sharded(trainer_for(w), **layout), w, bitwise)
