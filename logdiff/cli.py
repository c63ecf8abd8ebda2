"""`logdiff` command line. User mistakes end in one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from logdiff import report, stacks
from logdiff.analyze import add_analyze
from logdiff.bench import add_bench
from logdiff.bisect_command import add_bisect
from logdiff.check import add_check
from logdiff.config import NAMED_CONFIGS
from logdiff.errors import UserError
from logdiff.options import (
    Parser,
    add_workload_args,
    progress,
    stack_names,
    workload_from_args,
)

# --------------------------------------------------------------------------- run


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run a workload through stacks and compare rollout vs trainer log-probs bitwise")
    add_workload_args(p)
    p.add_argument("--json", metavar="PATH", help="write the JSON result envelope here")
    p.add_argument("--dump", metavar="DIR", help="write tokens and both log-prob tensors per stack (safetensors)")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from logdiff.runner import run_stack

    workload = workload_from_args(args)
    names = stack_names(args)
    if args.json:
        report.check_writable(args.json)
    dump = report.output_dir(args.dump, "--dump") if args.dump else None
    print(f"logdiff run: {workload.describe()}")
    rows, results, divergences = [], [], []
    for i, name in enumerate(names, 1):
        progress(f"[{i}/{len(names)}] {name}: building")
        try:
            stack = stacks.build(name, workload.spec, workload.torch_dtype, workload.max_model_len)
            progress(f"[{i}/{len(names)}] {name}: rollout + trainer recompute")
            run = run_stack(stack, workload)
        except stacks.Unsupported as e:
            rows.append({"stack": name, "verdict": f"skipped: {e}"})
            results.append({"name": name, "verdict": "skipped", "reason": str(e)})
            continue
        c = run.comparison
        rows.append({**report.comparison_row("stack", name, c), "seconds": f"{run.seconds:.1f}"})
        results.append({"name": name, **c.to_dict(), "seconds": run.seconds, "describe": stack.describe()})
        divergences.append(report.divergence_line(name, c))
        if dump:
            _dump(dump / f"{name.replace(':', '_')}.safetensors", run)
    print(report.table(rows))
    for line in filter(None, divergences):
        print(line)
    if args.json:
        report.write_json(args.json, report.envelope("run", workload.to_dict(), results))
        print(f"wrote {args.json}")
    return 0


def _dump(path: Path, run) -> None:
    from safetensors.torch import save_file

    from logdiff.metrics import pad_sequences, response_mask

    width = max(len(s) for s in run.sequences)
    tokens = torch.full((len(run.sequences), width), -1, dtype=torch.long)
    for i, s in enumerate(run.sequences):
        tokens[i, : len(s)] = torch.tensor(s)
    tensors = {
        "tokens": tokens,
        "prompt_lens": torch.tensor([len(p) for p in run.prompts]),
        "rollout_logprobs": pad_sequences([o.logprobs for o in run.rollout]),
        "trainer_logprobs": pad_sequences([t.detach() for t in run.trainer]),
        "response_mask": response_mask([o.logprobs for o in run.rollout]),
    }
    report.write_atomic(path, lambda tmp: save_file(tensors, str(tmp)))


# --------------------------------------------------------------------------- list


def _add_list(sub) -> None:
    p = sub.add_parser("list", help="list stacks and models")
    p.set_defaults(func=cmd_list)


def cmd_list(args) -> int:
    rows = [{"stack": name, "what it is": stacks.first_line(f.__doc__)} for name, f in stacks.builtin_stacks().items()]
    import importlib.metadata

    for ep in importlib.metadata.entry_points(group=stacks.ENTRY_POINT_GROUP):
        rows.append({"stack": ep.name, "what it is": f"plugin {ep.value}"})
    print(report.table(rows))
    print()
    models = [
        {"model": c.name, "layers": c.num_hidden_layers, "hidden": c.hidden_size,
         "heads q/kv": f"{c.num_attention_heads}/{c.num_key_value_heads}", "head_dim": c.head_dim,
         "experts": f"{c.num_experts} top-{c.num_experts_per_tok}" if c.is_moe else "dense", "vocab": c.vocab_size}
        for c in NAMED_CONFIGS.values()
    ]
    print(report.table(models))
    print("\n--model also takes a transformers checkpoint directory (config.json + *.safetensors).")
    return 0


# --------------------------------------------------------------------------- main


COMMANDS = [_add_run, _add_list, add_analyze, add_bisect, add_check, add_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="logdiff", description="Bitwise rollout-vs-trainer log-prob conformance (logdiff = 0).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UserError as e:
        print(f"logdiff: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("logdiff: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
