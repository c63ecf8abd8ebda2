"""`logdiff run`: a workload through stacks, rollout log-probs against the trainer's recompute, bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch

from logdiff import report
from logdiff.api import Unsupported
from logdiff.cli.options import (
    add_device_arg,
    add_parallel_args,
    add_threads_arg,
    add_workload_args,
    exit_status,
    parallel_layout,
    stack_names,
    workload_from_args,
)
from logdiff.oracle import Oracle
from logdiff.report import progress
from logdiff.runner import run_stack
from logdiff.stacks import parallel_factory


def add(sub) -> None:
    p = sub.add_parser("run", help="run a workload through stacks and compare rollout vs trainer log-probs bitwise")
    add_workload_args(p)
    add_parallel_args(p)
    add_threads_arg(p)
    add_device_arg(p)
    p.add_argument("--json", metavar="PATH", help="write the JSON result envelope here")
    p.add_argument("--dump", metavar="DIR", help="write tokens and both log-prob tensors per stack (safetensors)")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    workload = workload_from_args(args)
    names = stack_names(args)
    layout = parallel_layout(args)
    if args.json:
        report.check_writable(args.json)
    dump = report.output_dir(args.dump, "--dump") if args.dump else None
    print(f"logdiff run: {workload.describe()}" + (f", parallel {layout}" if layout else ""))
    platform = report.platform_info()
    print(report.platform_line(platform))
    print(report.provenance_line(platform))
    rows, results, problems = [], [], []
    oracle = None
    for i, name in enumerate(names, 1):
        progress(f"[{i}/{len(names)}] {name}: building (one instance for the rollout, one for the trainer)")
        stack = trainer = None  # the previous stack's instances go before this one's are built
        try:
            factory = parallel_factory(name, layout)
            args_ = (workload.spec, workload.torch_dtype, workload.max_model_len)
            stack, trainer = factory(*args_), factory(*args_)
            start = getattr(stack, "start", None)  # an engine in another process starts before the timed run
            if start:
                start()
            oracle = oracle or Oracle(workload.spec, workload.torch_dtype)
            progress(f"[{i}/{len(names)}] {name}: rollout, trainer recompute, fp64 oracle")
            run = run_stack(stack, workload, trainer, oracle)
        except Unsupported as e:
            rows.append({"stack": name, "verdict": f"skipped: {e}"})
            results.append({"name": name, "verdict": "skipped", "reason": str(e)})
            continue
        rows.append(report.run_row(name, run))
        results.append({**run.to_dict(), "describe": stack.describe()})
        problems += [f"{name}: {line}" for line in run.problems()]
        if dump:
            _dump(dump / f"{name.replace(':', '_')}.safetensors", run)
    print(report.table(rows))
    for line in problems:
        print(line)
    for result in results:
        if "describe" in result:
            print(report.kernels_line(result["name"], result["describe"]))
    print(report.memory_line(workload.spec.checkpoint_bytes(workload.torch_dtype), workload.dtype))
    if args.json:
        report.write_json(args.json, report.envelope("run", workload.to_dict(), results))
        print(f"wrote {args.json}")
    return exit_status(r["verdict"] for r in results)


def _dump(path: Path, run) -> None:
    from safetensors.torch import save_file

    from logdiff.metrics import pad_sequences, response_mask

    sequences = run.scored.sequences
    width = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), width), -1, dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s)
    tensors = {
        "tokens": tokens,
        "prompt_lens": torch.tensor(run.scored.score_from),
        "rollout_logprobs": pad_sequences([o.logprobs for o in run.rollout]),
        "trainer_logprobs": pad_sequences([t.detach() for t in run.trainer]),
        "response_mask": response_mask([o.logprobs for o in run.rollout]),
    }
    report.write_atomic(path, lambda tmp: save_file(tensors, str(tmp)))


