"""The capture hook for transformers models: forward hooks that report logdiff's capture points.

module (Qwen3 / Qwen3-MoE)                 capture point
CausalLM input `input_ids`                 tokens          (its `attention_mask` tells each row's position)
model.rotary_emb input `position_ids`      positions       (the positions RoPE really uses)
model.embed_tokens                         embedding
layers.i.input_layernorm                   layers.i.input_norm
self_attn.q_proj / k_proj / v_proj         q_proj / k_proj / v_proj
self_attn.q_norm / k_norm                  q_norm / k_norm
self_attn.o_proj input / output            attention / o_proj
post_attention_layernorm input / output    residual / post_attention_norm
mlp.gate (router) outputs                  router_logits, topk_weights, topk_ids
mlp.experts                                combine         (transformers' experts module returns the weighted sum)
mlp (dense layers)                         mlp
layers.i                                   output
model.norm / lm_head                       final_norm / logits

RoPE is a function inside the attention forward and the per-expert outputs never leave the experts
module, so `rope_q`, `rope_k` and `experts` are not captured; bisect checks the attention against
q_norm, k_norm and positions instead. Hooks exist only inside `capture_hooks`, and only when a
capture is given: without one the model runs untouched.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from logdiff.api import locate


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

    # Module outputs are [B, T, ...] (lm_head: [B, kept, V], the head rows); router and experts work on [B*T, ...].
    def point(name, packed=False):
        return lambda module, args, output: capture(name, output if packed else output.flatten(0, 1))

    def point_in(name):
        return lambda module, args: capture(name, args[0].flatten(0, 1))

    def on_rotary(module, args, kwargs, output):
        positions = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        capture("positions", positions.expand(*shape["batch"]).flatten())

    def on_router(at):
        def hook(module, args, output):
            logits, weights, ids = output
            capture(at + "router_logits", logits), capture(at + "topk_ids", ids), capture(at + "topk_weights", weights)

        return hook

    hooks = [
        model.register_forward_pre_hook(on_forward, with_kwargs=True),
        model.model.rotary_emb.register_forward_hook(on_rotary, with_kwargs=True),
        model.model.embed_tokens.register_forward_hook(point("embedding")),
        model.model.norm.register_forward_hook(point("final_norm")),
        model.lm_head.register_forward_hook(point("logits")),
    ]
    for i, layer in enumerate(model.model.layers):
        at = f"layers.{i}."
        attn = layer.self_attn
        hooks += [
            layer.input_layernorm.register_forward_hook(point(at + "input_norm")),
            *(getattr(attn, p).register_forward_hook(point(at + p)) for p in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")),
            attn.o_proj.register_forward_pre_hook(point_in(at + "attention")),
            attn.o_proj.register_forward_hook(point(at + "o_proj")),
            layer.post_attention_layernorm.register_forward_pre_hook(point_in(at + "residual")),
            layer.post_attention_layernorm.register_forward_hook(point(at + "post_attention_norm")),
            layer.register_forward_hook(point(at + "output")),
        ]
        if hasattr(layer.mlp, "experts"):
            hooks += [layer.mlp.gate.register_forward_hook(on_router(at)),
                      layer.mlp.experts.register_forward_hook(point(at + "combine", packed=True))]
        else:
            hooks.append(layer.mlp.register_forward_hook(point(at + "mlp")))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def capture_logprobs(capture, requests: list[int], positions: list[torch.Tensor], logprobs: list[torch.Tensor]) -> None:
    """The `logprob` point: logprobs[b][j] scores the token after position positions[b][j] of request requests[b]."""
    if capture is None:
        return
    request = torch.cat([torch.full((len(p),), r) for r, p in zip(requests, positions)])
    locate(capture, request, torch.cat(positions))
    capture("logprob", torch.cat(logprobs))
