"""logdiff at real scale: `logdiff run --stack reference` on real Qwen3 dimensions (random weights: nothing is
downloaded), each run in its own process, tabled with what it cost and what it found.

    python tools/measure_scale.py OUT_DIR [--quick] [--part scale|seed-lengths]

Rows: Qwen3-0.6B at full depth and Qwen3-30B-A3B's dimensions cut to 2 and 4 layers, in bf16 and fp32, on
the default workload and on one 2048-token prompt (plus a 2048-token response on Qwen3-0.6B in bf16, the
seed's lengths). Columns: wall time, peak RSS, the checkpoint's bytes, peak / (2 x checkpoint + 1.5 GB) (the
memory target), verdict, bitwise-equal tokens, each side's largest distance from the fp64 oracle. Writes
scale.md, scale.json and scale.png (peak RSS against the checkpoint's size) to OUT_DIR, each atomically.
Then every built-in stack (`--stack all`) on the tiny model at the seed's lengths, 2048 + 2048 tokens, into
seed-lengths.txt. `--quick` runs two tiny rows only (a check of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from logdiff.report import write_atomic, write_text  # noqa: E402
from logdiff.weights import ModelSpec, parse_dtype  # noqa: E402

WORKLOADS = {
    "default": [],
    "2048-token prompt": ["--batch-size", "1", "--prompt-lens", "2048", "--max-new-tokens", "8"],
    "2048 + 2048 tokens": ["--batch-size", "1", "--prompt-lens", "2048", "--max-new-tokens", "2048"],
}
MODELS = [("qwen3-0.6b", None), ("qwen3-30b-a3b", 2), ("qwen3-30b-a3b", 4)]
ROWS = [(model, layers, dtype, workload) for model, layers in MODELS for dtype in ("bf16", "fp32")
        for workload in ("default", "2048-token prompt")] + [("qwen3-0.6b", None, "bf16", "2048 + 2048 tokens")]
QUICK_ROWS = [("qwen3-moe-tiny", None, "bf16", "default"), ("qwen3-moe-tiny", 1, "fp32", "2048-token prompt")]
GB = 1e9
SLACK_BYTES = 1.5 * GB  # the memory target: peak RSS <= 2 x checkpoint + 1.5 GB


def measure(model: str, layers: int | None, dtype: str, workload: str) -> dict:
    depth = ["--layers", str(layers)] if layers else []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        argv = [sys.executable, "-m", "logdiff", "run", "--stack", "reference", "--model", model, *depth, "--dtype", dtype,
                *WORKLOADS[workload], "--threads", str(os.cpu_count()), "--json", str(path)]
        start = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp)
        seconds = time.monotonic() - start
        checkpoint = ModelSpec(model, layers=layers).checkpoint_bytes(parse_dtype(dtype))
        row = {"model": model, "layers": layers, "dtype": dtype, "workload": workload, "wall_seconds": round(seconds, 1),
               "checkpoint_bytes": checkpoint}
        if done.returncode == -signal.SIGKILL:  # the kernel's OOM killer: a row that says so, not a lost table
            return {**row, "verdict": "killed (SIGKILL: out of memory)", "tokens": None, "peak_rss_bytes": None}
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(argv[2:])} exited {done.returncode}:\n{done.stderr[-3000:]}")
        result = json.loads(path.read_text())
    stack = result["stacks"][0]
    peak = result["memory"]["peak_rss_bytes"]
    return {
        **row, "tokens": stack["tokens"],
        "peak_rss_bytes": peak, "of_memory_target": round(peak / (2 * checkpoint + SLACK_BYTES), 3),
        "verdict": stack["verdict"], "bitwise_equal_tokens": stack["bitwise_equal_tokens"],
        "fp64_max_abs_error": {f["side"]: f["max_abs_error"] for f in stack["fidelity"]},
        "fp64_holds": all(f["holds"] for f in stack["fidelity"]),
        "platform": {k: result["platform"][k] for k in ("machine", "processor", "cpu", "cpu_capability", "gemm_tiers", "threads",
                                                        "torch")},
    }


def seed_lengths() -> str:
    """Every built-in stack on one 2048-token prompt and a 2048-token response, the seed's lengths, on the tiny
    model (engine memory, attention blocks and the oracle at that context; the time per stack is the table's)."""
    argv = [sys.executable, "-m", "logdiff", "run", "--stack", "all", "--model", "qwen3-moe-tiny", "--dtype", "bf16",
            *WORKLOADS["2048 + 2048 tokens"], "--threads", str(os.cpu_count())]
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv[2:])} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return f"$ logdiff {' '.join(argv[3:])}\n{done.stdout}\n(wall time {time.monotonic() - start:.0f} s)\n"


def table(rows: list[dict]) -> str:
    head = ("| model | dtype | workload | wall time | peak RSS | checkpoint | of target | verdict | bitwise equal "
            "| fp64 max (rollout / trainer) |\n|---|---|---|---:|---:|---:|---:|---|---:|---:|")
    lines = [head]
    for r in rows:
        depth = f" --layers {r['layers']}" if r["layers"] else ""
        depth += " *" if r.get("kept_from_earlier_run") else ""
        if r["peak_rss_bytes"] is None:
            lines.append(f"| {r['model']}{depth} | {r['dtype']} | {r['workload']} | {r['wall_seconds']:.0f} s | - "
                         f"| {r['checkpoint_bytes'] / GB:.2f} GB | - | {r['verdict']} | - | - |")
            continue
        err = r["fp64_max_abs_error"]
        lines.append(f"| {r['model']}{depth} | {r['dtype']} | {r['workload']} | {r['wall_seconds']:.0f} s "
                     f"| {r['peak_rss_bytes'] / GB:.2f} GB | {r['checkpoint_bytes'] / GB:.2f} GB | {r['of_memory_target']:.2f} "
                     f"| {r['verdict']} | {r['bitwise_equal_tokens']}/{r['tokens']} "
                     f"| {err.get('rollout', float('nan')):.3g} / {err.get('trainer', float('nan')):.3g} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtype, marker in (("bf16", "o"), ("fp32", "s")):
        mine = [r for r in rows if r["dtype"] == dtype and r["peak_rss_bytes"] is not None]
        ax.scatter([r["checkpoint_bytes"] / GB for r in mine], [r["peak_rss_bytes"] / GB for r in mine],
                   marker=marker, label=f"logdiff run --stack reference, {dtype}")
    top = max(r["checkpoint_bytes"] for r in rows) / GB * 1.1
    ax.plot([0, top], [SLACK_BYTES / GB, 2 * top + SLACK_BYTES / GB], "k--", label="target: 2 x checkpoint + 1.5 GB")
    ax.plot([0, top], [0, top], ":", color="grey", label="the checkpoint itself")
    ax.set_xlabel("checkpoint (GB)"), ax.set_ylabel("peak RSS (GB)")
    ax.set_title("Peak memory of a run against the checkpoint's size")
    ax.legend(fontsize=8), ax.grid(alpha=0.3)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--quick", action="store_true", help="the tiny model only: a check of this script")
    parser.add_argument("--part", choices=("all", "scale", "seed-lengths"), default="all",
                        help="the scale table, the seed-lengths run of every built-in stack, or both (default)")
    parser.add_argument("--skip", metavar="WORKLOAD", action="append", default=[], choices=list(WORKLOADS),
                        help="keep this workload's rows as OUT_DIR/scale.json has them, marked so, instead of measuring "
                             "them again (the 2048 + 2048 row takes 45 min)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part in ("all", "seed-lengths") and not args.quick:
        text = seed_lengths()
        write_text(args.out / "seed-lengths.txt", text)
        print(text)
    if args.part == "seed-lengths":
        return
    plan = QUICK_ROWS if args.quick else ROWS
    earlier = {_key(r): r for r in json.loads((args.out / "scale.json").read_text())} if args.skip else {}
    rows = []
    for i, row in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {row}", file=sys.stderr, flush=True)
        kept = earlier.get(row) if row[3] in args.skip else None
        rows.append({**kept, "kept_from_earlier_run": True} if kept else measure(*row))
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        write_tables(rows, args.out)  # after every row: a run cut short keeps what it measured
    print(table(rows))


def _key(row: dict) -> tuple:
    return row["model"], row["layers"], row["dtype"], row["workload"]


def write_tables(rows: list[dict], out: Path) -> None:
    write_text(out / "scale.json", json.dumps(rows, indent=1) + "\n")
    p = next((r["platform"] for r in rows if "platform" in r), None)
    tiers = ", ".join(f"{k} {v}" for k, v in p.get("gemm_tiers", {}).items()) if p else ""
    where = (f"{p['machine']} ({p.get('cpu', p['processor'])}, {p['cpu_capability']}, logdiff GEMM "
             f"{tiers or 'tiers not recorded'}, {p['threads']} threads, torch {p['torch']})" if p else "this machine")
    kept = any(r.get("kept_from_earlier_run") for r in rows)
    header = (f"Measured on {where} by `python tools/measure_scale.py`; \"of target\" is peak RSS / (2 x checkpoint "
              "+ 1.5 GB); fp64 max is each side's largest |logp - logp_fp64|."
              + (" Rows marked * are kept from an earlier run (`--skip`; its platform in scale.json)." if kept else "")
              + "\n\n")
    write_text(out / "scale.md", header + table(rows))
    if any(r["peak_rss_bytes"] is not None for r in rows):
        plot(rows, out / "scale.png")


if __name__ == "__main__":
    main()
