"""Batch-invariant linear layer: a row's result may not depend on how many rows share the GEMM.

MKL picks a different micro-kernel, and so a different reduction order along K, for skinny GEMMs:
here (AVX-512, AMX) fp32 `x[:m] @ W` differs from `(x @ W)[:m]` for some m below 16 on some shape of
the named configs, on AVX2 machines for m <= 3; and below 16 rows the bits also follow the weight's
layout (NN or NT). From MIN_ROWS rows on every row comes out the same whatever M and the layout are
(checked for every GEMM shape of the named configs, M up to 3000, 1 and 2 threads), so skinny calls
(decode, small experts) are zero-padded up to `min_rows(dtype)` rows. oneDNN's native bf16 GEMM (AVX512-BF16,
no AMX) differs only for m = 1 (at K = 2048), in F.linear and in bmm alike, so there 2 rows suffice.
AMX machines run another, unchecked bf16 kernel, so they keep the checked fp32 path. On a memory-bound
GEMV the extra rows cost almost nothing: the weights are read once either way; 64 experts padded to 16 rows each do cost compute.

Precision: every GEMM accumulates in fp32 and rounds its result once to the input dtype. bf16 runs
as oneDNN's native bf16 GEMM where the CPU has bf16 dot-product instructions and no AMX (measured on AVX512-BF16:
~2x an fp32 GEMM, and no upcast copy of x or W); elsewhere, and for fp16 (no native fp16 GEMM on
x86: ~5x slower than an upcast), as an fp32 GEMM on upcast operands.
"""

import torch
import torch.nn.functional as F

MIN_ROWS = 16
MIN_ROWS_NATIVE_BF16 = 2

_AMX = torch.cpu._is_amx_tile_supported() if hasattr(torch.cpu, "_is_amx_tile_supported") else True
NATIVE_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() and not _AMX


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the GEMMs of a model in `dtype` read their weights in."""
    return dtype if dtype == torch.float32 or (dtype == torch.bfloat16 and NATIVE_BF16) else torch.float32


def min_rows(dtype: torch.dtype) -> int:
    """Rows from which a GEMM of inputs in `dtype` gives every row the same bits whatever M is."""
    return MIN_ROWS_NATIVE_BF16 if gemm_dtype(dtype) == torch.bfloat16 else MIN_ROWS


def _gemm(x: torch.Tensor, w: torch.Tensor, keep: bool = False) -> torch.Tensor:
    """keep: the result in the GEMM's own dtype (fp32 unless native bf16), not rounded to x's."""
    compute = gemm_dtype(x.dtype)
    out = F.linear(x.to(compute), w.to(compute))
    return out if keep else out.to(x.dtype)


def _padded_gemm(x: torch.Tensor, w: torch.Tensor, keep: bool = False) -> torch.Tensor:
    rows = x.shape[0]
    out = F.linear(_padded_rows(x), w.to(gemm_dtype(x.dtype)))[:rows]
    return out if keep else out.to(x.dtype)


def _padded_rows(x: torch.Tensor) -> torch.Tensor:
    """x in the GEMM dtype with zero rows up to `min_rows`: one copy of x, not a pad then an upcast."""
    rows, needed, compute = x.shape[0], min_rows(x.dtype), gemm_dtype(x.dtype)
    if rows >= needed:
        return x.to(compute)
    padded = x.new_zeros((needed, x.shape[1]), dtype=compute)
    padded[:rows] = x
    return padded


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, in] @ w[out, in].T, invariant to N."""
    return _padded_gemm(x, w)


def plain_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same GEMM without the padding: the reduction order follows N (GEMV for one row)."""
    return _gemm(x, w)


# Row-parallel GEMMs (o_proj, down_proj) split K into this many chunks whatever the parallel degree:
# every supported degree (1, 2, 4) divides it, and a rank holds REDUCE_CHUNKS / degree whole chunks.
REDUCE_CHUNKS = 4


def fixed_order_row_linear(x: torch.Tensor, w: torch.Tensor, comm) -> torch.Tensor:
    """x [N, K/size] @ w[out, K/size].T summed over the ranks of `comm` in an order that does not depend on
    their number: a partial GEMM per fixed K chunk (REDUCE_CHUNKS of them over the whole K), the partials
    of all ranks gathered in chunk order, then added one after the other in fp32 and rounded once. One
    process (size 1) computes the very same chunks, so TP1, TP2 and TP4 give the same bits."""
    local = REDUCE_CHUNKS // comm.size
    if local * comm.size != REDUCE_CHUNKS or x.shape[-1] % local:
        raise ValueError(f"K {x.shape[-1] * comm.size} does not split into {REDUCE_CHUNKS} chunks over {comm.size} ranks")
    # Column slices of the padded x and of w, not copies: a GEMM reads a strided operand as it is.
    padded, w = _padded_rows(x), w.to(gemm_dtype(x.dtype))
    width = x.shape[-1] // local
    parts = [F.linear(padded[:, c * width:(c + 1) * width], w[:, c * width:(c + 1) * width])[: x.shape[0]].float()
             for c in range(local)]
    return sum_in_order(comm.all_gather(torch.stack(parts))).to(x.dtype)  # [REDUCE_CHUNKS, N, out], chunk order


def sum_in_order(partials: torch.Tensor) -> torch.Tensor:
    """partials[0] + partials[1] + ... added one after the other: an order no thread count or degree changes."""
    acc = partials[0]
    for part in partials[1:]:
        acc = acc + part
    return acc
