"""`logdiff train`: the command line around `logdiff.train`, its table, JSON and picture."""

from __future__ import annotations

import sys
from pathlib import Path

from logdiff import report
from logdiff.api import Unsupported
from logdiff.cli.options import (
    add_device_arg,
    add_layers_arg,
    add_pair_args,
    add_processing_args,
    add_threads_arg,
    exit_status,
    int_list,
    processing_from_args,
    stack_names,
)
from logdiff.report import progress
from logdiff.stacks import TRAIN_STACKS
from logdiff.train import TrainConfig, build_stack, exactly_on_policy, train_stack


def add(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser("train", help="a small GRPO loop per stack: does its train-inference mismatch drive off-policy drift?")
    p.add_argument("--stack", action="append", dest="stacks", metavar="NAME",
                   help=f"stack to train, repeatable (default: {', '.join(TRAIN_STACKS)})")
    add_pair_args(p)
    p.add_argument("--model", default=d.model, help=f"named config or checkpoint directory (default {d.model})")
    add_layers_arg(p)
    p.add_argument("--dtype", default=d.dtype, help=f"fp32, bf16 or fp16 (default {d.dtype})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"GRPO steps (default {d.steps})")
    p.add_argument("--prompts", type=int, default=d.prompts, help=f"prompts per step (default {d.prompts})")
    p.add_argument("--group-size", type=int, default=d.group_size, help=f"samples per prompt (default {d.group_size})")
    p.add_argument("--prompt-lens", type=int_list, default=d.prompt_lens,
                   help=f"prompt length per prompt, cycled (default {','.join(map(str, d.prompt_lens))})")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"tokens per response (default {d.max_new_tokens})")
    p.add_argument("--lr", type=float, default=d.learning_rate, dest="learning_rate",
                   help=f"AdamW learning rate (default {d.learning_rate:g})")
    p.add_argument("--clip", type=float, default=d.clip, help=f"PPO-clip epsilon (default {d.clip:g})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of weights, prompts and sampling (default 0)")
    add_processing_args(p)
    add_threads_arg(p)
    add_device_arg(p)
    p.add_argument("--out", metavar="DIR", help="folder for JSON and PNG (default ./logdiff-out/train)")
    p.set_defaults(func=cmd_train, stacks_default=TRAIN_STACKS)


def config_from_args(args) -> TrainConfig:
    config = TrainConfig(
        model=args.model, layers=args.layers, dtype=args.dtype, steps=args.steps, prompts=args.prompts,
        group_size=args.group_size,
        prompt_lens=tuple(args.prompt_lens), max_new_tokens=args.max_new_tokens, learning_rate=args.learning_rate,
        clip=args.clip, seed=args.seed, processing=processing_from_args(args),
    )
    config.validate()
    return config


def output_paths(out: Path, config: TrainConfig) -> tuple[Path, Path]:
    stem = f"train-{config.spec.config().name}-{config.dtype}"
    return out / f"{stem}.json", out / f"{stem}.png"


def cmd_train(args) -> int:
    config = config_from_args(args)
    names = stack_names(args)
    out = report.output_dir(args.out or report.default_out("train"), "--out")
    json_path, png_path = output_paths(out, config)
    return _train_and_report(names, config, json_path, png_path)


def _train_and_report(names: list[str], config: TrainConfig, json_path: Path, png_path: Path) -> int:
    from tqdm import tqdm

    from logdiff.train_plots import plot_training

    print(f"logdiff train: {config.describe()}, {report.threads()}")
    runs, skipped = [], []
    for i, name in enumerate(names, 1):
        progress(f"[{i}/{len(names)}] {name}: building")
        with tqdm(total=config.steps, desc=name, unit="step", file=sys.stderr, dynamic_ncols=True) as bar:
            def advance(record: dict) -> None:
                bar.set_postfix(reward=f"{record['reward']:.2f}", equal=f"{record['bitwise_equal_share']:.2f}",
                                k3=f"{record['rollout_corr/k3_kl']:.1e}", refresh=False)
                bar.update()

            try:
                runs.append(train_stack(build_stack(name, config), config, advance).to_dict())
            except Unsupported as e:  # no trainer parameters, no weight sync, or a declined dtype
                skipped.append({"name": name, "verdict": "skipped", "reason": str(e)})
                progress(f"{name}: skipped ({e})")

    print(report.table([summary_row(run) for run in runs] + [{"stack": s["name"], "on-policy": f"skipped: {s['reason']}"}
                                                               for s in skipped]))
    report.write_json(json_path, report.envelope("train", config.to_dict(), runs + skipped))
    print(f"wrote {json_path}")
    if runs:
        plot_training(png_path, runs, f"logdiff train: {config.describe()}")
        print(f"wrote {png_path}")
    # The property a training run judges: exactly on-policy at every step.
    return exit_status(["pass" if exactly_on_policy(r["steps"]) else "fail" for r in runs] + ["skipped" for _ in skipped])


def summary_row(run: dict) -> dict:
    s, fmt = run["summary"], report.fmt_float
    k3, abs_diff = s["trend"]["rollout_corr/k3_kl"], s["trend"]["train_rollout_logprob_abs_diff"]
    return {
        "stack": run["name"],
        "on-policy": "exact" if exactly_on_policy(run["steps"]) else "no",
        "bitwise steps": f"{s['steps_bitwise_equal']}/{s['steps']}",
        "k3_kl step 1": fmt(s["first_step"]["rollout_corr/k3_kl"]),
        f"k3_kl mean first/last {s['trend_window']}": f"{fmt(k3['first_steps'])} / {fmt(k3['last_steps'])}",
        f"|old-rollout| mean first/last {s['trend_window']}": f"{fmt(abs_diff['first_steps'])} / {fmt(abs_diff['last_steps'])}",
        "max |IS ratio - 1|": fmt(max(1 - s["is_ratio_min"], s["is_ratio_max"] - 1)),
        "reward first/last": f"{s['trend']['reward']['first_steps']:.3f} / {s['trend']['reward']['last_steps']:.3f}",
        "seconds": f"{run['seconds']:.0f}",
    }


__all__ = ["add", "cmd_train", "config_from_args"]
