"""Causal GQA attention for the trainer, the rollout prefill and the rollout decode, as ONE block loop.

Every path lays its queries out as rows [kv_head, sequence, row, head_dim] and its keys as cache
slots, then calls `_attend`: an online softmax over KV blocks of `KV_BLOCK` positions counted from
each sequence's position 0 (running max, rescale, running sum, fp32 accumulators). A query therefore
meets the same blocks, in the same order, with the same arithmetic, whether the trainer scores the
whole sequence at once or the rollout engine decodes it one token at a time against a paged cache.

Its reductions: QKᵀ and P·V are logdiff's GEMM (`gemm.matmul`, K reduced in one fixed order whatever
the rows); a block's row max (exact in any order) and row sum of P over KV_BLOCK keys (128, one
vectorised pass in torch, below any thread split); the merge of blocks in ascending block order.

The four alignments of the Ascend method are the fields of `Alignments`; each is read in one place:
  mask      `train_attention`: the trainer covers each sequence's own positions and selects -inf for
            masked scores. Off: sequences are left-padded into one buffer with an additive mask
            (mask x -3e38), so KV blocks start at the buffer's position 0, not the sequence's.
  order     `decode_attention`: one pass over the whole KV range. Off: decode splits the KV range into
            a batch- and length-dependent number of partitions merged by log-sum-exp (flash-decoding).
  blocks    `_rollout_block`: the rollout merges blocks of KV_BLOCK like the trainer. Off: blocks of 64.
  precision `_rollout_p_dtype`: P stays fp32 before P.V on both sides. Off: the rollout rounds P to the
            model dtype first, as inference kernels that feed P to a low-precision GEMM do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from logdiff.batch import SeqBatch
from logdiff.kernels.gemm import matmul

KV_BLOCK = 128  # the Ascend kernels' KV block
UNALIGNED_ROLLOUT_BLOCK = 64
ADDITIVE_MASK = -3e38
FLASH_DECODING_WORKERS = 16  # split-KV fills this many (sequence, kv-head) workers


@dataclass(frozen=True)
class Alignments:
    mask: bool = True
    order: bool = True
    blocks: bool = True
    precision: bool = True
    # Reductions over ranks in an order fixed whatever the degree: row-parallel GEMMs by K chunk
    # (linear.fixed_order_row_linear), the log-softmax's sum of exp by vocabulary part (logsoftmax.fixed_order_token_logprobs).
    reduce_order: bool = True


# --------------------------------------------------------------------------- the block loop


def _attend(q, q_pos, k, v, slots, *, block, splits=1, additive_mask=False, key_start=None, p_dtype=None):
    """Attention of query rows over cache slots.

    q      [Hkv, S, M, d] fp32, already scaled; rows of one sequence are ordered by position
    q_pos  [S, M] position of each row
    k, v   [Hkv, num_slots, d] keys/values in the model dtype
    slots  [S, L] slot of each key position 0..L-1 (L a multiple of `block`)
    """
    num_blocks = slots.shape[1] // block
    bounds = [round(i * num_blocks / splits) for i in range(splits + 1)]
    parts = [
        _online_softmax(q, q_pos, k, v, slots, range(lo, hi), block, additive_mask, key_start, p_dtype)
        for lo, hi in zip(bounds, bounds[1:])
    ]
    if len(parts) == 1:
        m, l, acc = parts[0]
        return acc.div_(l[..., None]) if not torch.is_grad_enabled() else acc / l[..., None]
    m_all = torch.stack([m for m, _, _ in parts]).amax(0)
    m_ref = torch.where(m_all == -math.inf, 0.0, m_all)
    scale = [torch.exp(m - m_ref) for m, _, _ in parts]
    l_all = sum(l * s for (_, l, _), s in zip(parts, scale))
    acc_all = sum(acc * s[..., None] for (_, _, acc), s in zip(parts, scale))
    return acc_all / l_all[..., None]


def _online_softmax(q, q_pos, k, v, slots, block_ids, block, additive_mask, key_start, p_dtype):
    m = q.new_full(q.shape[:-1], -math.inf)
    l = q.new_zeros(q.shape[:-1])
    # acc is all +0 until the first block, whose update 0 * alpha + P.V is P.V + 0 (the same bits: IEEE's
    # x + 0 is x, and turns -0 into +0 as 0 + -0 does): None until then, so that no zero buffer is filled,
    # scaled and added.
    acc = None
    # Rows whose position precedes a block take no part in it: a fully masked block would leave
    # their state bit-for-bit unchanged, so skipping it is exact. Rows stay in position order, so
    # the rows a block still needs are a suffix; the GEMMs' bits do not depend on how many there are.
    done_m, done_l, done_acc = [], [], []
    # Without autograd (inference, BlockAttention's forward) the scores are overwritten in place: the same
    # ops, so the same bits, without a new [rows, block] buffer per step.
    inplace = not torch.is_grad_enabled()
    first = 0
    # Rows that may be dropped. A decode step's rows share their sequence's one position (q_pos expanded), which
    # lies in the last block: none precedes a block, so the count is skipped.
    spare = 0 if q_pos.stride(-1) == 0 else q.shape[2] - 1
    for j in block_ids:
        needed = min(int((q_pos < j * block).sum(1).min()), spare) if spare > first else first
        if needed > first:
            cut = needed - first
            done_m.append(m[..., :cut]), done_l.append(l[..., :cut])
            done_acc.append(q.new_zeros(*q.shape[:2], cut, q.shape[-1]) if acc is None else acc[..., :cut, :])
            m, l = m[..., cut:], l[..., cut:]
            acc = None if acc is None else acc[..., cut:, :]
            first = needed
        block_slots = slots[:, j * block : (j + 1) * block]
        kb, vb = _gather_block(k, block_slots), _gather_block(v, block_slots)
        s = matmul(q[:, :, first:], kb.transpose(-1, -2))  # [Hkv, S, rows, block]
        s = _masked_scores(s, q_pos[:, first:], slice(j * block, (j + 1) * block), key_start, additive_mask, inplace)
        m_new = torch.maximum(m, s.amax(-1)).detach()  # a shift, not a function of the scores
        # exp(-inf - m_ref) is exactly 0, so selected-out scores contribute nothing; m_ref keeps
        # rows that have seen no valid key yet (split-KV partitions) from computing -inf - -inf.
        m_ref = torch.where(m_new == -math.inf, 0.0, m_new)
        p = s.sub_(m_ref[..., None]).exp_() if inplace else torch.exp(s - m_ref[..., None])
        alpha = torch.exp(m - m_ref)
        l = l * alpha + p.sum(-1)
        if p_dtype is not None:
            p = p.to(p_dtype)
        pv = matmul(p, vb)
        if acc is None:
            acc = pv.add_(0.0) if inplace else pv + 0.0
        else:
            acc = acc.mul_(alpha[..., None]).add_(pv) if inplace else acc * alpha[..., None] + pv
        m = m_new
    if acc is None:
        acc = torch.zeros_like(q[..., first:, :])
    if done_m:
        m = torch.cat(done_m + [m], dim=-1)
        l = torch.cat(done_l + [l], dim=-1)
        acc = torch.cat(done_acc + [acc], dim=-2)
    return m, l, acc


class BlockAttention(torch.autograd.Function):
    """`_attend` (one pass, no splits) with FlashAttention-2's backward: the forward runs the very same
    block loop (so the same bits) and keeps only the output and each row's log-sum-exp; the backward
    recomputes every block's probabilities P = exp(S - lse) and accumulates dQ, dK, dV block after block
    in a fixed order (fp32, no atomics, no thread-dependent reduction: deterministic). Autograd through
    the loop instead keeps every block's scores and rescale factors and, for each block, zero-fills a
    gradient of the whole key buffer."""

    @staticmethod
    def forward(ctx, q, q_pos, k, v, slots, block, additive_mask, key_start):
        num_blocks = slots.shape[1] // block
        m, l, acc = _online_softmax(q, q_pos, k, v, slots, range(num_blocks), block, additive_mask, key_start, None)
        out = acc / l[..., None]
        m_ref = torch.where(m == -math.inf, 0.0, m)
        # A row that saw no key (l = 0) takes no gradient: lse = +inf makes every recomputed P exactly 0.
        lse = torch.where(l > 0, m_ref + torch.log(l), math.inf)
        ctx.save_for_backward(q, q_pos, k, v, slots, key_start, out, lse)
        ctx.block, ctx.additive_mask = block, additive_mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, q_pos, k, v, slots, key_start, out, lse = ctx.saved_tensors
        block = ctx.block
        heads, num_seqs, _, head_dim = q.shape
        width = slots.shape[1]
        dout = dout.float()
        delta = (dout * out).sum(-1)  # rowsum(dO * O) = rowsum(P * dP)
        dq = torch.zeros_like(q)
        dk_pos = q.new_zeros(heads, num_seqs, width, head_dim)  # per (sequence, key position); each written once
        dv_pos = torch.zeros_like(dk_pos)
        for j in range(width // block):
            cols = slice(j * block, (j + 1) * block)
            first = int((q_pos < j * block).sum(1).min())  # rows before `first` see nothing of this block
            qr, do = q[:, :, first:], dout[:, :, first:]
            block_slots = slots[:, cols]
            kb = _gather_block(k, block_slots).float()
            vb = _gather_block(v, block_slots).float()
            s = _masked_scores(qr @ kb.transpose(-1, -2), q_pos[:, first:], cols, key_start, ctx.additive_mask, True)
            p = torch.exp(s - lse[..., first:, None])
            dv_pos[:, :, cols] = p.transpose(-1, -2) @ do
            ds = p * (do @ vb.transpose(-1, -2) - delta[..., first:, None])
            dq[:, :, first:] += ds @ kb
            dk_pos[:, :, cols] = ds.transpose(-1, -2) @ qr
        flat = slots.flatten()
        dk = k.new_zeros(k.shape, dtype=torch.float32).index_add_(1, flat, dk_pos.view(heads, -1, head_dim))
        dv = v.new_zeros(v.shape, dtype=torch.float32).index_add_(1, flat, dv_pos.view(heads, -1, head_dim))
        return dq, None, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _gather_block(x, block_slots):
    """x [Hkv, num_slots, d] at block_slots [S, block] -> [Hkv, S, block, d], the model dtype (the GEMM widens it
    exactly). index_select copies whole rows: a decode step's block 13 -> 6 us, at batch 8 79 -> 15 us, against
    advanced indexing's element-wise gather; the same values."""
    return x.index_select(1, block_slots.flatten()).view(x.shape[0], *block_slots.shape, x.shape[-1])


def _masked_scores(s, q_pos, cols: slice, key_start, additive_mask, inplace):
    """Scores of keys at positions `cols` with causal (and key_start) masking applied, as the forward does
    (`inplace`: into s)."""
    keys = torch.arange(cols.start, cols.stop)
    valid = keys <= q_pos[:, :, None]  # [S, rows, block]
    if key_start is not None:
        valid = valid & (keys >= key_start[:, None, None])
    if additive_mask:
        return s.add_((~valid) * ADDITIVE_MASK) if inplace else s + (~valid) * ADDITIVE_MASK
    return s.masked_fill_(~valid, -math.inf) if inplace else s.masked_fill(~valid, -math.inf)


# --------------------------------------------------------------------------- the three paths


def train_attention(q, k, v, seqs: SeqBatch, align: Alignments, block: int = KV_BLOCK, recompute: bool = True) -> torch.Tensor:
    """Teacher-forced attention of whole sequences over themselves: q [N, Hq, d], k/v [N, Hkv, d] packed.

    `recompute`: differentiate with `BlockAttention`'s backward (scores recomputed block by block from the
    saved log-sum-exp); False: autograd through the block loop, as a straightforward implementation does."""
    left_padded = not align.mask
    index = seqs.padded_index(left=left_padded)
    buffer_len = index.shape[1]
    # In the buffer, row t is position t (right-padded) or position t - pad (left-padded).
    q_pos = torch.arange(buffer_len).expand(seqs.num_seqs, buffer_len)
    key_start = (buffer_len - seqs.lengths) if left_padded else None
    slots = _pad_to_blocks(index, block, fill=seqs.num_tokens)
    rows, row_pos = _query_rows(q, index, q_pos, k.shape[1])
    keys, values = _slot_major(k), _slot_major(v)
    if recompute and torch.is_grad_enabled() and (rows.requires_grad or keys.requires_grad or values.requires_grad):
        out = BlockAttention.apply(rows, row_pos, keys, values, slots, block, not align.mask, key_start)
    else:
        out = _attend(rows, row_pos, keys, values, slots, block=block, additive_mask=not align.mask, key_start=key_start)
    return _unpack_rows(out, index, q)


def prefill_attention(q, k_cache, v_cache, seqs: SeqBatch, slots, align: Alignments, block=None) -> torch.Tensor:
    """Prompt (or prompt chunk) tokens against the paged cache that already holds their keys."""
    return _rollout(q, k_cache, v_cache, seqs, slots, align, block or _rollout_block(align), splits=1)


def decode_attention(q, k_cache, v_cache, seqs: SeqBatch, slots, align: Alignments, block=None) -> torch.Tensor:
    """One new token per sequence against the paged cache."""
    block = block or _rollout_block(align)
    splits = 1
    if not align.order:
        num_blocks = -(-slots.shape[1] // block)
        splits = max(1, min(num_blocks, FLASH_DECODING_WORKERS // (seqs.num_seqs * k_cache.shape[0])))
    return _rollout(q, k_cache, v_cache, seqs, slots, align, block, splits)


def rollout_attention(q, k_cache, v_cache, seqs: SeqBatch, slots, align: Alignments, block=None) -> torch.Tensor:
    path = decode_attention if seqs.is_decode else prefill_attention
    return path(q, k_cache, v_cache, seqs, slots, align, block)


def _rollout(q, k_cache, v_cache, seqs, slots, align, block, splits):
    if seqs.is_decode:
        rows, row_pos = _decode_rows(q, seqs.starts, k_cache.shape[0])
    else:
        index = seqs.padded_index()
        q_pos = seqs.starts[:, None] + torch.arange(index.shape[1])
        rows, row_pos = _query_rows(q, index, q_pos, k_cache.shape[0])
    out = _attend(
        rows, row_pos, k_cache, v_cache, _pad_to_blocks(slots, block, fill=0),
        block=block, splits=splits, p_dtype=_rollout_p_dtype(align, q.dtype),
    )
    return _unpack_decode_rows(out, q) if seqs.is_decode else _unpack_rows(out, index, q)


def _rollout_block(align: Alignments) -> int:
    return KV_BLOCK if align.blocks else UNALIGNED_ROLLOUT_BLOCK


def _rollout_p_dtype(align: Alignments, model_dtype):
    return None if align.precision else model_dtype


# --------------------------------------------------------------------------- layout helpers


def _slot_major(x):
    """Packed [N, H, d] -> [H, N + 1, d]: slot N is a zero key for padding positions."""
    return F.pad(x, (0, 0, 0, 0, 0, 1)).transpose(0, 1).contiguous()


def _pad_to_blocks(slots, block, fill):
    return F.pad(slots, (0, -slots.shape[1] % block), value=fill)


def _query_rows(q, index, q_pos, num_kv_heads):
    """Packed q [N, Hq, d] -> scaled fp32 rows [Hkv, S, T*g, d] and their positions [S, rows].

    A sequence's rows run position-major (all query heads of a KV head for position t, then t+1).
    """
    num_seqs, width = index.shape
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // num_kv_heads
    padded = F.pad(q, (0, 0, 0, 0, 0, 1))[index]  # [S, T, Hq, d]
    rows = padded.view(num_seqs, width, num_kv_heads, group, head_dim).permute(2, 0, 1, 3, 4)
    # widened and laid out in one copy, then scaled in place: the bits of `.float() * scale`
    rows = rows.to(torch.float32, memory_format=torch.contiguous_format, copy=True).mul_(head_dim**-0.5)
    rows = rows.view(num_kv_heads, num_seqs, width * group, head_dim)
    return rows, q_pos.repeat_interleave(group, dim=1)


def _decode_rows(q, starts, num_kv_heads):
    """`_query_rows` for one token per sequence, without the padded index: the same rows, same values."""
    num_seqs, heads, head_dim = q.shape
    group = heads // num_kv_heads
    rows = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).contiguous().float() * head_dim**-0.5
    return rows, starts[:, None].expand(num_seqs, group)


def _unpack_decode_rows(out, q):
    """`_unpack_rows` for one token per sequence."""
    group = q.shape[1] // out.shape[0]
    return out[:, :, :group].transpose(0, 1).reshape(q.shape).to(q.dtype)


def _unpack_rows(out, index, q):
    """Rows [Hkv, S, rows, d] fp32 -> packed [N, Hq, d] in q's dtype."""
    num_seqs, width = index.shape
    num_kv_heads, head_dim = out.shape[0], out.shape[-1]
    group = q.shape[1] // num_kv_heads
    out = out[:, :, : width * group].reshape(num_kv_heads, num_seqs, width, group, head_dim)
    out = out.permute(1, 2, 0, 3, 4).reshape(num_seqs * width, q.shape[1], head_dim)
    real = (index.flatten() < q.shape[0]).nonzero().squeeze(1)
    return out[real].to(q.dtype)
