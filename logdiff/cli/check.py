"""`logdiff check --stack NAME`: the conformance catalogue on one stack, as a verdict per property.

Runs `conformance/` (installed as logdiff.conformance) with pytest in this process, shows a progress
line per test, prints a property x verdict table and writes under `./logdiff-out/check/<stack>/` (or --out):
`check.json` (the result envelope: every test with its outcome, message and compared figures),
`check.md` (the table, failures, skips) and two offline SVG badges: `conformance.svg` (property
verdicts) and `logdiff.svg` (max |rollout - trainer| over every rollout-vs-trainer comparison).
It ends with a one-screen summary: the table (a failing test either `differ`s or hit an `error`), the
verdict, the first failure's reason and the line that reruns it, where the files are.
Exit status 1 if a property fails outside the expected-failures file, 2 if the stack declined every
property (nothing ran), else 0; a property the stack declines entirely is reported as skipped (and the
stack's verdict as partial), never as passed.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from logdiff import report, stacks
from logdiff.cli.options import (
    add_device_arg,
    add_engine_args,
    add_layers_arg,
    add_pair_args,
    add_threads_arg,
    apply_engine_args,
    exit_status,
)
from logdiff.errors import UserError
from logdiff.weights import check_model_option


def add(sub) -> None:
    p = sub.add_parser(
        "check", help="run the conformance catalogue (C0-C15) on one stack; exit 1 if a property fails, 2 if none could run",
    )
    p.add_argument("--stack", metavar="NAME",
                   help="the stack: built-in name, module:attr, entry point, or a pair ROLLOUT+TRAINER (or --rollout/--trainer)")
    add_pair_args(p)
    p.add_argument("--model", metavar="NAME|DIR",
                   help="run every workload on this model (named config or checkpoint directory) instead of its own")
    add_layers_arg(p)
    p.add_argument("--xfails-file", metavar="PATH", help="known gaps: one test id per line, reported as xfail")
    p.add_argument("--property", action="append", dest="properties", metavar="ID",
                   help="run only this property, repeatable, e.g. --property C3 (default: the whole catalogue)")
    p.add_argument("-k", dest="keyword", metavar="EXPR",
                   help="only the tests this pytest -k expression selects, e.g. a failure's test id as its reproduce "
                        "line prints it: -k 'test_c3_rollout_matches_trainer[dense]'")
    p.add_argument("--workload-seed", type=int, default=0, metavar="S",
                   help="seed of the generated workloads beside the fixed ones (default 0)")
    p.add_argument("--workload-examples", type=int, default=None, metavar="N",
                   help="generated workloads per property (default 4; 0: the fixed workloads only)")
    p.add_argument("--workload-shrink-seconds", type=float, default=None, metavar="S",
                   help="shrink a failing generated workload for at most S seconds (default: hypothesis' limit, 300 s); "
                        "for engines whose examples are slow")
    p.add_argument("--out", metavar="DIR", help="results folder (default ./logdiff-out/check/<stack>)")
    p.add_argument("--junit-xml", metavar="PATH",
                   help="also write the tests' outcomes as JUnit XML here (pytest's --junitxml), for a CI's test report")
    add_threads_arg(p)
    add_device_arg(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    import logdiff.conformance as conformance
    from logdiff.conformance.check import (
        fidelity_by_side,
        max_abs_logdiff,
        overall_verdict,
        run_catalogue,
        summarise,
        table_rows,
        write_results,
    )

    apply_engine_args(args)
    stacks.require(args.stack)
    selected = _selected_properties(args.properties, conformance.CATALOGUE)
    if args.xfails_file and not Path(args.xfails_file).is_file():
        raise UserError(f"--xfails-file {args.xfails_file} is not a file; pass a text file with one test id per line")
    if args.workload_examples is not None and args.workload_examples < 0:
        raise UserError(f"--workload-examples {args.workload_examples} is negative; pass 0 or more")
    generated = [f"--workload-seed={args.workload_seed}", f"--device={args.device}"]
    check_model_option(args.model, args.layers)  # one line now, not a failure in every test
    if args.model:
        generated.append(f"--model={args.model}")
        if args.layers is not None:
            generated.append(f"--layers={args.layers}")
    if args.workload_examples is not None:
        generated.append(f"--workload-examples={args.workload_examples}")
    if args.workload_shrink_seconds is not None:
        if args.workload_shrink_seconds < 0:
            raise UserError(f"--workload-shrink-seconds {args.workload_shrink_seconds:g} is negative; pass 0 or more")
        generated.append(f"--workload-shrink-seconds={args.workload_shrink_seconds}")
    junit = report.check_writable(args.junit_xml, "--junit-xml") if args.junit_xml else None
    out = _out_dir(args.out, args.stack)  # after every check of the input: bad input creates nothing
    if junit:
        ran = []  # pytest writes the XML as the session ends: into a temporary file that replaces `junit` after
        report.write_atomic(junit, lambda tmp: ran.append(run_catalogue(
            args.stack, selected, args.xfails_file, [*generated, f"--junitxml={tmp}", "-o",
                                                     f"junit_suite_name=logdiff check {args.stack}"], args.keyword)))
        collector = ran[0]
    else:
        collector = run_catalogue(args.stack, selected, args.xfails_file, generated, args.keyword)

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
    # Every failure in full first; the summary last, so that it is what a terminal shows.
    for r in collector.results:
        if r.outcome == "fail":
            print(f"FAIL ({r.failure}) {r.id}\n  " + r.message.replace("\n", "\n  ") + "\n")
    write_results(out, report.envelope("check", catalogue, [entry]), collector.header, rows, collector.results, entry)
    print(summary(args.stack, rows, entry, collector.results, out))
    return exit_status([entry["verdict"]])


def summary(stack: str, rows: list[dict], entry: dict, results, out: Path) -> str:
    """One screen: the table, the verdict and why, the first failure's reason and how to rerun it, what ran, the files."""
    from logdiff.conformance.check import RESULT_FILES

    lines = [f"logdiff check: stack {stack}, {len(results)} tests, {report.threads()}", report.table(rows)]
    if entry["max_abs_error_vs_fp64"]:
        lines.append("max |logp - logp_fp64| (C0): " + ", ".join(
            f"{side} {report.fmt_float(v)}" for side, v in entry["max_abs_error_vs_fp64"].items()))
    by_verdict: dict[str, list[str]] = {}
    for pid, v in entry["properties"].items():
        by_verdict.setdefault(v["verdict"], []).append(pid)
    skipped = next((r for r in results if r.outcome == "skipped"), None)
    declined = f" (first reason: {skipped.message.splitlines()[0]})" if skipped and skipped.message else ""
    verdict = entry["verdict"]
    if verdict == "skipped":
        lines.append(f"nothing ran: stack {stack} declined every property{declined}")
    else:
        words = {"fail": ("fails", "fail"), "xfail": ("fails, a known gap", "fail, known gaps"), "skipped": ("skipped",) * 2}
        parts = [f"{', '.join(by_verdict[kind])} {words[kind][len(by_verdict[kind]) > 1]}"
                 for kind in ("fail", "xfail", "skipped") if kind in by_verdict]
        holds = "every property holds, bit for bit" if verdict == "pass" else "; ".join(parts)
        lines.append(f"verdict: {verdict}: {holds}" + (declined if verdict == "partial" and "skipped" in by_verdict else ""))
    failed = next((r for r in results if r.outcome == "fail"), None)
    if failed:
        message = failed.message.splitlines() or [""]
        lines.append(f"first failure ({failed.failure}): {failed.id}: {message[0]}")
        lines += [f"  {line}" for line in message if line.startswith("reproduce: logdiff check")]
    platform = report.platform_info()
    lines += [report.kernels_line(stack, entry["describe"]), report.platform_line(platform), report.provenance_line(platform),
              report.memory_line()]
    lines.append(f"files: {out}/ {' '.join(RESULT_FILES)}")
    return "\n".join(lines)


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


