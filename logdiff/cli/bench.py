"""`logdiff bench`: Eager-mode throughput of stacks side by side, as ratios with spread (see logdiff.bench)."""

from __future__ import annotations

from logdiff import report, stacks
from logdiff.bench.run import ALL_CASES, MODEL_CASES, run_bench
from logdiff.cli.options import (
    add_device_arg,
    add_engine_args,
    add_layers_arg,
    add_pair_args,
    add_parallel_args,
    add_processing_args,
    add_threads_arg,
    apply_engine_args,
    exit_status,
    parallel_layout,
)
from logdiff.errors import UserError
from logdiff.stacks import BENCH_STACKS
from logdiff.workload import Workload


def add(sub) -> None:
    p = sub.add_parser("bench", help="Eager-mode throughput of stacks, interleaved, as ratios with spread; JSON, badge, plot")
    p.add_argument("--stack", action="append", dest="stacks", metavar="NAME",
                   help=f"stack to time, repeatable (default: {', '.join(BENCH_STACKS)}); "
                        "the first is the numerator of every ratio")
    add_pair_args(p)
    p.add_argument("--model", default="qwen3-moe-small", help="named config or checkpoint directory (default qwen3-moe-small)")
    add_layers_arg(p)
    p.add_argument("--dtype", default="bf16", help="fp32, bf16 or fp16 (default bf16)")
    p.add_argument("--case", action="append", dest="cases", metavar="CASE",
                   help=f"case to time, repeatable: {', '.join(ALL_CASES)}, 'model' (the first {len(MODEL_CASES)}, "
                        "the default) or 'all'; the kernel cases run at qwen3-30b-a3b shapes whatever --model says")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per stack and case (default 5)")
    add_threads_arg(p)
    add_device_arg(p)
    p.add_argument("--profile", action="store_true",
                   help="also profile each case on each stack once, untimed (torch.profiler): profile-<case>-<stack>.txt")
    p.add_argument("--out", metavar="DIR", help="folder for JSON, badge and plot (default ./logdiff-out/bench)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the rollout cases (default 0: greedy; the trainer case scores at it, or 1)")
    add_processing_args(p)
    add_parallel_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_bench)


def selected_cases(names: list[str] | None) -> list[str]:
    chosen: list[str] = []
    for name in names or ["model"]:
        expanded = {"model": MODEL_CASES, "all": ALL_CASES}.get(name, (name,))
        for case in expanded:
            if case not in ALL_CASES:
                raise UserError(f"unknown case {case!r}; choose from {', '.join(ALL_CASES)}, model or all")
            if case not in chosen:
                chosen.append(case)
    return chosen


def cmd_bench(args) -> int:
    from logdiff.bench.output import print_summary, write_outputs
    from logdiff.weights import ModelSpec, parse_dtype

    if args.repeats < 1:
        raise UserError(f"--repeats {args.repeats} is not positive; pass 1 or more (3-5 give a spread)")
    parse_dtype(args.dtype)
    apply_engine_args(args)
    names = args.stacks or list(BENCH_STACKS)
    for name in names:
        stacks.require(name)
    cases = selected_cases(args.cases)
    ModelSpec(args.model, layers=args.layers).config()
    layout = parallel_layout(args)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    logprobs_mode=args.logprobs_mode)
    Workload(**sampling).validate()
    out = report.output_dir(args.out or report.default_out("bench"), "--out")

    result = run_bench(names, cases, args.model, args.dtype, args.repeats, layout, profile_dir=out if args.profile else None,
                       sampling=sampling, layers=args.layers)
    print_summary(result)
    for path in write_outputs(result, out):
        print(f"wrote {path}")
    return exit_status(_verdicts(result, names))


def _verdicts(result: dict, names: list[str]) -> list[str]:
    """A stack timed in no model case could not run ("skipped", exit 2); the bench judges no property."""
    model_cases = [r for case, r in result["cases"].items() if case in MODEL_CASES]
    if not model_cases:
        return ["pass"]
    return ["pass" if any(r["tokens_per_s"].get(n) for r in model_cases) else "skipped" for n in names]


