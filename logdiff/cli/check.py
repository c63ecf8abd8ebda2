"""`logdiff check --stack NAME`: the conformance catalogue on one stack, as a verdict per property.

Runs `conformance/` (installed as logdiff.conformance) with pytest in this process, shows a progress
line per test, prints a property x verdict table and writes under `./logdiff-out/check/<stack>/` (or --out):
`check.json` (the result envelope: every test with its outcome, message and compared figures),
`check.md` (the table, failures, skips) and two offline SVG badges: `conformance.svg` (property
verdicts) and `logdiff.svg` (max |rollout - trainer| over every rollout-vs-trainer comparison).
Exit status 0 unless a property fails outside the expected-failures file; a property the stack
declines entirely is reported as skipped (and the stack's verdict as partial), never as passed.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from logdiff import report, stacks
from logdiff.cli.options import add_engine_args, add_threads_arg, apply_engine_args
from logdiff.errors import UserError


def add(sub) -> None:
    p = sub.add_parser(
        "check", help="run the conformance catalogue (C1-C12) on one stack; exit 0 only if every property passes",
    )
    p.add_argument("--stack", required=True, metavar="NAME", help="the stack: built-in name, module:attr or entry point")
    p.add_argument("--xfails-file", metavar="PATH", help="known gaps: one test id per line, reported as xfail")
    p.add_argument("--property", action="append", dest="properties", metavar="ID",
                   help="run only this property, repeatable, e.g. --property C3 (default: the whole catalogue)")
    p.add_argument("--workload-seed", type=int, default=0, metavar="S",
                   help="seed of the generated workloads beside the fixed ones (default 0)")
    p.add_argument("--workload-examples", type=int, default=None, metavar="N",
                   help="generated workloads per property (default 4; 0: the fixed workloads only)")
    p.add_argument("--workload-shrink-seconds", type=float, default=None, metavar="S",
                   help="shrink a failing generated workload for at most S seconds (default: hypothesis' limit, 300 s); "
                        "for engines whose examples are slow")
    p.add_argument("--out", metavar="DIR", help="results folder (default ./logdiff-out/check/<stack>)")
    add_threads_arg(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    import logdiff.conformance as conformance
    from logdiff.conformance.check import (
        RESULT_FILES,
        fidelity_by_side,
        max_abs_logdiff,
        overall_verdict,
        run_catalogue,
        summarise,
        table_rows,
        write_results,
    )

    apply_engine_args(args)
    stacks.resolve(args.stack)
    selected = _selected_properties(args.properties, conformance.CATALOGUE)
    if args.xfails_file and not Path(args.xfails_file).is_file():
        raise UserError(f"--xfails-file {args.xfails_file} is not a file; pass a text file with one test id per line")
    out = _out_dir(args.out, args.stack)

    if args.workload_examples is not None and args.workload_examples < 0:
        raise UserError(f"--workload-examples {args.workload_examples} is negative; pass 0 or more")
    generated = [f"--workload-seed={args.workload_seed}"]
    if args.workload_examples is not None:
        generated.append(f"--workload-examples={args.workload_examples}")
    if args.workload_shrink_seconds is not None:
        if args.workload_shrink_seconds < 0:
            raise UserError(f"--workload-shrink-seconds {args.workload_shrink_seconds:g} is negative; pass 0 or more")
        generated.append(f"--workload-shrink-seconds={args.workload_shrink_seconds}")
    collector = run_catalogue(args.stack, selected, args.xfails_file, generated)

    verdicts = summarise(collector.results, selected, conformance.CATALOGUE)
    entry = {
        "name": args.stack,
        "describe": collector.stack_info.get("describe", {}),
        "verdict": overall_verdict(verdicts),
        "max_abs_logdiff": max_abs_logdiff(collector.results),
        "max_abs_error_vs_fp64": fidelity_by_side(collector.results),
        "properties": verdicts,
        "tests": [asdict(r) for r in collector.results],
    }
    catalogue = {"catalogue": {p: conformance.CATALOGUE[p] for p in selected}, "xfails_file": args.xfails_file}
    rows = table_rows(verdicts)
    print(report.table(rows))
    if entry["max_abs_error_vs_fp64"]:
        print("max |logp - logp_fp64| (C0): " + ", ".join(
            f"{side} {report.fmt_float(v)}" for side, v in entry["max_abs_error_vs_fp64"].items()))
    for r in collector.results:
        if r.outcome == "fail":
            print(f"\nFAIL {r.id}\n  " + r.message.replace("\n", "\n  "))
    write_results(out, report.envelope("check", catalogue, [entry]), collector.header, rows, collector.results, entry)
    print(f"\nwrote {', '.join(RESULT_FILES)} to {out}")
    return 1 if entry["verdict"] == "fail" else 0


def _selected_properties(requested, catalogue) -> list[str]:
    if not requested:
        return list(catalogue)
    chosen = []
    for p in requested:
        pid = p.upper()
        if pid not in catalogue:
            raise UserError(f"unknown property {p!r}; choose from {', '.join(catalogue)}")
        chosen.append(pid)
    return [p for p in catalogue if p in chosen]


def _out_dir(path: str | None, stack: str) -> Path:
    return report.output_dir(path or report.default_out("check", re.sub(r"[^\w.-]+", "_", stack)), "--out")


