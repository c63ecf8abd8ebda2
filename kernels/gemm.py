"""logdiff's own GEMM (csrc/fixed_gemm.cpp): one reduction order by construction, so a row's bits never
depend on M, N, the thread count, the tiling or the weight layout.

Each output element is one fp32 accumulator taking the products over K in ascending order, one fused
multiply-add each, operands widened exactly from fp32/bf16/fp16 as stored (a bf16 weight is read as its
2 bytes), rounded once to the output dtype. A thread owns whole output elements, so K is never split.
The ISA tier (AVX-512, AVX2+FMA, portable std::fma) is chosen once at load from what the CPU runs, or
by LOGDIFF_GEMM_TIER; the three compute the same sequence of roundings and so agree bit for bit.

The extension is compiled on first use with the machine's C++ compiler (torch.utils.cpp_extension,
ninja) into a cache folder, `~/.cache/logdiff/gemm-<source hash>` (LOGDIFF_CACHE moves it), and loaded
from there afterwards: measured 27 s to compile here, 0.02 s to load.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from functools import cache
from pathlib import Path

import torch

from logdiff.errors import UserError

SOURCE = Path(__file__).parent / "csrc" / "fixed_gemm.cpp"
TIERS = ("portable", "avx2", "avx512")  # the C++ enum's order


def cache_dir() -> Path:
    root = Path(os.environ.get("LOGDIFF_CACHE") or Path.home() / ".cache" / "logdiff")
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    return root / f"gemm-{digest}"


@cache
def _ops():
    """torch.ops.logdiff, the extension built (once per source and torch version) and loaded."""
    if not hasattr(torch.ops.logdiff, "mm"):
        folder = cache_dir()
        library = folder / "logdiff_gemm.so"
        if not library.exists():
            _build(folder)
        torch.ops.load_library(str(library))
    return torch.ops.logdiff


def _build(folder: Path) -> None:
    from torch.utils import cpp_extension

    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # pip's ninja
    missing = [tool for tool in ("c++", "ninja") if not shutil.which(tool)]
    if missing:
        raise UserError(f"logdiff's GEMM is a C++ extension compiled on first use, and this machine has no "
                        f"{' or '.join(missing)}; install a C++ compiler and ninja (e.g. apt-get install g++ ninja-build)")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"logdiff: compiling the fixed-order GEMM into {folder} (once; about 30 s)", flush=True)
    try:
        cpp_extension.load(name="logdiff_gemm", sources=[str(SOURCE)], build_directory=str(folder),
                           extra_cflags=["-O3", "-ffp-contract=off"], is_python_module=False, verbose=False)
    except (RuntimeError, OSError) as e:
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UserError(f"logdiff's GEMM did not compile ({last}); see the build log in {folder}") from None


def tiers_here() -> list[str]:
    """The tiers this CPU runs, slowest first."""
    ops = _ops()
    return [name for i, name in enumerate(TIERS) if ops.tier_runs(i)]


@cache
def tier() -> str:
    """The tier every GEMM of this process runs: LOGDIFF_GEMM_TIER, or the fastest this CPU runs."""
    here = tiers_here()
    chosen = os.environ.get("LOGDIFF_GEMM_TIER") or here[-1]
    if chosen not in here:
        raise UserError(f"LOGDIFF_GEMM_TIER={chosen} does not run on this CPU; choose one of {', '.join(here)}")
    return chosen


def mm(a: torch.Tensor, b: torch.Tensor, tier_name: str | None = None) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (same leading dims, any strides, fp32/bf16/fp16) -> fp32 [..., M, N]."""
    lead = a.shape[:-2]
    batch = lead.numel()
    a3 = a.reshape(batch, *a.shape[-2:])
    b3 = b.reshape(batch, *b.shape[-2:])
    out = _ops().mm(a3, b3, TIERS.index(tier_name or tier()))
    return out.view(*lead, *out.shape[-2:])


class _MatMul(torch.autograd.Function):
    """mm with its backward on the same GEMM: da = g @ b.T (reduced over N in ascending order), db = a.T @ g
    (reduced over M, the tokens, in ascending order): deterministic whatever the thread count."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return mm(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        da = mm(g, b.mT).to(a.dtype) if ctx.needs_input_grad[0] else None
        db = mm(a.mT, g).to(b.dtype) if ctx.needs_input_grad[1] else None
        return da, db


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`mm`, differentiable: fp32 [..., M, N]."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _MatMul.apply(a, b)
    return mm(a, b)


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [.., N, in] @ w [.., out, in].T, one fixed reduction order, differentiable; rounded once to
    `out_dtype` (default x's)."""
    return matmul(x, w.mT).to(out_dtype or x.dtype)
