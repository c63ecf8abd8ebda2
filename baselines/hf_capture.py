"""The capture hook for transformers models: forward hooks that report logdiff's capture points.

The module -> capture point table is logdiff.bisect.hooks' (shared with vLLM's worker); this file adds
the rows: CausalLM input `input_ids` -> tokens (its `attention_mask` tells each row's position), and
model.rotary_emb input `position_ids` -> positions (the positions RoPE really uses).

RoPE is a function inside the attention forward and the per-expert outputs never leave the experts
module, so `rope_q`, `rope_k` and `experts` are not captured; bisect checks the attention against
q_norm, k_norm and positions instead. Hooks exist only inside `capture_hooks`, and only when a
capture is given: without one the model runs untouched.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from logdiff.api import locate
from logdiff.bisect.hooks import attached


@contextmanager
def capture_hooks(model, capture, requests: list[int]):
    """Reports the capture points of `model`'s forwards to `capture`; batch row b is request `requests[b]`."""
    if capture is None:
        yield
        return
    shape = {}  # [B, T] of the forward in progress

    def on_forward(module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        width = ids.shape[1]
        if mask is None:  # generate drops the mask of an unpadded batch: the cache holds every earlier token
            cache = kwargs.get("cache")
            past = cache.get_seq_length() if cache is not None else 0
            mask = torch.ones(ids.shape[0], past + width, dtype=torch.long)
        position = (mask.long().cumsum(-1) - 1)[:, -width:]
        request = torch.tensor(requests)[:, None].expand_as(ids)
        request = torch.where(mask[:, -width:].bool(), request, -1)
        keep = kwargs.get("logits_to_keep", 0)
        if not isinstance(keep, int):
            raise RuntimeError("capture_hooks: logits_to_keep as a tensor is not supported")
        kept = width if keep == 0 else keep
        head = (torch.arange(ids.shape[0])[:, None] * width + torch.arange(width - kept, width)).flatten()
        shape["batch"] = ids.shape
        locate(capture, request.flatten(), position.flatten(), head)
        capture("tokens", ids.flatten())

    def on_rotary(module, args, kwargs, output):
        positions = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        capture("positions", positions.expand(*shape["batch"]).flatten())

    rotary = model.model.rotary_emb.register_forward_hook(on_rotary, with_kwargs=True)
    try:
        with attached(model, "transformers", capture, on_forward):
            yield
    finally:
        rotary.remove()

