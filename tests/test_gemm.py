"""logdiff's GEMM: one reduction order by construction, checked as properties over shapes nobody tuned for.

Row i of an M-row call equals the 1-row call bit for bit, per tier, for M 1..4096, at the GEMM shapes of
every published Qwen3 model, with 1 and 2 threads and both weight layouts; the FMA tiers agree with each
other; every tier is an fp32-accumulated GEMM (near fp64); a machine without a compiler gets one line.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logdiff.kernels import gemm
from logdiff.kernels.linear import linear

# (K, N) of every GEMM of the published Qwen3 models: q/k/v/o projections, dense MLP or experts' gate/up and
# down, the router, the lm_head (vocabulary 151936). hidden, intermediate, heads x head_dim from their configs.
QWEN3 = {
    "0.6B": dict(hidden=1024, inter=3072, q=2048, kv=1024),
    "1.7B": dict(hidden=2048, inter=6144, q=2048, kv=1024),
    "4B": dict(hidden=2560, inter=9728, q=4096, kv=1024),
    "8B": dict(hidden=4096, inter=12288, q=4096, kv=1024),
    "14B": dict(hidden=5120, inter=17408, q=5120, kv=1024),
    "32B": dict(hidden=5120, inter=25600, q=8192, kv=1024),
    "30B-A3B": dict(hidden=2048, inter=768, q=4096, kv=512, experts=128),
    "235B-A22B": dict(hidden=4096, inter=1536, q=8192, kv=512, experts=128),
}
VOCAB = 151936


def gemm_shapes() -> list[tuple[str, int, int]]:
    shapes = set()
    for name, c in QWEN3.items():
        h = c["hidden"]
        shapes |= {(f"{name} q_proj", h, c["q"]), (f"{name} kv_proj", h, c["kv"]), (f"{name} o_proj", c["q"], h),
                   (f"{name} gate_up", h, 2 * c["inter"]), (f"{name} down", c["inter"], h), (f"{name} lm_head", h, VOCAB)}
        if "experts" in c:
            shapes.add((f"{name} router", h, c["experts"]))
    return sorted(shapes)


SHAPES = gemm_shapes()
# Products per example: past it the M-row call keeps a window of the weight's columns (at its offset in
# the real weight, so packing and tails see real strides); K, which fixes the reduction, is always whole.
BUDGET = {"amx-bf16": 4e8, "avx512-bf16": 3e8, "avx512": 4e8, "avx2": 2e8, "portable": 1.5e7}
ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def dtypes_of(tier: str) -> list[torch.dtype]:
    return [torch.bfloat16] if tier in gemm.BF16_TIERS else ALL_DTYPES
# Elements of x at most (64 MiB in fp32): M stays whole up to 4096 for K <= 4096, down to 655 at K 25600.
X_ELEMENTS = 2**24


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    row, col = (bits(a) != bits(b)).nonzero()[0].tolist()
    mask, width = (1 << 8 * a.element_size()) - 1, 2 + 2 * a.element_size()
    return f"row {row} col {col}: {bits(a)[row, col].item() & mask:#0{width}x} vs {bits(b)[row, col].item() & mask:#0{width}x}"


@pytest.mark.parametrize("tier", gemm.tiers_here())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_row_of_an_m_row_call_equals_the_one_row_call(tier, data):
    name, k, n = data.draw(st.sampled_from(SHAPES), label="shape")
    m = data.draw(st.integers(1, 4096), label="M")
    dtype = data.draw(st.sampled_from(dtypes_of(tier)), label="dtype")
    k_major = data.draw(st.booleans(), label="K-major weight")
    threads = data.draw(st.sampled_from([1, 2]), label="threads")
    m = max(1, min(m, X_ELEMENTS // k))
    width = max(1, min(n, int(BUDGET[tier] // (m * k))))
    offset = data.draw(st.integers(0, n - width), label="first column")
    gen = torch.Generator().manual_seed(m * 7919 + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(width, k, generator=gen) / k**0.5).to(dtype)  # columns offset..offset+width of the weight
    if k_major:
        w = w.mT.contiguous().mT
    rows = sorted({0, m - 1, data.draw(st.integers(0, m - 1), label="row")})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = gemm.mm(x, w.mT, tier)
        alone = torch.cat([gemm.mm(x[i:i + 1], w.mT, tier) for i in rows])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bits(whole[rows]), bits(alone)), (
        f"{tier} {name} M={m} K={k} N={n} (columns {offset}..{offset + width}) {dtype}: {first_difference(whole[rows], alone)}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n", [(1, 2048, 768), (7, 768, 2048), (130, 1024, 300), (33, 3000, 65), (2, 5, 3)])
def test_every_fma_tier_computes_the_same_bits(dtype, m, k, n):
    gen = torch.Generator().manual_seed(m + k + n)
    x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    results = {tier: gemm.mm(x, w.mT, tier) for tier in gemm.tiers_here() if tier in gemm.FMA_TIERS}
    portable = results["portable"]
    for tier, out in results.items():
        assert torch.equal(bits(out), bits(portable)), f"{tier} vs portable: {first_difference(out, portable)}"


@pytest.mark.parametrize("m,k,n", [(50, 1500, 70), (130, 64, 8), (1, 2048, 8), (33, 3000, 65), (40, 96, 31)])
@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize("tier,dtype", [(t, d) for t in gemm.tiers_here() for d in dtypes_of(t)])
def test_it_is_the_fp32_gemm_of_the_stored_values(tier, dtype, k_major, m, k, n):
    """Ragged and narrow shapes too: N under one panel or tile (a MoE router's 8 experts), K off the step."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    exact = x.double() @ w.double().T
    out = gemm.mm(x, (w.mT.contiguous() if k_major else w.mT), tier)
    assert out.dtype == torch.float32
    # sequential fp32 accumulation: |error| <= K * eps32 * sum |x_k w_k| (a loose, always-valid bound)
    bound = k * 2**-24 * (x.double().abs() @ w.double().abs().T)
    assert ((out.double() - exact).abs() <= bound).all()
    assert (out.double() - exact).abs().max() < 1e-3


@pytest.mark.parametrize("m,k,n", [(1, 2048, 200), (5, 512, 64), (13, 768, 130), (200, 96, 300), (7, 33, 65), (70, 200, 40),
                                   (300, 64, 70), (3, 35, 67)])
@pytest.mark.parametrize("tier,dtype", [(t, d) for t in gemm.tiers_here() for d in dtypes_of(t)])
def test_the_operands_layout_changes_no_bit(tier, dtype, m, k, n):
    """x as rows or as the transpose of [K, M]; w as stored or K-major: a tier reads each in place or packs it
    (a bf16 pair tier interleaves two rows of a K-major weight in registers, transposes words of a stored
    one), and none of that may reach a bit. Odd K pads a pair with zero. Both layouts strided along k take the
    C^T form on the bf16 tiers; the result fp32 or rounded in the operands' dtype. A few rows against a K-major
    weight stream it on the FMA tiers (M 3: K 35 ends in 3 single rows of B, N 67 in 3 scalar columns)."""
    gen = torch.Generator().manual_seed(m + k + n)
    x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    for out_dtype in dict.fromkeys((torch.float32, dtype)):
        outs = {(x_layout, w_layout): gemm.mm(xl, wl.mT, tier, out_dtype)
                for x_layout, xl in (("rows", x), ("columns", x.mT.contiguous().mT))
                for w_layout, wl in (("stored", w), ("K-major", w.mT.contiguous().mT))}
        first = outs["rows", "stored"]
        for layout, out in outs.items():
            assert torch.equal(bits(out), bits(first)), \
                f"{tier} {layout} vs rows/stored, {out_dtype}: {first_difference(out, first)}"


@pytest.mark.parametrize("tier,dtype", [(t, d) for t in gemm.tiers_here() for d in dtypes_of(t) if d != torch.float32])
def test_a_rounded_result_is_the_fp32_result_rounded_as_to_rounds(tier, dtype):
    """A bf16 or fp16 result is rounded by the thread that computed its block: bit for bit what `.to` makes of
    the fp32 result, for ties (to even), overflow to infinity, NaN, and a row tail shorter than a vector."""
    gen = torch.Generator().manual_seed(5)
    tiny = torch.finfo(dtype).eps / 2  # 1 + tiny is a tie between 1 and 1 + eps
    pairs = [(1.0, tiny), (1.0 + 2 * tiny, tiny), (torch.finfo(dtype).max, torch.finfo(dtype).max),
             (float("inf"), float("-inf")), (-1.0, -tiny)]
    x = torch.randn(70, 64, generator=gen)
    x[:len(pairs), :2] = torch.tensor(pairs)
    x[:len(pairs), 2:] = 0
    w = torch.randn(37, 64, generator=gen)
    w[0, :2] = 1
    x, w = x.to(dtype), w.to(dtype)
    # x's columns contiguous and w K-major: a weight gradient's operands, which AMX computes as C^T and stores
    # transposed when N < M
    for a, b in ((x, w.mT), (x, w.mT.contiguous()), (x.mT.contiguous().mT, w.mT.contiguous())):
        rounded, exact = gemm.mm(a, b, tier, out_dtype=dtype), gemm.mm(a, b, tier)
        assert rounded.dtype == dtype
        assert torch.equal(rounded.view(torch.int16), exact.to(dtype).view(torch.int16)), tier
        assert torch.equal(bits(exact), bits(gemm.mm(x, w.mT, tier))), tier


def test_batched_operands_with_any_strides():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(3, 4, 10, 33, generator=gen)
    b = torch.randn(3, 4, 20, 33, generator=gen).transpose(-1, -2)  # [.., 33, 20], column stride 33
    out = gemm.mm(a[:, :, 2:], b)
    assert out.shape == (3, 4, 8, 20)
    assert torch.equal(bits(out[1, 2]), bits(gemm.mm(a[1, 2, 2:], b[1, 2].contiguous())))
    torch.testing.assert_close(out, a[:, :, 2:] @ b, rtol=1e-5, atol=1e-5)


def test_backward_uses_the_same_gemm_and_is_deterministic():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=gen, requires_grad=True)
    w = torch.randn(48, 64, generator=gen, requires_grad=True)
    dy = torch.randn(37, 48, generator=gen)
    grads = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        grads.append(torch.autograd.grad(linear(x, w), (x, w), dy))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    dx, dw = grads[0]
    assert dw.is_contiguous()  # in the stored weight's own layout
    assert torch.equal(bits(dx), bits(gemm.mm(dy, w.detach())))  # dX = dY W, reduced over the outputs in order
    assert torch.equal(bits(dw), bits(gemm.mm(dy.mT, x.detach())))  # dW = dY^T X, reduced over the tokens in order
    torch.testing.assert_close(dx, dy @ w.detach(), rtol=1e-5, atol=1e-5)


def test_a_bf16_linear_runs_its_backward_on_the_bf16_tier():
    """The output's rounding sits inside the autograd function, so the gradient arrives as bf16 and both
    backward GEMMs take bf16 x bf16, as the forward does."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 64, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(48, 64, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(37, 48, generator=gen).bfloat16()
    dx, dw = torch.autograd.grad(linear(x, w), (x, w), dy)
    assert dx.dtype == dw.dtype == torch.bfloat16
    assert torch.equal(dx, gemm.mm(dy, w.detach()).bfloat16())
    assert torch.equal(dw, gemm.mm(dy.mT, x.detach()).bfloat16())


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("k_major", [False, True])
def test_a_grouped_call_is_the_per_group_gemm_forward_and_backward(dtype, k_major):
    """Groups of any size (empty, one row, odd), each row and each weight gradient bit for bit what `linear`
    gives on that group alone, with the gradient in the weight's own layout."""
    gen = torch.Generator().manual_seed(5)
    sizes = [0, 1, 37, 0, 130, 6, 65]
    x = (torch.randn(sum(sizes), 96, generator=gen) * 0.3).to(dtype).requires_grad_()
    w = (torch.randn(len(sizes), 80, 96, generator=gen) * 0.1).to(dtype)
    w = (w.mT.contiguous().mT if k_major else w).requires_grad_()
    dy = (torch.randn(sum(sizes), 80, generator=gen) * 0.1).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    y = gemm.grouped_linear(x, w, offsets)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert dw.stride() == w.stride()
    for e, (lo, hi) in enumerate(zip(offsets.tolist(), offsets.tolist()[1:])):
        xe = x.detach()[lo:hi].requires_grad_()
        we = w.detach()[e].requires_grad_()
        ye = linear(xe, we)
        assert torch.equal(y[lo:hi], ye), f"group {e}"
        dxe, dwe = torch.autograd.grad(ye, (xe, we), dy[lo:hi]) if hi > lo else (dx[lo:hi], torch.zeros_like(we))
        assert torch.equal(dx[lo:hi], dxe) and torch.equal(dw[e], dwe), f"group {e} gradient"


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 512, 64), (70, 256, 130), (33, 1024, 512)])
def test_a_chunked_call_is_its_chunks_gemms_summed_in_order(dtype, m, k, n):
    """One call for a row-parallel layer's K chunks: the fp32 GEMM of each chunk, added in chunk order, rounded
    once; its backward is the GEMM of the whole operands (each column of dx belongs to one chunk)."""
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(n, k, generator=gen).to(dtype).requires_grad_()
    out = gemm.chunked_linear(x, w, 4)
    parts = [linear(xc, wc, torch.float32) for xc, wc in zip(x.detach().chunk(4, -1), w.detach().chunk(4, -1))]
    expected = (((parts[0] + parts[1]) + parts[2]) + parts[3]).to(dtype)
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       expected.view(torch.int16 if dtype != torch.float32 else torch.int32))
    dy = torch.randn(m, n, generator=gen).to(dtype)
    dx, dw = torch.autograd.grad(out, (x, w), dy)
    assert torch.equal(dx, gemm.mm(dy, w.detach(), out_dtype=dtype))
    assert torch.equal(dw, gemm.mm(dy.mT, x.detach(), out_dtype=dtype))


def test_a_tier_the_cpu_cannot_run_is_one_line(monkeypatch):
    monkeypatch.setenv("LOGDIFF_GEMM_TIER", "avx1024")
    gemm.tiers.cache_clear()
    try:
        with pytest.raises(gemm.UserError, match="LOGDIFF_GEMM_TIER=avx1024 does not run on this CPU; choose one of"):
            gemm.tiers()
    finally:
        monkeypatch.delenv("LOGDIFF_GEMM_TIER")
        gemm.tiers.cache_clear()


def test_a_bf16_tier_takes_bf16_operands_only():
    for tier in set(gemm.tiers_here()) & set(gemm.BF16_TIERS):
        with pytest.raises(RuntimeError, match="the bf16 tiers take bfloat16 operands only"):
            gemm.mm(torch.ones(2, 3), torch.ones(3, 4), tier)


def test_a_machine_without_a_compiler_gets_one_line(tmp_path):
    """A fresh cache and no c++ on PATH: the first GEMM says what is missing and how to get it, no traceback."""
    env = {**os.environ, "LOGDIFF_CACHE": str(tmp_path), "PATH": str(tmp_path)}
    probe = "from logdiff.cli.main import main; raise SystemExit(main(['run', '--max-new-tokens', '1', '--batch-size', '1']))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "this machine has no c++; install a C++ compiler and ninja" in out.stderr + out.stdout


def test_a_build_that_was_killed_leaves_nothing_that_blocks_the_next(tmp_path):
    """What a killed build of torch's extension loader leaves (its lock files, an unfinished object) in
    the cache must not make the next process wait or load half a library."""
    env = {**os.environ, "LOGDIFF_CACHE": str(tmp_path)}
    probe = "from logdiff.kernels import gemm; print(gemm.tiers()['bf16'])"
    folder = Path(subprocess.run([sys.executable, "-c", "from logdiff.kernels import gemm; print(gemm.cache_dir())"],
                                 env=env, capture_output=True, text=True, check=True).stdout.strip())
    for leftover in (folder / "lock", folder / ".ninja_lock", folder / ".build-killed" / "lock"):
        leftover.parent.mkdir(parents=True, exist_ok=True)
        leftover.touch()
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] in gemm.TIERS
    assert (folder / "logdiff_gemm.so").exists()
