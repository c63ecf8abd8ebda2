"""The reference kernels with exactly one alignment switched off.

Each ablation names, in its docstring and in BREAKS_ON (BREAKS_C8_ON for the parallel ones), a standard
workload on which it loses bitwise parity; the test suite runs it there and requires the failure, which shows that the
alignment is necessary, not decoration.
"""

from logdiff.kernels import Alignments, reference_kernels


def reference_no_mask():
    """reference with the mask alignment off: breaks on mixed prompt lengths in one batch (prompts 5 and 200).

    The trainer left-pads the 13-token sequence into a 208-token buffer with an additive mask, so its
    keys sit at buffer positions 195..207 and its KV block boundaries are the buffer's, not its own.
    """
    return reference_kernels(Alignments(mask=False), name="reference-no-mask")


def reference_no_order():
    """reference with the order alignment off: breaks on one request decoding alone (batch 1, prompt 200).

    Its GEMMs are tiled over rows with a different reduction for a lone last row (`row_tiled_linear`):
    a decode step's single row is such a row, the trainer's 208 rows are not; and flash-decoding splits
    the 2-block KV range in two partitions merged by log-sum-exp.
    """
    return reference_kernels(Alignments(order=False), name="reference-no-order")


def reference_no_blocks():
    """reference with the blocks alignment off: breaks once a context exceeds 64 tokens (prompt 100).

    The rollout merges the online softmax over 64-key blocks, the trainer over 128-key blocks: the
    running max and rescale happen at different keys.
    """
    return reference_kernels(Alignments(blocks=False), name="reference-no-blocks")


def reference_no_precision():
    """reference with the precision alignment off: breaks in bf16 (any workload); fp32 is unaffected.

    The rollout rounds the attention probabilities P to the model dtype before P.V; the trainer keeps
    them in fp32. In fp32 the rounding is the identity, so the ablation only shows in low precision.
    """
    return reference_kernels(Alignments(precision=False), name="reference-no-precision")


def reference_no_reduce_order():
    """reference with the reduce-order alignment off: breaks parallel invariance (C8) only, e.g. TP1 vs TP2.

    A row-parallel GEMM (o_proj, down_proj) runs whole on one process and as per-rank partial GEMMs
    summed by the backend's all_reduce on several: the K reduction order follows the degree. So does the
    vocab-parallel log-softmax's sum of exp (one chunked sum over the row on one process, each rank's sum
    all_reduced on several). On one process these are the plain reference GEMM and the chunked
    log-softmax, so every single-process property still holds.
    """
    return reference_kernels(Alignments(reduce_order=False), name="reference-no-reduce-order")


ABLATIONS = {
    "reference-no-mask": reference_no_mask,
    "reference-no-order": reference_no_order,
    "reference-no-blocks": reference_no_blocks,
    "reference-no-precision": reference_no_precision,
}

# Workload fields (see logdiff.workload.Workload) on which each ablation must fail.
BREAKS_ON = {
    "reference-no-mask": dict(batch_size=2, prompt_lens=(5, 200), max_new_tokens=8, stagger=0),
    "reference-no-order": dict(batch_size=1, prompt_lens=(200,), max_new_tokens=8),
    "reference-no-blocks": dict(batch_size=1, prompt_lens=(100,), max_new_tokens=8),
    "reference-no-precision": dict(dtype="bf16", batch_size=2, prompt_lens=(40, 90), max_new_tokens=8),
}

# Ablations that only show across processes: single-process properties (and C3) hold, C8 breaks.
PARALLEL_ABLATIONS = {"reference-no-reduce-order": reference_no_reduce_order}

# Workload fields and the tensor-parallel degrees that each parallel ablation must tell apart (C8).
BREAKS_C8_ON = {
    "reference-no-reduce-order": (dict(model="qwen3-dense-tiny", batch_size=2, prompt_lens=(7, 33), max_new_tokens=4), (1, 2)),
}
