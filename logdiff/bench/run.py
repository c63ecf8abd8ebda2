"""Runs the throughput cases on stacks, interleaved: every case `repeats` times on every stack (reference,
baseline, naive, hf, reference, ...) after one untimed warm-up per stack and case, so slow drift of the
machine (other jobs, thermals) hits all stacks alike. Rollout cases also compare the generated token
ids with the first stack's: every stack must generate the same number of tokens, and the share of
equal ids is reported (greedy on the same weights: equal in fp32; in bf16 an unaligned stack's
rounding flips near-ties, after which its sequence differs but costs the same).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

from logdiff import stacks
from logdiff.api import Unsupported
from logdiff.bench.cases import CASES, Measurement, measure, token_agreement
from logdiff.bench.kernel_cases import KERNEL_CASES, measure_kernel
from logdiff.bench.limits import ModelCosts, case_bound, measure_machine
from logdiff.bench.profile import profile_case
from logdiff.kernels import gemm
from logdiff.oracle import Oracle, fidelity
from logdiff.stacks import KERNEL_STACKS
from logdiff.weights import ModelSpec, parse_dtype

MODEL_CASES = tuple(CASES)
ALL_CASES = MODEL_CASES + tuple(KERNEL_CASES)


def run_bench(names: list[str], cases: list[str], model: str, dtype: str, repeats: int, layout: dict | None = None,
              profile_dir: Path | None = None, sampling: dict | None = None, layers: int | None = None) -> dict:
    """Times every case on every stack; returns the raw measurements, the token checks and the load.
    `layout`: the stacks sharded over torch.distributed ranks (trainer_tp, rollout_tp, ep), or one process.
    `profile_dir`: also profile each model case on each stack once, after its timed repeats (bench.profile).
    `sampling`: Workload fields of every model case's requests (temperature, top_k, top_p, min_p,
    logprobs_mode); none: greedy. `layers`: the model cut to its first N decoder layers (ModelSpec.layers)."""
    from tqdm import tqdm

    started = time.perf_counter()
    load_before = os.getloadavg()
    runs = sum((len(names) if c in CASES else len(KERNEL_STACKS)) * (repeats + 1) for c in cases)
    machine = measure_machine(parse_dtype(dtype))
    costs = ModelCosts(ModelSpec(model, layers=layers).config(), parse_dtype(dtype).itemsize)
    results: dict[str, dict] = {}
    with tqdm(total=runs, desc="logdiff bench", unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        for case in cases:
            if case in CASES:
                results[case] = _bench_model_case(CASES[case], names, model, dtype, repeats, bar, layout or {}, profile_dir,
                                                  {**(sampling or {}), "layers": layers})
                results[case]["bound"] = bound = case_bound(CASES[case], costs, machine)
                if bound:
                    results[case]["limit_fraction"] = {name: [v / bound["bound_tokens_per_s"] for v in tps]
                                                       for name, tps in results[case]["tokens_per_s"].items()}
            else:
                results[case] = _bench_kernel_case(case, dtype, repeats, bar)
    return {
        "model": model, "layers": layers, "dtype": dtype, "stacks": names, "parallel": layout or {}, "sampling": sampling or {},
        "cases": results, "repeats": repeats,
        "machine": machine,
        "loadavg": {"before": list(load_before), "after": list(os.getloadavg())},
        "threads": torch.get_num_threads(), "gemm_tiers": gemm.tiers(), "wall_seconds": time.perf_counter() - started,
    }


def _bench_model_case(case, names, model, dtype, repeats, bar, layout: dict, profile_dir: Path | None,
                      fields: dict) -> dict:
    workload = dataclasses.replace(case.workload(model, dtype), **fields)
    workload.validate()
    built, skipped = {}, {}
    for name in names:
        bar.set_postfix_str(f"{case.name}: building {name}")
        try:
            factory = stacks.parallel_factory(name, layout)
            built[name] = factory(workload.spec, workload.torch_dtype, workload.max_model_len)
            start = getattr(built[name], "start", None)  # an engine in another process starts here, untimed
            if start:
                start()
        except Unsupported as e:
            skipped[name] = str(e)
    timings: dict[str, list[Measurement]] = {name: [] for name in built}
    fidelity, oracle = {}, None
    for rep in range(repeats + 1):  # repeat 0 warms up
        for name, stack in list(built.items()):
            bar.set_postfix_str(f"{case.name}: {name} {'warm-up' if rep == 0 else f'{rep}/{repeats}'}")
            try:
                m = measure(stack, case, workload)
                _settle(stack)
            except Unsupported as e:
                skipped[name] = str(e)
                del built[name], timings[name]
                bar.update(repeats + 1 - rep)
                continue
            if rep:
                timings[name].append(m)
            elif m.recomputed is not None:
                bar.set_postfix_str(f"{case.name}: {name} against the fp64 oracle")
                oracle = oracle or Oracle(workload.spec, workload.torch_dtype)
                fidelity[name] = _fidelity(workload, oracle, *m.recomputed)
            bar.update(1)
    profiles = {}
    if profile_dir is not None:
        for name, stack in built.items():
            bar.set_postfix_str(f"{case.name}: {name} under the profiler")
            profiles[name] = str(profile_case(stack, name, case, workload, profile_dir))
            _settle(stack)
    for stack in built.values():
        close = getattr(stack, "close", None)  # stop an engine in another process before the next case
        if close:
            close()
    del built  # free the models before the next case builds its own
    return {
        "kind": case.kind, "describe": case.describe(), "batch": case.batch, "prompt_len": case.prompt_len,
        "new_tokens": case.new_tokens, "counted_tokens": case.counted_tokens,
        "tokens_per_s": {name: [m.tokens_per_s for m in ms] for name, ms in timings.items()},
        "seconds": {name: [m.seconds for m in ms] for name, ms in timings.items()},
        "token_check": _token_check(timings),
        "fidelity": fidelity,
        "skipped": skipped,
        "profiles": profiles,
    }


def _settle(stack) -> None:
    """Waits until an engine in another process has gone idle, so the next stack's run has the cores."""
    settle = getattr(stack, "settle", None)
    if settle:
        settle()


def _fidelity(workload, oracle: Oracle, scored, rollout, trainer) -> dict:
    """max |logp - logp_fp64| of both sides of the warm-up run (untimed): the work timed is the model's."""
    exact = oracle.score(scored.sequences, scored.score_from, scored.temperatures)
    sides = [fidelity("rollout", rollout, exact, workload.torch_dtype), fidelity("trainer", trainer, exact, workload.torch_dtype)]
    return {f.side: {"max_abs_error": f.max_abs_error, "mean_abs_error": f.mean_abs_error, "holds": f.holds} for f in sides}


def _token_check(timings: dict[str, list[Measurement]]) -> dict:
    """Each stack's generated ids against the first stack's (every repeat's, so a nondeterministic stack shows)."""
    with_ids = {name: ms for name, ms in timings.items() if ms and ms[0].token_ids is not None}
    if not with_ids:
        return {}
    first_name, first = next(iter(with_ids.items()))
    reference_ids = first[0].token_ids
    check = {}
    for name, ms in with_ids.items():
        agreements = [token_agreement(reference_ids, m.token_ids) for m in ms]
        worst = min(agreements, key=lambda a: (a["same_counts"], a["equal_ids"]))
        check[name] = {"against": first_name, **worst}
    return check


def _bench_kernel_case(case: str, dtype: str, repeats: int, bar) -> dict:
    torch_dtype = parse_dtype(dtype)
    spec = KERNEL_CASES[case]
    inputs = spec.inputs(torch_dtype)
    outputs, times = {}, {name: [] for name in KERNEL_STACKS}
    for rep in range(repeats + 1):
        for name in KERNEL_STACKS:
            bar.set_postfix_str(f"{case}: {name} {'warm-up' if rep == 0 else f'{rep}/{repeats}'}")
            seconds, out = measure_kernel(spec, name, inputs)
            if rep:
                times[name].append(seconds)
            else:
                outputs[name] = out
            bar.update(1)
    first = outputs[KERNEL_STACKS[0]].float()
    return {
        "kind": "kernel", "describe": spec.describe, "counted_tokens": spec.tokens,
        "tokens_per_s": {name: [spec.tokens / s for s in ts] for name, ts in times.items()},
        "seconds": times,
        "output_check": {name: {"against": KERNEL_STACKS[0], "max_abs_diff": float((o.float() - first).abs().max()),
                                "max_abs_reference": float(first.abs().max())} for name, o in outputs.items()},
        "skipped": {},
    }
