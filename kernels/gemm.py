"""logdiff's own GEMM (csrc/fixed_gemm.cpp): one reduction order by construction, so a row's bits never
depend on M, N, the thread count, the tiling or the weight layout.

Each output element is one fp32 accumulator taking the products over K in ascending order, operands read
as stored (a bf16 weight is read as its 2 bytes), rounded once to the output dtype. A thread owns whole
output elements, so K is never split. Tiers, chosen once per process from what the CPU runs (or by
LOGDIFF_GEMM_TIER):
  FMA tiers, any of fp32/bf16/fp16: avx512, avx2 (+FMA), portable (std::fma); one fused multiply-add per
      k, so the three agree bit for bit;
  bf16 tiers, bf16 x bf16 only: amx-bf16 (tdpbf16ps), avx512-bf16 (vdpbf16ps); the hardware's dot
      product of each pair of k, pairs in ascending order, so their bits differ from the FMA tiers'
      (and from each other's), while within a tier they still depend on K alone.
Reports name the tiers that ran (`tiers()`).

The extension is compiled on first use with the machine's C++ compiler (torch.utils.cpp_extension,
ninja) into a cache folder, `~/.cache/logdiff/gemm-<source hash>` (LOGDIFF_CACHE moves it), and loaded
from there afterwards: measured 16-100 s to compile on our machines, 0.02 s to load.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

from logdiff.errors import UserError

CSRC = Path(__file__).parent / "csrc"
# one extension, torch.ops.logdiff
SOURCES = tuple(CSRC / name for name in ("fixed_gemm.cpp", "moe_combine.cpp", "expert_rows.cpp", "rms_norm.cpp",
                                          "silu_mul.cpp", "rope.cpp"))
FMA_TIERS = ("portable", "avx2", "avx512")
BF16_TIERS = ("avx512-bf16", "amx-bf16")
TIERS = FMA_TIERS + BF16_TIERS  # the C++ enum's order, slowest first
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers, which runs on one thread without it.
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


def cache_dir() -> Path:
    root = Path(os.environ.get("LOGDIFF_CACHE") or Path.home() / ".cache" / "logdiff")
    sources = b"".join(path.read_bytes() for path in sorted(CSRC.iterdir()))
    digest = hashlib.sha256(sources + " ".join(CFLAGS).encode() + torch.__version__.encode()).hexdigest()[:16]
    return root / f"gemm-{digest}"


@cache
def extension():
    """torch.ops.logdiff, the extension built (once per source and torch version) and loaded."""
    if not hasattr(torch.ops.logdiff, "mm"):
        library = cache_dir() / "logdiff_gemm.so"
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build_and_load(library)
    return torch.ops.logdiff


def _build_and_load(library: Path, sources: tuple[Path, ...] = SOURCES) -> None:
    """Compiles `sources` in a folder of this process's own, loads the result, then renames it into the cache: a
    build that was killed leaves no lock or half-written library behind, and two processes building at
    once each finish."""
    from torch.utils import cpp_extension

    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # pip's ninja
    missing = [tool for tool in ("c++", "ninja") if not shutil.which(tool)]
    if missing:
        raise UserError(f"logdiff's GEMM is a C++ extension compiled on first use, and this machine has no "
                        f"{' or '.join(missing)}; install a C++ compiler and ninja (e.g. apt-get install g++ ninja-build)")
    library.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=".build-", dir=library.parent))
    print(f"logdiff: compiling the fixed-order GEMM into {library.parent} (once; up to about two minutes)", flush=True)
    try:
        cpp_extension.load(name="logdiff_gemm", sources=[str(path) for path in sources], build_directory=str(build),
                           extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except (RuntimeError, OSError) as e:
        log = library.parent / "build.log"
        log.write_text(str(e))
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UserError(f"logdiff's GEMM did not compile ({last}); the compiler's output is in {log}") from None
    else:
        os.replace(build / "logdiff_gemm.so", library)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def tiers_here() -> list[str]:
    """The tiers this CPU runs, slowest first."""
    ops = extension()
    return [name for i, name in enumerate(TIERS) if ops.tier_runs(i)]


@cache
def tiers() -> dict[str, str]:
    """The tier every GEMM of this process runs, by operand dtypes: {"fp32/fp16": .., "bf16": ..}. The
    fastest this CPU runs, or LOGDIFF_GEMM_TIER: an FMA tier there runs every GEMM, a bf16 tier the
    bf16 x bf16 ones (the rest on the fastest FMA tier)."""
    here = tiers_here()
    fma = [t for t in here if t in FMA_TIERS][-1]
    chosen = os.environ.get("LOGDIFF_GEMM_TIER")
    if chosen and chosen not in here:
        raise UserError(f"LOGDIFF_GEMM_TIER={chosen} does not run on this CPU; choose one of {', '.join(here)}")
    if chosen in FMA_TIERS:
        return {"fp32/fp16": chosen, "bf16": chosen}
    # The pair tiers beat the FMA tiers at every M measured (avx512-bf16 vs avx512, K-major weight K 2048 x
    # N 6144, 2 threads: M 1 25 vs 22 GB/s, M 64 349 vs 187 GFLOP/s, M 512 414 vs 203).
    return {"fp32/fp16": fma, "bf16": chosen or next(t for t in (*reversed(BF16_TIERS), fma) if t in here)}


def tier_for(a: torch.dtype, b: torch.dtype) -> str:
    return tiers()["bf16" if a == b == torch.bfloat16 else "fp32/fp16"]


def weight_layout(w: torch.Tensor) -> torch.Tensor:
    """w [.., out, in] in the layout this process's tier for w's dtype streams fastest, same values and
    shape: as stored (rows of K) for amx-bf16, which reads them as its tiles' rows; for the others the
    transpose of a contiguous [.., in, out], whose rows of N they read in place instead of transposing
    16 x 16 tiles into a packed block per call (one row, K 2048 x N 6144, one thread, avx512: fp32 10.7 GB/s
    K-major vs 9.6 as stored, bf16 9.8 vs 5.8; amx-bf16 11.6 GB/s as stored vs 1.4 K-major). The layout never
    changes a bit. `ModelSpec.build` lays every GEMM weight out once, for the trainer, the engine and the
    oracle to share."""
    return w if tier_for(w.dtype, w.dtype) == "amx-bf16" else w.mT.contiguous().mT


def mm(a: torch.Tensor, b: torch.Tensor, tier_name: str | None = None,
       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (same leading dims, any strides, fp32/bf16/fp16) -> [..., M, N] in `out_dtype`
    (fp32, or rounded once from it to nearest even, as `.to` rounds, by the thread that computed the block), on
    `tier_name` (default: this process's tier for the operands' dtypes)."""
    tier = TIERS.index(tier_name or tier_for(a.dtype, b.dtype))
    if a.dim() == b.dim() <= 3:  # what the op takes as it is: a decode step makes hundreds of small calls
        return extension().mm(a, b, tier, out_dtype)
    lead = a.shape[:-2]
    batch = lead.numel()
    out = extension().mm(a.reshape(batch, *a.shape[-2:]), b.reshape(batch, *b.shape[-2:]), tier, out_dtype)
    return out.view(*lead, *out.shape[-2:])


class _MatMul(torch.autograd.Function):
    """mm rounded once to out_dtype, with its backward on the same GEMM: da = g @ b.T (reduced over N in
    ascending order), db = a.T @ g (reduced over M, the tokens, in ascending order): deterministic whatever
    the thread count. The rounding is inside, so a bf16 output's gradient arrives as bf16 and a bf16 model's
    backward runs on the bf16 tier, as its forward does. db is computed in b's own layout: the gradient of a
    weight as stored (b = w.T) is g.T @ a, so that it needs no transposing copy (a tied lm_head's gradient
    meets the embedding's as [V, H], not as the transpose of one)."""

    @staticmethod
    def forward(ctx, a, b, out_dtype):
        ctx.save_for_backward(a, b)
        return mm(a, b, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        da = mm(g, b.mT, out_dtype=a.dtype) if ctx.needs_input_grad[0] else None
        db = None
        if ctx.needs_input_grad[1]:
            db = mm(g.mT, a, out_dtype=b.dtype).mT if b.stride(-2) == 1 else mm(a.mT, g, out_dtype=b.dtype)
        return da, db, None


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`mm`, differentiable, rounded once to `out_dtype`: [..., M, N]."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _MatMul.apply(a, b, out_dtype)
    return mm(a, b, out_dtype=out_dtype)


class _ChunkedMatMul(torch.autograd.Function):
    """`chunked_linear`'s forward in one call. Its backward is the chunks' own, each on the whole operand: dx
    column j comes from the chunk that holds j alone (g @ w, reduced over the outputs in order), dw = g.T @ x
    (reduced over the tokens in order), in w's layout."""

    @staticmethod
    def forward(ctx, x, w, chunks):
        ctx.save_for_backward(x, w)
        return extension().mm_chunked(x, w.mT, TIERS.index(tier_for(x.dtype, w.dtype)), x.dtype, chunks)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = mm(g, w, out_dtype=x.dtype) if ctx.needs_input_grad[0] else None
        dw = mm(g.mT, x, out_dtype=w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def chunked_linear(x: torch.Tensor, w: torch.Tensor, chunks: int) -> torch.Tensor:
    """x [N, K] @ w [out, K].T as `chunks` GEMMs over equal chunks of K, each reduced from zero, their fp32
    results added in chunk order and rounded once to x's dtype: the bits of `linear(.., torch.float32)` per
    chunk summed in order, without the chunks' fp32 outputs. Differentiable."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _ChunkedMatMul.apply(x, w, chunks)
    return extension().mm_chunked(x, w.mT, TIERS.index(tier_for(x.dtype, w.dtype)), x.dtype, chunks)


def _grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return extension().grouped_mm(a, b, offsets, TIERS.index(tier_for(a.dtype, b.dtype)), out_dtype)


def _grouped_tn(x: torch.Tensor, y: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return extension().grouped_mm_tn(x, y, offsets, TIERS.index(tier_for(x.dtype, y.dtype)), out_dtype)


class _GroupedMatMul(torch.autograd.Function):
    """Rows offsets[e]:offsets[e + 1] of a [T, K] times b[e] [K, N], rounded once to out_dtype: per group the
    very GEMM `mm` runs, in one call (no loop over groups in Python, no concatenation, each group rounded
    while its fp32 block is in cache). Backward on the same GEMM: da = the grouped g @ b[e].T, db[e] = a_e.T @
    g_e reduced over the group's rows in ascending order, computed in b's own layout so that the gradient of
    a weight as stored needs no transposing copy."""

    @staticmethod
    def forward(ctx, a, b, offsets, out_dtype):
        ctx.save_for_backward(a, b, offsets)
        return _grouped(a, b, offsets, out_dtype)

    @staticmethod
    def backward(ctx, g):
        a, b, offsets = ctx.saved_tensors
        da = _grouped(g, b.mT, offsets, a.dtype) if ctx.needs_input_grad[0] else None
        db = None
        if ctx.needs_input_grad[1]:
            db = _grouped_tn(g, a, offsets, b.dtype).mT if b.stride(-2) == 1 else _grouped_tn(a, g, offsets, b.dtype)
        return da, db, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [T, in], its rows in groups (offsets [E + 1], int64), group e times w[e] [out, in].T -> [T, out] in
    x's dtype; each row's bits are `linear`'s on its group's weight. Differentiable."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _GroupedMatMul.apply(x, w.mT, offsets, x.dtype)
    return _grouped(x, w.mT, offsets, x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [.., N, in] @ w [.., out, in].T, one fixed reduction order, differentiable; rounded once to
    `out_dtype` (default x's)."""
    return matmul(x, w.mT, out_dtype or x.dtype)


linear.gemm_backend = "logdiff GEMM (one fixed K order)"  # as reports name it (KernelSet.provenance)


def fallbacks(here: list[str], chosen: dict[str, str]) -> list[str]:
    """Where a process runs a slower GEMM tier than logdiff has because the CPU lacks the faster one, given the
    tiers the CPU runs and those chosen (`tiers()`); a tier forced by LOGDIFF_GEMM_TIER is a switch, not this."""
    best = {"fp32/fp16": FMA_TIERS[-1], "bf16": "amx-bf16"}
    return [f"{dtypes} GEMMs on {chosen[dtypes]}: this CPU has no {tier}"
            for dtypes, tier in best.items() if chosen[dtypes] != tier and tier not in here]
