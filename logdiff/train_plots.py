"""`logdiff train`'s picture: per step, the mismatch figures RL frameworks log, the importance-ratio
range, the reward and the share of bitwise-equal tokens, one colour per stack: each step faint, its
SMOOTHING-step moving average bold, so a trend shows through the step-to-step noise of sampling."""

from __future__ import annotations

import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from logdiff.report import write_atomic

SMOOTHING = 10
# (record key, panel title, y scale): "symlog" where a stack may sit at exactly 0 and others at 1e-6;
# linear for the signed log_ppl_diff, which crosses 0 every few steps.
PANELS = (
    ("rollout_corr/k3_kl", "rollout_corr/k3_kl (verl)", "symlog"),
    ("rollout_corr/log_ppl_diff", "rollout_corr/log_ppl_diff (verl)", "linear"),
    ("training/rollout_probs_diff_max", "training/rollout_probs_diff_max (verl)", "symlog"),
    ("train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff (slime)", "symlog"),
    ("is_ratio", "IS ratio exp(trainer - rollout) - 1: max (solid), min (dashed)", "symlog"),
    ("routing_flip_share", "MoE routing decisions that differ", "symlog"),
    ("bitwise_equal_share", "tokens bitwise equal", "linear"),
    ("reward", "reward (target-token share)", "linear"),
)


def linear_threshold(values: list[float]) -> float:
    """symlog's linear range: a decade below the smallest non-zero magnitude, so 0 sits apart from it."""
    nonzero = [abs(v) for v in values if v]
    return 10.0 ** (math.floor(math.log10(min(nonzero))) - 1) if nonzero else 1e-12


def moving_average(values, window: int) -> list[float]:
    """Trailing mean over up to `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_training(path: str | os.PathLike, runs: list[dict], title: str) -> None:
    """`runs`: StackTraining.to_dict() of each stack."""
    fig, axes = plt.subplots(4, 2, figsize=(13, 14), sharex=True)
    colours = plt.get_cmap("tab10").colors
    for ax, (key, label, scale) in zip(axes.flat, PANELS):
        shown: list[float] = []
        for i, (colour, run) in enumerate(zip(colours, runs)):
            width = max(1.0, 2.6 - 0.6 * i)  # narrower for later stacks, so stacks on the same values all show
            steps = [r["step"] for r in run["steps"]]
            if key == "is_ratio":
                # minus 1, so fp32's 1 +- 1e-6 shows beside bf16's 0.3..3 on one symlog axis
                top, bottom = [r["is_ratio_max"] - 1 for r in run["steps"]], [r["is_ratio_min"] - 1 for r in run["steps"]]
                shown += top + bottom
                ax.plot(steps, top, color=colour, lw=width / 2, label=run["name"])
                ax.plot(steps, bottom, color=colour, lw=width / 2, ls="--")
                continue
            points = [(s, r[key]) for s, r in zip(steps, run["steps"]) if r.get(key) is not None]
            if not points:
                continue
            xs, ys = zip(*points)
            shown += ys
            ax.plot(xs, ys, color=colour, lw=0.7, alpha=0.35)
            ax.plot(xs, moving_average(ys, SMOOTHING), color=colour, lw=width, label=run["name"])
        if scale == "symlog" and any(shown):  # an all-zero panel stays linear: 0 is the whole story
            ax.set_yscale("symlog", linthresh=linear_threshold(shown))
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("GRPO step")
    axes.flat[0].legend(loc="best", fontsize=9)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
