"""verl 0.9.1's actor as a logdiff trainer (logdiff.baselines.verl), on the tiny Qwen3 MoE and dense models in fp32.

The sequences are a real rollout of logdiff's reference engine: logdiff run's prompt lengths (1 to 300 tokens),
responses of different lengths (1 to 32 tokens: verl's right-padded responses are ragged) at temperatures 0, 0.7,
1 and 1.5 (per-sample temperatures in verl). Checked:

- (a) C0: verl's log-probs are within fp32's bounds of the fp64 oracle of the same weights (asserted);
- (b) against logdiff's reference trainer: close (asserted, at twice fp32's max bound where no routing tie is
  near), bitwise-equal count recorded only (different kernels);
- (c) C13 as verl exposes it: micro-batch sizes 1, 2, 4 (6 sequences: 4 + 2) and all, use_remove_padding on
  (packed) and off (right-padded), use_dynamic_bsz with token budgets, entropy on and off, and the same call twice,
  each against verl's default (packed, one micro-batch). Only shapes and finiteness are asserted: whether verl's
  recompute is invariant is what is measured (bitwise-equal tokens and sequences, max |diff|, the first differing
  (sequence, position) with both values' bits), written to results/<machine>/verl/trainer.json by `nox -s verl`
  and printed at the end of the run.
"""

from __future__ import annotations

import pytest
import torch

from logdiff import stacks
from logdiff.api import Request, TrainerInputs, TrainerLayout, Unsupported
from logdiff.baselines.verl import VerlTrainer, verl_trainer
from logdiff.oracle import FIDELITY_BOUNDS, ROUTING_TIE, Oracle, fidelity
from logdiff.weights import ModelSpec

MODELS = ("qwen3-moe-tiny", "qwen3-dense-tiny")
DTYPE = torch.float32
PROMPT_LENS = (1, 127, 128, 129, 17, 300)  # logdiff run's defaults
NEW_TOKENS = (32, 9, 20, 32, 1, 14)  # ragged responses
TEMPERATURES = (0.0, 0.7, 1.0, 1.5, 0.0, 0.7)
MAX_MODEL_LEN = 384
WORKLOAD = {"models": list(MODELS), "dtype": "fp32", "prompt_lens": list(PROMPT_LENS), "new_tokens": list(NEW_TOKENS),
            "temperatures": list(TEMPERATURES), "rollout": "reference", "seed": 0}

BASELINE = "packed"  # verl's default: use_remove_padding, one micro-batch
LAYOUTS = {
    "packed": TrainerLayout(),
    "packed-mb1": TrainerLayout(micro_batch=1),
    "packed-mb2": TrainerLayout(micro_batch=2),
    "packed-mb4": TrainerLayout(micro_batch=4),
    "packed-dyn350": TrainerLayout(token_budget=350),  # the longest sequence has 332 tokens, all 810
    "packed-dyn512": TrainerLayout(token_budget=512),
    "padded": TrainerLayout(padding="right"),
    "padded-mb1": TrainerLayout(padding="right", micro_batch=1),
    "padded-mb2": TrainerLayout(padding="right", micro_batch=2),
    "padded-mb4": TrainerLayout(padding="right", micro_batch=4),
    "padded-dyn350": TrainerLayout(padding="right", token_budget=350),
    "padded-dyn512": TrainerLayout(padding="right", token_budget=512),
}


@pytest.fixture(scope="module")
def setup():
    """Per model: the rollout's trainer inputs, verl's trainer, verl's default-layout log-probs, the oracle's scores."""
    done = {}

    def get(model: str, dtype: torch.dtype = DTYPE) -> dict:
        if (model, dtype) not in done:
            spec = ModelSpec(model)
            vocab = spec.config().vocab_size
            requests = []
            for i, (length, new, temp) in enumerate(zip(PROMPT_LENS, NEW_TOKENS, TEMPERATURES)):
                gen = torch.Generator().manual_seed(i)
                requests.append(Request(tuple(torch.randint(vocab, (length,), generator=gen).tolist()), new, temp,
                                        seed=1000 + i, arrival=2 * i))
            reference = stacks.build("reference", spec, dtype, MAX_MODEL_LEN)
            inputs = TrainerInputs.after(requests, reference.rollout(requests))
            trainer = verl_trainer(spec, dtype, MAX_MODEL_LEN)
            done[model, dtype] = {
                "spec": spec, "inputs": inputs, "reference": reference, "trainer": trainer,
                "verl": trainer.trainer_logprobs(inputs.sequences, inputs.score_from, inputs.temperatures),
                "oracle": Oracle(spec, dtype).score(inputs.sequences, inputs.score_from, inputs.temperatures),
            }
        return done[model, dtype]

    return get


@pytest.fixture
def records(trainer_findings):
    if not any(r["check"] == "workload" for r in trainer_findings):
        trainer_findings.append({"check": "workload", **WORKLOAD})
    return trainer_findings


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def hex_bits(value: torch.Tensor) -> str:
    return f"0x{int(bits(value.reshape(1))[0]) & 0xFFFFFFFF:08x}"


def compare(base: list[torch.Tensor], got: list[torch.Tensor], score_from: list[int]) -> dict:
    """Bitwise figures of `got` against `base`, per token and per sequence, and where they first differ."""
    equal = [bits(a) == bits(b) for a, b in zip(base, got)]
    first = None
    for s, eq in enumerate(equal):
        if not eq.all():
            p = int((~eq).nonzero()[0])
            first = {"seq": s, "pos": p, "token_index": score_from[s] + p,
                     "baseline": {"value": float(base[s][p]), "bits": hex_bits(base[s][p])},
                     "this": {"value": float(got[s][p]), "bits": hex_bits(got[s][p])}}
            break
    diff = torch.cat([(a.double() - b.double()).abs() for a, b in zip(base, got)])
    return {"tokens": int(diff.numel()), "bitwise_equal_tokens": int(sum(int(e.sum()) for e in equal)),
            "bitwise_equal_sequences": sum(bool(e.all()) for e in equal), "sequences": len(equal),
            "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()), "first_difference": first}


def line(model: str, name: str, c: dict) -> str:
    first = c["first_difference"]
    where = ("bitwise identical" if first is None else
             f"first at seq {first['seq']} pos {first['pos']}: {first['baseline']['bits']} vs {first['this']['bits']}")
    return (f"{model:17} {name:27} {c['bitwise_equal_tokens']:4}/{c['tokens']} tokens, {c['bitwise_equal_sequences']}/"
            f"{c['sequences']} sequences equal, max |d| {c['max_abs_diff']:.3g}; {where}")


def assert_shapes(got: list[torch.Tensor], inputs: TrainerInputs) -> None:
    assert [tuple(t.shape) for t in got] == [(len(s) - f,) for s, f in zip(inputs.sequences, inputs.score_from)]
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in got)
    assert all(bool(torch.isfinite(t).all()) and bool((t <= 0).all()) for t in got)


@pytest.mark.parametrize("model", MODELS)
def test_verl_trainer_runs_the_model(setup, records, model):
    """(a): verl's recompute is near the fp64 oracle (C0's fp32 bounds); its entropies are finite and positive."""
    run = setup(model)
    assert_shapes(run["verl"], run["inputs"])
    entropy = run["trainer"].last_entropy
    assert entropy is not None and all(bool(torch.isfinite(e).all()) and bool((e >= 0).all()) for e in entropy)
    side = fidelity("trainer", run["verl"], run["oracle"], DTYPE)
    records.append({"check": "fidelity", "model": model, **side.to_dict(),
                    "summary": f"{model:17} {'verl vs fp64 oracle':27} max |d| {side.max_abs_error:.3g}, "
                               f"median {side.median_abs_error:.3g}: {side.problem() or 'within fp32 bounds'}"})
    assert side.holds, side.problem()


@pytest.mark.parametrize("model", MODELS)
def test_verl_trainer_near_reference_trainer(setup, records, model):
    """(b): verl against logdiff's reference trainer: close in fp32, bitwise-equal count recorded only."""
    run = setup(model)
    inputs = run["inputs"]
    reference = run["reference"].trainer_logprobs(inputs.sequences, inputs.score_from, inputs.temperatures)
    c = compare(reference, run["verl"], inputs.score_from)
    clear = torch.cat([m >= ROUTING_TIE[DTYPE] for m in run["oracle"].routing_margin])
    diff = torch.cat([(a.double() - b.double()).abs() for a, b in zip(reference, run["verl"])])
    c["max_abs_diff_clear_of_routing_ties"] = float(diff[clear].max()) if bool(clear.any()) else 0.0
    records.append({"check": "reference-trainer", "model": model, "baseline": "logdiff reference trainer",
                    "this": "verl packed, one micro-batch", **c, "summary": line(model, "verl vs reference trainer", c)})
    bound = 2 * FIDELITY_BOUNDS[DTYPE][2]  # each side within the max bound of the oracle
    assert c["max_abs_diff_clear_of_routing_ties"] <= bound, c


def forwards(trainer: VerlTrainer):
    """Counts verl's model forwards and their token shapes (a hook on the FSDP module)."""
    shapes: list[list[int]] = []
    handle = trainer.engine.module.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(list(kwargs["input_ids"].shape)), with_kwargs=True)
    return shapes, handle


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != BASELINE] + ["repeat", "entropy-off"])
def test_verl_layout_invariance_measured(setup, records, model, name):
    """(c): one of verl's layouts (or the same call again, or entropy off) against verl's default layout."""
    run = setup(model)
    inputs, trainer = run["inputs"], run["trainer"]
    if name == "entropy-off":
        trainer = verl_trainer(run["spec"], DTYPE, MAX_MODEL_LEN, entropy=False)
    layout = LAYOUTS.get(name, LAYOUTS[BASELINE])
    shapes, handle = forwards(trainer)
    try:
        got = trainer.trainer_logprobs(inputs.sequences, inputs.score_from, inputs.temperatures, layout=layout)
    finally:
        handle.remove()
    assert_shapes(got, inputs)
    c = compare(run["verl"], got, inputs.score_from)
    records.append({"check": "layout", "model": model, "name": name, "baseline": BASELINE, "layout": layout.__dict__,
                    "forwards_input_ids_shapes": shapes, **c, "summary": line(model, name, c)})
    # The knob reached verl (whether it changed the bits is the measurement above): packed forwards are one row of
    # tokens, padded ones a row per sequence; the number of micro-batches is verl's.
    n, total = len(inputs.sequences), sum(len(s) for s in inputs.sequences)
    if layout.padding == "packed":
        assert all(rows == 1 for rows, _ in shapes) and sum(width for _, width in shapes) == total
    else:
        assert sum(rows for rows, _ in shapes) == n
    if layout.token_budget is not None:  # verl's dynamic bsz: ceil(tokens / budget) micro-batches, at most one per sequence
        assert len(shapes) == min(n, -(-total // layout.token_budget))
    else:
        assert len(shapes) == -(-n // (layout.micro_batch or n))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_verl_trainer_low_precision_measured(setup, records, model, dtype):
    """Measured only: verl in bf16 and fp16 (verl's actor defaults: fp32 master weights, FSDP2 mixed precision and
    autocast in the run's dtype) against the fp64 oracle (C0's verdict recorded), logdiff's reference trainer, and
    its own micro-batch 1 and padded layouts. Without flash-attn verl scores with a log_softmax in the logits' dtype."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    run = setup(model, torch_dtype)
    inputs, trainer = run["inputs"], run["trainer"]
    args = inputs.sequences, inputs.score_from, inputs.temperatures
    assert_shapes(run["verl"], inputs)
    side = fidelity("trainer", run["verl"], run["oracle"], torch_dtype)
    records.append({"check": "fidelity", "model": model, "dtype": dtype, **side.to_dict(),
                    "summary": f"{model:17} {dtype + ' vs fp64 oracle':27} max |d| {side.max_abs_error:.3g}, "
                               f"median {side.median_abs_error:.3g}: {side.problem() or 'within bounds'}"})
    others = {"reference trainer": run["reference"].trainer_logprobs(*args),
              "packed-mb1": trainer.trainer_logprobs(*args, layout=LAYOUTS["packed-mb1"]),
              "padded": trainer.trainer_logprobs(*args, layout=LAYOUTS["padded"])}
    for name, got in others.items():
        assert_shapes(got, inputs)
        # verl's default layout against its other layouts; the reference trainer against verl, as in fp32
        base, this = (got, run["verl"]) if name == "reference trainer" else (run["verl"], got)
        c = compare(base, this, inputs.score_from)
        records.append({"check": "low-precision", "model": model, "dtype": dtype, "name": name,
                        "baseline": name if name == "reference trainer" else BASELINE,
                        "this": "verl packed, one micro-batch" if name == "reference trainer" else name, **c,
                        "summary": line(model, f"{dtype} {'verl vs ' + name if name == 'reference trainer' else name}", c)})


def test_verl_trainer_declines_what_verl_cannot_do(setup):
    run = setup(MODELS[0])
    inputs, trainer = run["inputs"], run["trainer"]
    args = inputs.sequences, inputs.score_from, inputs.temperatures
    for layout in (TrainerLayout(padding="left"), TrainerLayout(padding="right", extra_padding=3),
                   TrainerLayout(token_budget=64), TrainerLayout(micro_batch=2, token_budget=1024)):
        with pytest.raises(Unsupported):
            trainer.trainer_logprobs(*args, layout=layout)
    with pytest.raises(Unsupported, match="no_grad"):
        trainer.trainer_logprobs(*args, grad=True)
    with pytest.raises(Unsupported, match="trainer only"):
        trainer.rollout([])
    info = trainer.describe()
    assert info["versions"]["verl"] == "0.9.1" and info["verl"]["strategy"] == "fsdp2"


@pytest.mark.parametrize("model", MODELS)
def test_verl_capture_records_every_row_and_changes_no_bit(setup, model):
    """logdiff.bisect.hooks on the transformers model inside verl's FSDP2 engine: every point of every row of the
    packed forward at its (sequence, position), the log-probs unchanged by the hooks; a layout other than the one
    packed forward is declined for capture."""
    from logdiff.bisect.bundle import ROWS, WorkloadRecorder

    run = setup(model)
    inputs, trainer = run["inputs"], run["trainer"]
    recorder = WorkloadRecorder(len(inputs.sequences))
    got = trainer.trainer_logprobs(inputs.sequences, inputs.score_from, inputs.temperatures, capture=recorder)
    assert all(torch.equal(a, b) for a, b in zip(got, run["verl"]))
    tensors = recorder.tensors()
    rows = [[i, p] for i, s in enumerate(inputs.sequences) for p in range(len(s))]
    feed_forward = "combine" if model.startswith("qwen3-moe") else "mlp"
    for name in ("tokens", "positions", "embedding", "layers.0.attention", f"layers.1.{feed_forward}", "final_norm", "logits"):
        assert tensors[name + ROWS].tolist() == rows, name
    assert tensors["tokens"].tolist() == [t for s in inputs.sequences for t in s]
    assert torch.equal(tensors["logprob"], torch.cat(got))
    with pytest.raises(Unsupported, match="default layout"):
        trainer.trainer_logprobs(inputs.sequences, inputs.score_from, inputs.temperatures, capture=WorkloadRecorder(6),
                                 layout=TrainerLayout(micro_batch=2))
