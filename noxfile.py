"""nox sessions. Every session installs torch 2.13.0 (the CPU build on this machine) first and pins it,
so nothing can pull a CUDA build."""

import platform
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
PYTHON = "3.11"


def install(session, *extras):
    session.install(TORCH)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec)


@nox.session(python=PYTHON)
def tests(session):
    """The harness's own tests, negative controls included."""
    install(session, "test")
    session.run("pytest", "tests", *session.posargs)


@nox.session(python=PYTHON)
def suite(session):
    """The main job: `logdiff run` on the embedded default, fp32 and bf16, every built-in kernel stack."""
    install(session)
    out = Path("results") / platform.node()
    out.mkdir(parents=True, exist_ok=True)
    stacks = ["reference", "baseline", "naive", "reference-no-mask", "reference-no-order", "reference-no-blocks",
              "reference-no-precision", "hf", "hf-eager"]
    flags = [f"--stack={s}" for s in stacks]
    for dtype in ("fp32", "bf16"):
        session.run("logdiff", "run", "--dtype", dtype, *flags, "--json", str(out / f"run-{dtype}.json"))
