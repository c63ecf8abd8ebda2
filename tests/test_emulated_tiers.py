"""The GEMM tiers this CPU lacks, emulated: tests/emulated_tiers/run.py builds kernels/csrc against scalar stand-ins
of the AVX-512 and AMX intrinsics and runs tests/test_gemm.py and tests/test_row_invariance.py on it, so that a
change to the blocking, packing or tile code that breaks those tiers fails here, on an AVX2 machine, and not first
on a user's Xeon. Two bugs put back by hand fail it: 5c61e95's (the bf16 tiers' C^T result left untransposed:
avx512-bf16, K-major columns vs rows, row 0 col 1) and the AVX-512 tier's B packed in 16-column panels where its
micro-kernel reads 64 (avx512, Qwen3-0.6B's down projection, M 7, row 0 col 0)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from logdiff.kernels import gemm

RUN = Path(__file__).parent / "emulated_tiers" / "run.py"


def test_the_tiers_this_cpu_lacks_pass_the_gemm_tests_emulated():
    if set(gemm.tiers_here()) == set(gemm.TIERS):
        pytest.skip("this CPU runs every tier: tests/test_gemm.py checks them on the hardware")
    out = subprocess.run([sys.executable, str(RUN), "-q"], capture_output=True, text=True, timeout=3600)
    log = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, log
    assert "this build runs portable, avx2, avx512, avx512-bf16, amx-bf16" in out.stdout, log
    # every tier runs in that build, so no tier's test may skip; the tests that are not parametrized by tier run on
    # its fastest tiers, avx512 and amx-bf16
    assert re.search(r"^\d+ passed, 2 deselected in ", out.stdout, re.MULTILINE), log
