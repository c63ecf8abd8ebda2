"""The linear layers: logdiff's fixed-order GEMM for the reference, torch's native GEMM for what is unaligned.

`linear` is `gemm.linear`: one fp32 accumulator per output element, the products over K in ascending
order, one rounding to the model dtype; by construction a row's bits do not depend on how many rows share
the call, on the thread count or on the weight's layout (see gemm.py). Nothing is measured or padded.

`plain_linear` is what torch does: oneDNN/MKL choose a kernel, and so a reduction order, by shape (GEMV for
one row, other tiles for a few rows, AMX or AVX512-BF16 blocking that follows M). bf16 runs natively where
oneDNN has bf16 instructions; fp16 (no fast fp16 GEMM on x86: ~5x slower) and bf16 elsewhere run as an fp32
GEMM on upcast operands. Rounded once to the model dtype either way.
"""

import torch

from logdiff.kernels.gemm import chunked_linear, linear, weight_layout

__all__ = ["linear", "plain_linear", "row_tiled_linear", "split_k_linear", "weight_layout", "native_gemm_dtype",
           "fixed_order_row_linear", "sum_in_order"]


def native_gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's fastest GEMM for a model in `dtype` runs in on this CPU."""
    native_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype if dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16) else torch.float32


def plain_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [.., N, in] @ w [.., out, in].T through torch's GEMM: the reduction order follows N (GEMV for one row)."""
    compute = native_gemm_dtype(x.dtype)
    return torch.matmul(x.to(compute), w.to(compute).mT).to(x.dtype)


def row_tiled_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`linear` as a GEMM tiled over rows computes it when its kernel for a lone last row differs: rows go
    in pairs, and with an odd number of rows the last one reduces K as two halves added in fp32. A row's
    bits then follow the shape of the call, on every CPU: the order alignment switched off for certain,
    where torch's GEMM (`plain_linear`) only does so on the shapes its library happens to tile that way."""
    even = linear(x, w)
    if x.shape[-2] % 2 == 0:
        return even
    return torch.cat([even[..., :-1, :], split_k_linear(x[..., -1:, :], w)], dim=-2)


def split_k_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`linear` with K reduced as two halves added in fp32, rounded once: another fixed order, not `linear`'s."""
    half = x.shape[-1] // 2
    parts = [linear(x[..., k], w[..., k], torch.float32) for k in (slice(None, half), slice(half, None))]
    return (parts[0] + parts[1]).to(x.dtype)


# The GEMM each linear runs on, as reports name it (KernelSet.provenance); logdiff GEMM tiers are in the platform.
plain_linear.gemm_backend = "torch.matmul (MKL / oneDNN: the library picks the reduction per shape)"
row_tiled_linear.gemm_backend = "logdiff GEMM, a call's lone last row reduced as two K halves (order alignment off)"


# Row-parallel GEMMs (o_proj, down_proj) split K into this many chunks whatever the parallel degree:
# every supported degree (1, 2, 4) divides it, and a rank holds REDUCE_CHUNKS / degree whole chunks.
REDUCE_CHUNKS = 4


def fixed_order_row_linear(x: torch.Tensor, w: torch.Tensor, comm) -> torch.Tensor:
    """x [N, K/size] @ w[out, K/size].T summed over the ranks of `comm` in an order that does not depend on
    their number: a partial GEMM per fixed K chunk (REDUCE_CHUNKS of them over the whole K), the partials
    of all ranks gathered in chunk order, then added one after the other in fp32 and rounded once. One
    process (size 1) computes the very same chunks in one call (`chunked_linear`), so TP1, TP2 and TP4 give
    the same bits."""
    local = REDUCE_CHUNKS // comm.size
    if local * comm.size != REDUCE_CHUNKS or x.shape[-1] % local:
        raise ValueError(f"K {x.shape[-1] * comm.size} does not split into {REDUCE_CHUNKS} chunks over {comm.size} ranks")
    if comm.size == 1:
        return chunked_linear(x, w, REDUCE_CHUNKS)
    width = x.shape[-1] // local
    # Column slices of x and w, not copies: the GEMM reads strided operands as they are.
    parts = [linear(x[:, c * width:(c + 1) * width], w[:, c * width:(c + 1) * width], torch.float32) for c in range(local)]
    return sum_in_order(comm.all_gather(torch.stack(parts))).to(x.dtype)  # [REDUCE_CHUNKS, N, out], chunk order


def sum_in_order(partials: torch.Tensor) -> torch.Tensor:
    """partials[0] + partials[1] + ... added one after the other: an order no thread count or degree changes."""
    acc = partials[0]
    for part in partials[1:]:
        acc = acc + part
    return acc
