"""Regenerates every example output in README.md from the current code, so that the README cannot drift.

An example sits between `<!-- example: NAME -->` and `<!-- /example -->` lines. A command example holds
`$ logdiff ...` and what the command prints on stdout (progress lines go to stderr), run in an empty temporary
folder with OMP_NUM_THREADS unset (so at the default 1 thread); a results example is a table computed from the
committed results it names.

    python tools/readme_examples.py            # rewrite the examples in README.md
    python tools/readme_examples.py --check    # exit 1 and show a diff if an example differs from what the code gives

Figures that vary from run to run (seconds, memory) are compared as placeholders; every other character must match.
Examples made on another CPU (the `platform:` line of the `run` example differs) are compared with every number as
a placeholder too: the bits of the baseline's library GEMMs, and of libm, are the CPU's, not the code's.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = re.compile(r"^<!-- example: (?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /example -->$", re.S | re.M)


def whole(out: str) -> str:
    return out


def first_failure_and_summary(out: str) -> str:
    """`check`: the first failure in full, then the summary it ends with."""
    failure = out[out.index("FAIL "):].split("\n\n")[0]
    return f"{failure}\n...\n{out[out.index('logdiff check: stack'):]}"


def up_to_table(out: str) -> str:
    """`bisect`: the findings, without the point-by-point table."""
    return out[: out.index("\nthis row, point by point")]


@dataclass(frozen=True)
class Command:
    args: tuple[str, ...]
    pick: Callable[[str], str] = whole
    volatile: tuple[str, ...] = field(default_factory=tuple)  # regexes of figures that vary between runs

    def render(self) -> str:
        with tempfile.TemporaryDirectory() as folder:
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            out = subprocess.run([sys.executable, "-m", "logdiff", *self.args], cwd=folder, env=env, capture_output=True,
                                 text=True, timeout=900)
        if out.returncode not in (0, 1):
            raise SystemExit(f"`logdiff {shlex.join(self.args)}` exited {out.returncode}: {out.stderr.strip()[-2000:]}")
        return f"```text\n$ logdiff {shlex.join(self.args)}\n{self.pick(out.stdout).rstrip()}\n```\n"


SECONDS = r"(?m)(?<=  )\d+\.\d(?= *$)"  # `logdiff run`'s last column
RAN = r"(?m)^ran: .*$"  # library and engine versions, ISA, switches: the environment's, not the code's
MEMORY = r"(?m)(?<=^memory: peak RSS ).*$"  # what the process and its children happened to hold

PLATFORM = re.compile(r"(?m)^platform: .*$")
NUMBERS = (r"\b0x[0-9a-f]+\b", r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?!\w)", PLATFORM.pattern)

RUN_DTYPES = ("fp32", "bf16", "fp16")
FIDELITY_STACKS = {"reference": "reference", "baseline": "baseline", "naive": "naive", "hf": "hf (transformers, sdpa)"}


@dataclass(frozen=True)
class FidelityTable:
    """Each built-in stack's rollout distance from fp64 and its bitwise-equal tokens, per dtype, from `nox -s suite`'s
    committed results/vm/run-<dtype>.json."""

    volatile: tuple[str, ...] = ()

    def render(self) -> str:
        runs = {d: {s["name"]: s for s in json.loads((ROOT / "results" / "vm" / f"run-{d}.json").read_text())["stacks"]}
                for d in RUN_DTYPES}
        lines = ["| stack | fp32 | bf16 | fp16 | bitwise fp32 / bf16 / fp16 |", "|---|---|---|---|---|"]
        for name, label in FIDELITY_STACKS.items():
            rollout = [next(f for f in runs[d][name]["fidelity"] if f["side"] == "rollout")["max_abs_error"] for d in RUN_DTYPES]
            equal = " / ".join(str(runs[d][name]["bitwise_equal_tokens"]) for d in RUN_DTYPES)
            total = runs["fp32"][name]["tokens"]
            lines.append(f"| {label} | " + " | ".join(f"{e:.3g}" for e in rollout) + f" | {equal} of {total} |")
        return "\n".join(lines) + "\n"


EXAMPLES = {
    "run": Command(("run",), volatile=(SECONDS, RAN, MEMORY)),
    "fidelity": FidelityTable(),
    "check": Command(("check", "--stack", "reference-no-blocks", "--property", "C3", "--workload-examples", "0"),
                     pick=first_failure_and_summary, volatile=(RAN, MEMORY)),
    "bisect-tp": Command(("bisect", "--stack", "reference-no-reduce-order", "--model", "qwen3-dense-tiny", "--batch-size",
                          "2", "--prompt-lens", "7,33", "--max-new-tokens", "4", "--trainer-tp", "1", "--rollout-tp", "2"),
                         pick=up_to_table),
}


def normalise(text: str, volatile) -> str:
    for pattern in volatile:
        text = re.sub(pattern, "<varies>", text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of rewriting; exit 1 on a difference")
    args = parser.parse_args(argv)
    readme = README.read_text()
    found = [m["name"] for m in MARKER.finditer(readme)]
    if sorted(found) != sorted(EXAMPLES):
        print(f"README.md has examples {found}, this script makes {list(EXAMPLES)}: add or remove a marker", file=sys.stderr)
        return 1
    fresh = {name: example.render() for name, example in EXAMPLES.items()}
    if args.check:
        drift = []
        made_on = PLATFORM.search(next(m["body"] for m in MARKER.finditer(readme) if m["name"] == "run"))
        here = PLATFORM.search(fresh["run"])
        elsewhere = made_on is None or made_on[0] != here[0]
        if elsewhere:
            print(f"README.md: examples made on another platform ({made_on[0] if made_on else 'not named'}), "
                  f"this is {here[0]}: their numbers are compared as placeholders")
        for m in MARKER.finditer(readme):
            volatile = EXAMPLES[m["name"]].volatile + (NUMBERS if elsewhere else ())
            old, new = normalise(m["body"], volatile), normalise(fresh[m["name"]], volatile)
            if old != new:
                drift += difflib.unified_diff(old.splitlines(), new.splitlines(), f"README.md ({m['name']})",
                                              "current code", lineterm="")
        print("\n".join(drift) if drift else f"README.md: {len(found)} examples match the current code")
        if drift:
            print("\nrun `python tools/readme_examples.py` to regenerate them", file=sys.stderr)
        return 1 if drift else 0
    README.write_text(MARKER.sub(lambda m: f"<!-- example: {m['name']} -->\n{fresh[m['name']]}<!-- /example -->", readme))
    print(f"README.md: {len(found)} examples regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
