"""Capture by forward hooks, for a torch model that logdiff did not write: one table per model family maps
its modules to logdiff's capture points, and `attach` registers them. It imports only torch, so that an
engine's own process (vLLM's worker) loads it by its file path, without logdiff installed there.

transformers (Qwen3, Qwen3-MoE)            vLLM (Qwen3, Qwen3-MoE)                   capture point
model.embed_tokens                         model.embed_tokens                        embedding
layers.i.input_layernorm                   input_layernorm (fused add: out[0])       layers.i.input_norm
q_proj / k_proj / v_proj                   qkv_proj, split q | k | v                 q_proj / k_proj / v_proj
q_norm / k_norm                            q_norm / k_norm                           q_norm / k_norm
(RoPE is a function)                       attn inputs q, k                          rope_q / rope_k
o_proj input / output                      attn output / o_proj output               attention / o_proj
post_attention_layernorm input / output    post_attention_layernorm out[1] / out[0]  residual / post_attention_norm
mlp.gate                                   mlp.gate (router logits only)             router_logits (topk_ids, topk_weights)
mlp.experts                                mlp.experts                               combine (the weighted sum of the experts)
mlp (dense layers)                         mlp (dense layers)                        mlp
layers.i                                   next input_layernorm / model.norm out[1]  layers.i.output
model.norm / lm_head                       model.norm out[0] / logits_processor      final_norm / logits

vLLM adds the residual inside the next RMSNorm (fused add), so a layer's output is that norm's second
result. Its routers are not modules (no topk_ids / topk_weights) and its experts module returns the
combined output; bisect checks what is missing against the nearest captured inputs. Tensors are reported
rows first ([tokens, ...]; `logits`: the rows whose next token is scored); which rows those are is the
engine's part (`locate`), as is `tokens` / `positions`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

Emit = Callable[[str, torch.Tensor], None]


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _rows(tensor: torch.Tensor, packed: bool) -> torch.Tensor:
    """[tokens, ...]: transformers' modules work on [batch, time, ...], vLLM's on packed tokens already."""
    return tensor if packed else tensor.flatten(0, 1)


@contextmanager
def attached(model: torch.nn.Module, family: str, emit: Emit, on_forward: Callable):
    """`attach` for the length of a `with` block."""
    hooks = attach(model, family, emit, on_forward)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def attach(model: torch.nn.Module, family: str, emit: Emit, on_forward: Callable) -> list:
    """Hooks on `model` (a transformers or vLLM Qwen3 / Qwen3-MoE causal LM: `family` "transformers" or
    "vllm") that report every capture point they see to `emit`, after `on_forward(model, args, kwargs)`, the
    engine's own pre-hook on the whole forward, has located its rows; returns the handles, to `remove()`."""
    packed = family == "vllm"
    hooks = [model.register_forward_pre_hook(on_forward, with_kwargs=True)]

    def after(module, point: Callable):
        hooks.append(module.register_forward_hook(lambda m, args, out: point(out)))

    def before(module, point: Callable):
        hooks.append(module.register_forward_pre_hook(lambda m, args: point(args[0])))

    def report(name: str, pick=_first):
        return lambda out: emit(name, _rows(pick(out), packed))

    inner = model.model
    layers = list(inner.layers)
    after(inner.embed_tokens, report("embedding"))
    for i, layer in enumerate(layers):
        at = f"layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_norm", "k_norm"):
            after(getattr(attn, name), report(at + name))
        if family == "transformers":
            after(layer.input_layernorm, report(at + "input_norm"))
            for name in ("q_proj", "k_proj", "v_proj"):
                after(getattr(attn, name), report(at + name))
            before(attn.o_proj, report(at + "attention"))
            before(layer.post_attention_layernorm, report(at + "residual"))
            after(layer.post_attention_layernorm, report(at + "post_attention_norm"))
            after(layer, report(at + "output"))
        else:
            after(layer.input_layernorm, _fused_norm(emit, at + "input_norm", f"layers.{i - 1}.output" if i else None))
            after(attn.qkv_proj, _split_qkv(emit, at, attn.q_size, attn.kv_size))
            hooks.append(attn.attn.register_forward_pre_hook(_rotated(emit, at, attn.head_dim)))
            after(attn.attn, report(at + "attention"))
            after(layer.post_attention_layernorm, _fused_norm(emit, at + "post_attention_norm", at + "residual"))
        if hasattr(mlp, "experts"):
            after(mlp.gate, _router(emit, at))
            after(mlp.experts, lambda out, at=at: emit(at + "combine", _experts_output(out)))
        else:
            after(mlp, report(at + "mlp"))
        after(attn.o_proj, report(at + "o_proj"))
    if family == "transformers":
        after(inner.norm, report("final_norm"))
        after(model.lm_head, report("logits"))
    else:
        after(inner.norm, _fused_norm(emit, "final_norm", f"layers.{len(layers) - 1}.output"))
        after(model.logits_processor, lambda out: emit("logits", out))
    return hooks


def _fused_norm(emit: Emit, normed: str, summed: str | None):
    """vLLM's RMSNorm with a residual returns (norm(x + residual), x + residual); without one, the norm only."""
    def point(out):
        if isinstance(out, tuple):
            emit(normed, out[0])
            if summed:
                emit(summed, out[1])
        else:
            emit(normed, out)
    return point


def _split_qkv(emit: Emit, at: str, q_size: int, kv_size: int):
    def point(out):
        q, k, v = _first(out).split([q_size, kv_size, kv_size], dim=-1)
        emit(at + "q_proj", q), emit(at + "k_proj", k), emit(at + "v_proj", v)
    return point


def _rotated(emit: Emit, at: str, head_dim: int):
    """The rotated q and k, as the attention receives them (one rotary module serves every layer in vLLM)."""
    def point(module, args):
        q, k = args[0], args[1]
        emit(at + "rope_q", q.unflatten(-1, (-1, head_dim))), emit(at + "rope_k", k.unflatten(-1, (-1, head_dim)))
    return point


def _router(emit: Emit, at: str):
    """transformers' router returns (logits, topk weights, topk ids); vLLM's gate the logits (and a bias)."""
    def point(out):
        if isinstance(out, tuple) and len(out) == 3:
            logits, weights, ids = out
            emit(at + "topk_ids", ids), emit(at + "topk_weights", weights)
        else:
            logits = _first(out)
        emit(at + "router_logits", logits)
    return point


def _experts_output(out) -> torch.Tensor:
    if isinstance(out, tuple):  # (shared experts, routed experts): not a Qwen3-MoE
        raise RuntimeError("capture hooks: this experts module has shared experts, which Qwen3-MoE has not")
    return out


class RowFilter:
    """The capture an engine's process keeps: the rows of request `request` at positions <= `upto` (None:
    every row) of each forward, ready to be replayed into a logdiff capture elsewhere (`forwards`)."""

    def __init__(self, request: int | None, upto: int | None):
        self.request, self.upto = request, upto
        self.forwards: list[dict] = []

    def locate(self, request: torch.Tensor, position: torch.Tensor, head: torch.Tensor | None = None) -> None:
        head = torch.arange(len(request)) if head is None else head
        keep = torch.ones_like(request, dtype=torch.bool) if self.request is None else request == self.request
        if self.upto is not None:
            keep &= position <= self.upto
        rows = keep.nonzero().squeeze(1)
        head_rows = keep[head].nonzero().squeeze(1)  # of the head: which `logits` rows to keep
        self.forwards.append({"request": request[rows], "position": position[rows], "rows": rows, "head_rows": head_rows,
                              "head": torch.searchsorted(rows, head[head_rows]), "points": {}})

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if not self.forwards:
            raise RuntimeError(f"capture point {name!r} before any locate(): the engine must announce its rows first")
        forward = self.forwards[-1]
        if name in forward["points"]:
            raise RuntimeError(f"capture point {name!r} reported twice in one forward: a module the hooks take for one "
                               "layer's serves several")
        pick = forward["head_rows"] if name in ("logits", "logprob") else forward["rows"]
        forward["points"][name] = tensor.detach()[pick].clone()

    def result(self) -> list[dict]:
        """The forwards that held a kept row, without the row bookkeeping."""
        return [{k: f[k] for k in ("request", "position", "head", "points")} for f in self.forwards if len(f["rows"])]
