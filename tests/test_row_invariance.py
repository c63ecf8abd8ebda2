"""The reductions outside the GEMM, as properties over Qwen3's shapes: a row's bits do not depend on how
many rows share the call or on the thread count (RMSNorm over every Qwen3 hidden size, the log-softmax
over Qwen3's vocabulary, SiLU x up over every intermediate size), and the one-pass C++ kernels beside the
GEMM (SiLU x up's exp, the rotary embedding). The GEMM's own property is tests/test_gemm.py's."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logdiff.kernels.activation import silu_mul
from logdiff.kernels.gemm import extension
from logdiff.kernels.logsoftmax import token_logprobs
from logdiff.kernels.norm import rms_norm, rms_norm_in_torch
from logdiff.kernels.rope import RotaryTable, rope, rope_in_torch

HIDDEN_SIZES = [1024, 2048, 2560, 4096, 5120]  # Qwen3 0.6B, 1.7B and 30B-A3B, 4B, 8B and 235B-A22B, 14B and 32B
VOCAB = 151936
# 30B-A3B's and 235B-A22B's experts, then 0.6B, 1.7B, 4B, 8B, 14B, 32B
INTERMEDIATE_SIZES = [768, 1536, 3072, 6144, 9728, 12288, 17408, 25600]


def _rows_alone_and_together(fn, x, rows, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = fn(x)[rows]
        alone = torch.cat([fn(x[i:i + 1]) for i in rows])
    finally:
        torch.set_num_threads(before)
    return together, alone


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hidden=st.sampled_from(HIDDEN_SIZES), m=st.integers(1, 4096), threads=st.sampled_from([1, 2]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), data=st.data())
def test_rms_norm_row_does_not_depend_on_the_rows_beside_it(hidden, m, threads, dtype, data):
    gen = torch.Generator().manual_seed(m + hidden)
    x = torch.randn(m, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    rows = sorted({0, m - 1, data.draw(st.integers(0, m - 1), label="row")})
    together, alone = _rows_alone_and_together(lambda t: rms_norm(t, weight, 1e-6), x, rows, threads)
    assert torch.equal(together.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       alone.view(torch.int16 if dtype != torch.float32 else torch.int32)), f"hidden {hidden} M {m}"


@pytest.mark.parametrize("hidden", [1, 31, 64, 100, 128, 1024, 2056])
def test_rms_norm_sums_squares_in_32_lanes_added_in_a_fixed_tree(hidden):
    """The order the C++ docstring states, rebuilt in fp32 torch ops one addition at a time: lane j sums the
    squares of h = j mod 32 in ascending h, the lanes are added j + 16 into j, then + 8, + 4, + 2, + 1; r is
    1 / sqrt(sum / H + eps), y = x r rounded, out = w y rounded. The kernel gives these bits."""
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=gen).mul(3).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16()
    squares = F.pad(x.float() ** 2, (0, -hidden % 32)).view(5, -1, 32)  # a padding square of +0 changes no sum
    lanes = squares[:, 0]
    for chunk in squares.unbind(1)[1:]:
        lanes = lanes + chunk
    for width in (16, 8, 4, 2, 1):
        lanes = lanes[:, :width] + lanes[:, width:2 * width]
    r = 1.0 / torch.sqrt(lanes[:, 0] / hidden + 1e-6)
    expected = weight * (x.float() * r[:, None]).bfloat16()
    assert torch.equal(rms_norm(x, weight, 1e-6).view(torch.int16), expected.view(torch.int16))


def test_rms_norm_is_torchs_within_an_ulp_and_its_backward_autograds():
    """Against torch's own RMSNorm (another summation order): within one bf16 rounding of it; the hand-written
    backward within fp32 noise of autograd through torch's ops, run in fp32."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 1024, generator=gen).mul(2)
    weight = 1 + 0.1 * torch.randn(1024, generator=gen)
    torch.testing.assert_close(rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6),
                               rms_norm_in_torch(x.bfloat16(), weight.bfloat16(), 1e-6), rtol=8e-3, atol=0)
    grad = torch.randn(64, 1024, generator=gen)
    ours = torch.autograd.grad(rms_norm(x.requires_grad_(), weight.requires_grad_(), 1e-6), (x, weight), grad)
    theirs = torch.autograd.grad(rms_norm_in_torch(x, weight, 1e-6), (x, weight), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 96), threads=st.sampled_from([1, 2]), temperature=st.sampled_from([0.0, 0.7, 1.0]),
       data=st.data())
def test_token_logprob_row_does_not_depend_on_the_rows_beside_it(m, threads, temperature, data):
    gen = torch.Generator().manual_seed(m)
    logits = 3 * torch.randn(m, VOCAB, generator=gen)
    targets = torch.randint(VOCAB, (m,), generator=gen)
    temperatures = torch.full((m,), temperature)
    rows = sorted({0, m - 1, data.draw(st.integers(0, m - 1), label="row")})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = token_logprobs(logits, targets, temperatures)[rows]
        alone = torch.cat([token_logprobs(logits[i:i + 1], targets[i:i + 1], temperatures[i:i + 1]) for i in rows])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together.view(torch.int32), alone.view(torch.int32)), f"M {m}"



@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.sampled_from(INTERMEDIATE_SIZES), m=st.integers(1, 512), threads=st.sampled_from([1, 2]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), data=st.data())
def test_silu_mul_row_does_not_depend_on_the_rows_beside_it(width, m, threads, dtype, data):
    x = torch.randn(m, 2, width, generator=torch.Generator().manual_seed(m + width)).mul(4).to(dtype)
    rows = sorted(set(data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=4))))
    together, alone = _rows_alone_and_together(lambda t: silu_mul(t[:, 0], t[:, 1]), x, rows, threads)
    assert torch.equal(together, alone)


def test_silu_mul_backward_is_the_derivative_of_its_forward():
    """The hand-written backward: d up is the gradient times the very silu the forward multiplied by, d gate
    within an ulp of autograd through torch's ops (torch's silu_backward evaluates the same derivative in
    another order)."""
    gen = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(300, 768, generator=gen).mul(4).bfloat16().requires_grad_() for _ in range(2))
    grad = torch.randn(300, 768, generator=gen).bfloat16()
    silu = extension().silu(gate.detach())
    assert torch.equal(silu_mul(gate, up), (silu * up.float()).bfloat16())
    g = gate.float()
    by_autograd = torch.autograd.grad((g / (1.0 + torch.exp(-g)) * up.float()).bfloat16(), (gate, up), grad)
    d_gate, d_up = torch.autograd.grad(silu_mul(gate, up), (gate, up), grad)
    assert torch.equal(d_up, (grad.float() * silu).bfloat16())
    torch.testing.assert_close(d_gate, by_autograd[0], rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_element_gets_the_same_bits_in_the_vector_body_and_the_scalar_tail(dtype):
    """Laid out as one long row, the elements go through this CPU's vector loop (AVX-512 or AVX2); as a column,
    each is a row of one, the scalar tail. Every element gets the same bits either way, specials included."""
    gen = torch.Generator().manual_seed(9)
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.7, -88.7, 89.5, -103.9, -104.5, -200.0,
               200.0, 1e-40, -1e-40, 1e-3, -3e4]
    gate = torch.cat([torch.tensor(special), torch.randn(4000, generator=gen) * 12]).to(dtype)
    up = torch.cat([torch.tensor(special[::-1]), torch.randn(4000, generator=gen)]).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    row = silu_mul(gate[None, :], up[None, :])[0]
    column = silu_mul(gate[:, None], up[:, None])[:, 0]
    assert torch.equal(row.view(bits), column.view(bits))
    assert torch.equal(extension().silu(gate[None, :])[0].view(torch.int32),
                       extension().silu(gate[:, None])[:, 0].view(torch.int32))


def test_silu_muls_exp_is_within_two_ulp_of_the_true_exp():
    """The C++ exp the activation is built from, against exp in fp64 at 2M points from underflow to
    overflow, and its edges exactly."""
    x = torch.linspace(-105, 90, 2_000_001, dtype=torch.float64).float()
    ours, true = extension().exp(x).double(), torch.exp(x.double())
    rounded = true.float()
    normal = torch.isfinite(rounded) & (rounded.abs() >= torch.finfo(torch.float32).tiny)
    ulp = (torch.nextafter(rounded, torch.tensor(float("inf"))) - rounded).double()
    worst = ((ours - true).abs() / ulp)[normal].max().item()
    assert worst <= 2, f"exp is {worst:.2f} ulp off"
    subnormal = (rounded.abs() < torch.finfo(torch.float32).tiny)
    assert ((ours - true).abs()[subnormal] <= 2 ** -149).all(), "exp is more than one subnormal step off"
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 88.72283935546875, 88.72283172607422, -104.0])
    assert extension().exp(edges).tolist() == [1.0, 1.0, float("inf"), 0.0, float("inf"),
                                                torch.exp(edges[5].double()).float().item(), 0.0]
    assert extension().exp(torch.tensor([float("nan")])).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 1, 64), (37, 8, 128), (300, 16, 128)])
def test_the_one_pass_rope_is_the_torch_rope_bit_for_bit(dtype, tokens, heads, head_dim):
    """The C++ rotation makes the same two fp32 products and one sum per element as the torch ops, vector body
    and tail alike, on a contiguous x and on a head slice of a fused projection; its backward is the rotation's
    transpose (autograd through the torch ops, to an ulp of the fp32 sum's order)."""
    gen = torch.Generator().manual_seed(tokens + heads)
    table = RotaryTable(head_dim, 1e6, 4096)
    cos, sin = table.at(torch.randint(0, 4096, (tokens,), generator=gen))
    fused = torch.randn(tokens, 2 * heads, head_dim, generator=gen).to(dtype)
    view = torch.int32 if dtype == torch.float32 else torch.int16
    for x in (fused[:, :heads].contiguous(), fused[:, heads:]):
        assert torch.equal(rope(x, cos, sin).view(view), rope_in_torch(x, cos, sin).view(view))
    x = fused[:, :heads].contiguous().requires_grad_()
    g = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    ours = torch.autograd.grad(rope(x, cos, sin), x, g)[0]
    theirs = torch.autograd.grad(rope_in_torch(x, cos, sin), x, g)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-6)
