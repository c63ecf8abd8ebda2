"""The GEMM tiers this CPU lacks (AVX-512, AVX512-BF16, AMX), run on it: kernels/csrc rewritten to call the
scalar stand-ins of intrinsics.h, built like the real extension, then tests/test_gemm.py and
tests/test_row_invariance.py run against that build, whose every tier now "runs". It checks the C++ around the
instructions (blocking, packing, tile layouts, thread splits, the C^T form), which the CPU's own tiers do not
reach: the AVX-512 tier's 64-column panels, say, or the AMX tiles' addressing. The instructions themselves
are checked only where a CPU has them (tests/test_gemm.py there).

    python tests/emulated_tiers/run.py [pytest options]
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import torch

from logdiff.kernels import gemm

HERE = Path(__file__).parent
TESTS = [str(HERE.parent / "test_gemm.py"), str(HERE.parent / "test_row_invariance.py")]
# They build the real extension in a fresh cache (80 s), which no tier changes.
BUILD_TESTS = ("test_a_machine_without_a_compiler_gets_one_line",
               "test_a_build_that_was_killed_leaves_nothing_that_blocks_the_next")

# (pattern, replacement, how many times it must match in all of kernels/csrc: 0 = any number)
REWRITES = [
    (r'target\("[^"]*(avx512|amx)[^"]*"\)', 'target("avx2,fma,f16c")', 0),
    (r"__m512bh|__m512i", "emu_m512i", 0),
    (r"__m512\b", "emu_m512", 0),
    (r"__mmask32", "uint32_t", 0),
    (r"__mmask16", "uint16_t", 0),
    (r"\b_mm512_", "emu_mm512_", 0),
    (r"\b_tile_", "emu_tile_", 0),
    (r'asm volatile\("ldtilecfg %0" ::"m"\(cfg\)\);', "emu_tile_config(cfg.rows, cfg.colsb);", 1),
    (r"bool cpu_has\(Tier tier\) \{", "bool cpu_has(Tier tier) {\n  return true;  // emulated", 1),
    (r'(static const bool avx512 = )__builtin_cpu_supports\("avx512f"\) && __builtin_cpu_supports\("avx512bw"\)',
     r"\1true", 1),  # rounding.h's has_avx512
    (r"#include <immintrin.h>", '#include <immintrin.h>\n#include "intrinsics.h"', 0),
]


def emulated_sources(folder: Path) -> tuple[Path, ...]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "intrinsics.h").write_bytes((HERE / "intrinsics.h").read_bytes())
    counts = [0] * len(REWRITES)
    for path in sorted(gemm.CSRC.iterdir()):
        text = path.read_text()
        for i, (pattern, replacement, _) in enumerate(REWRITES):
            text, n = re.subn(pattern, replacement, text)
            counts[i] += n
        (folder / path.name).write_text(text)
    for (pattern, _, expected), n in zip(REWRITES, counts):
        if expected and n != expected:
            raise SystemExit(f"emulated tiers: {pattern!r} matched {n} times in kernels/csrc, not {expected}; update REWRITES")
    return tuple(folder / path.name for path in gemm.SOURCES)


def load() -> None:
    """Builds the emulated extension once per real one (beside it in the cache) and rewrite, and loads it."""
    real = gemm.cache_dir()
    rewrite = (HERE / "intrinsics.h").read_bytes() + Path(__file__).read_bytes()
    folder = real.parent / f"emulated-{hashlib.sha256(real.name.encode() + rewrite).hexdigest()[:16]}"
    library = folder / "logdiff_gemm.so"
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        gemm._build_and_load(library, emulated_sources(folder / "src"))


if __name__ == "__main__":
    load()
    print(f"emulated tiers: this build runs {', '.join(gemm.tiers_here())}", flush=True)
    import pytest

    sys.exit(pytest.main([*TESTS, "-k", " and ".join(f"not {name}" for name in BUILD_TESTS), "-p", "no:cacheprovider",
                          *sys.argv[1:]]))
