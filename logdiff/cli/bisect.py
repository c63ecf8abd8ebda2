"""`logdiff bisect --stack NAME`: the command line around `logdiff.bisect`, its text report, JSON and pictures."""

from __future__ import annotations

import json
from pathlib import Path

from logdiff import report, stacks
from logdiff.api import Unsupported
from logdiff.bisect.capture import split_name
from logdiff.bisect.locate import (
    KERNEL_PATH,
    ROLLOUT,
    TRAINER,
    Bisection,
    Finding,
    NotReproduced,
    RowDiff,
    Side,
    bisect_sides,
)
from logdiff.cli.options import (
    add_device_arg,
    add_parallel_args,
    add_threads_arg,
    add_workload_args,
    parallel_layout,
    stack_names,
    workload_from_args,
)
from logdiff.errors import UserError
from logdiff.report import progress

SHOWN_LAYERS = 4  # text table columns; the JSON and the heatmap hold every layer

WHY = {
    KERNEL_PATH: "its inputs are bitwise equal on both sides and its output is not: the op itself is not aligned",
    "upstream / framework": "its inputs already differ: the difference came in before this op",
}


def add(sub) -> None:

    p = sub.add_parser("bisect", help="find the first op where a stack's trainer and rollout engine differ, and why")
    add_workload_args(p, stacks_default=("baseline",))
    add_parallel_args(p)
    add_threads_arg(p)
    add_device_arg(p)
    p.add_argument("--path", choices=(ROLLOUT, TRAINER),
                   help="compare this path at its degree (--rollout-tp or --trainer-tp, default --tp; --ep) with itself "
                        "on one process, as C8 does (default: the rollout against the trainer)")
    p.add_argument("--bundle", action="append", dest="bundles", metavar="DIR",
                   help="compare two offline bundles instead of running a stack, on CPU with no model: --bundle A --bundle B "
                        "(written by `logdiff capture` or your own hooks, docs/bundle-format.md); A is the first side")
    p.add_argument("--json", metavar="PATH",
                   help="write the result as JSON here, and beside it PATH-logdiff.png and PATH-first-divergence.png")
    p.set_defaults(func=cmd_bisect)


def picture_paths(json_path: str) -> tuple[Path, Path]:
    base = Path(json_path)
    stem = base.with_suffix("") if base.suffix == ".json" else base
    return stem.with_name(stem.name + "-logdiff.png"), stem.with_name(stem.name + "-first-divergence.png")


def cmd_bisect(args) -> int:
    if args.bundles:
        return _bisect_bundles(args)
    workload = workload_from_args(args)
    names = stack_names(args)
    if len(names) != 1:
        raise UserError(f"bisect examines one stack, got {len(names)} ({', '.join(names)}); pass --stack once")
    layout = parallel_layout(args)
    if args.json:
        report.check_writable(args.json)
    progress(f"{names[0]}: building" + (f", parallel {layout}" if layout else ""))
    one_process = stacks.build(names[0], workload.spec, workload.torch_dtype, workload.max_model_len)
    try:
        stack = one_process.parallel(**layout) if layout else one_process
    except Unsupported as e:
        raise UserError(f"stack {names[0]!r} cannot run sharded as {layout} ({e})") from None
    try:
        result = bisect_sides(*_sides(args, layout, one_process, stack), workload, progress)
    except Unsupported as e:
        raise UserError(f"stack {names[0]!r} cannot run this workload ({e}); change the workload options") from None
    except NotReproduced as e:
        print(f"logdiff bisect: {e}: the stack is not run-to-run deterministic, so captures cannot be compared")
        return 1
    print(render(result))
    platform = report.platform_info()
    print("\n".join([report.kernels_line(names[0], stack.describe()), report.platform_line(platform),
                     report.provenance_line(platform)]))
    if args.json:
        write(args.json, result, workload.to_dict(), [{"name": result.stack, "describe": stack.describe()}])
    return 1 if result.divergence else 0  # the paths diverge: the stack fails rollout = trainer


def _bisect_bundles(args) -> int:
    from logdiff.bisect.bundle import compare_bundles, load_bundle

    if len(args.bundles) != 2:
        raise UserError(f"--bundle compares two bundles, got {len(args.bundles)}; pass --bundle A --bundle B")
    if args.stacks:
        raise UserError("--bundle compares two bundles without running a stack; leave out --stack")
    if args.json:
        report.check_writable(args.json)
    bundles = [load_bundle(path) for path in args.bundles]
    result = compare_bundles(*bundles)
    print(render(result))
    for label, bundle in zip(result.sides, bundles):
        print(f"{label}: " + "\n  ".join(_provenance_lines(bundle.provenance)))
    if args.json:
        write(args.json, result, {"bundles": args.bundles},
              [{"name": b.stack, "side": b.side, "bundle": str(b.path), "provenance": b.provenance} for b in bundles])
    return 1 if result.divergence else 0


def _provenance_lines(provenance: dict) -> list[str]:
    """What ran where a bundle was captured: the lines of a logdiff report when logdiff wrote it, else its own words."""
    try:
        stack = provenance["stacks"][0]
        return [report.kernels_line(stack["name"], stack["describe"]), report.platform_line(provenance["platform"]),
                report.provenance_line(provenance["platform"])]
    except (KeyError, IndexError, TypeError):
        text = json.dumps(provenance, sort_keys=True)
        return [f"provenance {text if len(text) <= 300 else text[:297] + '...'} (in full in --json)"]


def _sides(args, layout: dict, one_process, stack) -> tuple[Side, Side]:
    """The rollout against the trainer at their degrees; with --path, that path at its degree against itself
    on one process."""
    def degrees(path: str) -> str:
        tp, ep = layout.get(f"{path}_tp", 1), layout.get("ep", 1)
        return f"{path} TP{tp}" + (f" EP{ep}" if ep > 1 else "") if layout else path

    if args.path is None:
        return Side(degrees(ROLLOUT), stack, ROLLOUT), Side(degrees(TRAINER), stack, TRAINER)
    unused = TRAINER if args.path == ROLLOUT else ROLLOUT
    if getattr(args, f"{unused}_tp") is not None:
        raise UserError(f"--path {args.path} compares the {args.path} with itself; --{unused}-tp does not apply")
    if layout.get(f"{args.path}_tp", 1) == 1 and layout.get("ep", 1) == 1:
        raise UserError(f"--path {args.path} compares the {args.path} at a parallel degree with itself on one process; "
                        f"give it one, e.g. --{args.path}-tp 2")
    return Side(degrees(args.path), stack, args.path), Side(f"{args.path} TP1", one_process, args.path)


def write(path: str, result: Bisection, workload: dict, stacks_described: list[dict], **extra) -> None:
    """The JSON envelope at `path` and the pictures beside it; `extra` goes into the envelope (e.g. the bundles)."""
    from logdiff.bisect.plots import plot_first_divergence, plot_logdiff

    logdiff_png, heatmap_png = picture_paths(path)
    sides = "" if result.sides == (ROLLOUT, TRAINER) else f": the {result.sides[0]} against the {result.sides[1]}"
    title = f"logdiff bisect {result.stack}{sides}\n{result.about}"
    d = result.divergence
    plot_logdiff(logdiff_png, result.logdiff, (d.seq, d.pos) if d else None, title)
    written = [logdiff_png]
    if result.first:
        points, values = result.grid()
        layer, point = split_name(result.first.point)
        plot_first_divergence(
            heatmap_png, points, values, (point, layer) if layer is not None else None,
            f"{title}\nsequence {d.seq}, row at position {result.position}: first differing point "
            f"{result.first.point} ({result.first.klass})\n{_outside_layers(result)}",
        )
        written.append(heatmap_png)
    pictures = {"logdiff": logdiff_png.name, "first_divergence": heatmap_png.name if result.first else None}
    envelope = report.envelope("bisect", workload, stacks_described, bisect=result.to_dict(), pictures=pictures, **extra)
    report.write_json(path, envelope)
    print("wrote " + ", ".join(map(str, [path, *written])))


def render(b: Bisection) -> str:
    c = b.comparison
    first, second = b.sides
    lines = [
        f"logdiff bisect {b.stack}: {b.about}, {report.threads()}",
        *([] if b.sides == (ROLLOUT, TRAINER) else [f"comparing: the {first} against the {second}"]),
        f"run: {c.tokens} tokens, {c.bitwise_equal_tokens} bitwise equal, max |logdiff| {report.fmt_float(c.max_abs_logdiff)}",
    ]
    d = b.divergence
    if d is None:
        lines.append(f"{first} and {second} agree bit for bit on every token: nothing to bisect")
        return "\n".join(lines)
    lines += [
        f"first divergence: sequence {d.seq}, response token {d.pos} (scored from the row at position {b.position})",
        f"  log-prob: {first} {d.rollout!r} ({d.rollout_bits})  {second} {d.trainer!r} ({d.trainer_bits})  "
        f"|d| {report.fmt_float(b.logprob_abs_diff)}",
        f"  {b.captured}",
        "",
    ]
    if b.first is None:
        lines.append("no capture point differs at this row: the difference comes after the last point the stack captures")
        return "\n".join(lines)
    lines += _finding("first capture point that differs for this row", b.first, b.sides, b.logprob_abs_diff)
    if b.origin:
        prompt_len = b.position + 1 - d.pos
        lines += [""] + _finding(f"where it came in (row at position {b.origin.position}, "
                                 f"{_position_role(b.origin.position, prompt_len)})", b.origin, b.sides)
    lines += [""] + _table(b)
    return "\n".join(lines)


def _position_role(position: int, prompt_len: int) -> str:
    scored = position + 1 - prompt_len
    return f"it scores response token {scored}" if scored >= 0 else "a prompt row"


def _finding(heading: str, f: Finding, sides: tuple[str, str], logprob_abs_diff: float | None = None) -> list[str]:
    lines = [f"{heading}: {f.point}  ->  {f.klass}", *_ranks_text(f)]
    if not f.inputs:
        lines.append("  inputs:   none: it is an input of the forward itself, fed by the framework")
    for i, status in enumerate(f.inputs):
        where = "this row" if status.scope == "token" else f"rows {status.positions[0]}..{status.positions[1]}"
        state = "bitwise equal" if status.equal else _positions_text(status)
        lines.append(f"  {'inputs:' if i == 0 else '':9} {status.name} ({where}): {state}")
    lines += [f"  values:   {_values_text(f.diff, sides)}",
              f"  size:     max |diff| {report.fmt_float(f.diff.max_abs_diff)} here ({f.diff.differing} of {f.diff.elements} "
              "elements differ)"]
    if logprob_abs_diff is not None:
        lines.append(f"            |d| {report.fmt_float(logprob_abs_diff)} at the final log-prob")
    return lines + [f"  why:      {WHY[f.klass]}"]


def _ranks_text(f: Finding) -> list[str]:
    """Where the op ran, when a side ran on several ranks: the collective it ends in and the ranks whose copy differs."""
    if f.side is None:
        return []
    lines = []
    if f.collective:
        layer = split_name(f.point)[0]
        where = "" if layer is None else f"layer {layer} "
        expert = "" if f.expert is None else f" (it runs expert {f.expert}, the first differing element's)"
        lines.append(f"  collective: {where}{f.collective}, rank {f.rank}{expert}")
    plural = "s" if len(f.ranks) > 1 else ""
    alone = "" if f.collective else " (an op each rank runs alone, no collective)"
    return lines + [f"  ranks:    the {f.side} ran on {f.world} ranks; its own copy of this point differs on "
                    f"rank{plural} {', '.join(map(str, f.ranks))}{alone}"]


def _positions_text(status) -> str:
    parts = []
    if status.differing_positions:
        parts.append("differ at rows " + _ranges(status.differing_positions))
    if status.missing_positions:
        parts.append("not captured at rows " + _ranges(status.missing_positions))
    return "; ".join(parts)


def _ranges(values: list[int]) -> str:
    spans, start = [], values[0]
    for prev, cur in zip(values, values[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            spans.append(str(start) if start == prev else f"{start}..{prev}")
            start = cur
    return ", ".join(spans)


def _values_text(diff: RowDiff, sides: tuple[str, str]) -> str:
    if diff.shapes:
        return f"shapes differ: {diff.shapes}"
    rollout = f"{diff.rollout!r}" + (f" ({diff.rollout_bits})" if diff.rollout_bits else "")
    trainer = f"{diff.trainer!r}" + (f" ({diff.trainer_bits})" if diff.trainer_bits else "")
    return f"element {diff.index} of {diff.elements}: {sides[0]} {rollout}  {sides[1]} {trainer}"


def _table(b: Bisection) -> list[str]:
    points, values = b.grid()
    layers = [split_name(f.point)[0] for f in (b.origin, b.first) if f and split_name(f.point)[0] is not None]
    start = min(layers) if layers else 0
    shown = range(start, min(b.num_layers, start + SHOWN_LAYERS))
    rows = [{"point": p, **{f"layer {i}": _cell(values[r][i]) for i in shown}} for r, p in enumerate(points)]
    note = "" if len(shown) == b.num_layers else f" (layers {shown.start}..{shown.stop - 1} of {b.num_layers})"
    return [f"this row, point by point{note}: = bitwise equal, - not captured, else max |diff|",
            report.table(rows), "  " + _outside_layers(b)]


def _outside_layers(b: Bisection) -> str:
    return ", ".join(f"{n} {_cell(0.0 if d.equal else d.max_abs_diff)}" for n, d in b.at_token.items()
                     if not n.startswith("layers."))


def _cell(value: float | None) -> str:
    return "-" if value is None else "=" if value == 0 else f"{value:.2g}"
