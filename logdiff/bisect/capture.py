"""Capture points: the named intermediate tensors of a forward, what each is computed from, and the
recorder that `logdiff bisect` hands to a stack as `capture=`.

Names, in forward order: `tokens`, `positions`, `embedding`; for each layer i, `layers.{i}.<point>` for
every point of LAYER_POINTS; then `final_norm`, `logits`, `logprob`. A stack captures the points it can
see (transformers, for one, has no module whose output is the rotated q/k); bisect compares the points
both paths of a stack captured.

The protocol a stack follows (see `logdiff.api.Stack`): before each forward it calls
`locate(capture, request, position, head)` to say which (request, position) each packed row of that
forward holds, then `capture(name, tensor)` at each point with the rows first: [N, ...] for token
points, [len(head), ...] for `logits` and `logprob`, which exist only for the rows whose next token is
scored or sampled. A plain `capture(name, tensor)` callable works too; it just learns no rows.

A stack that runs a path on several ranks (logdiff.parallel) fills one copy of the Recorder per rank and
hands the copies back with `add_ranks`. A tensor-parallel rank holds only part of some points (its heads
of q/k/v and attention, its vocabulary slice of the logits: SHARDED_POINTS); `assemble` puts the parts
back into the whole tensor one process computes, `rank_part` cuts a rank's part out of a whole one.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from logdiff.api import Capture, locate
from logdiff.config import ModelConfig
from logdiff.parallel import shard_of

LAYER_POINTS = (
    "input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "rope_q", "rope_k", "attention", "o_proj",
    "residual", "post_attention_norm", "router_logits", "topk_ids", "topk_weights", "experts", "combine", "mlp",
    "output",
)
HEAD_POINTS = ("logits", "logprob")

TOKEN = "token"  # the input's row for the same token
CONTEXT = "context"  # the input's rows for every position up to the token's: the keys and values it attends to

# What each point is computed from; "previous" is the previous layer's output (the embedding for layer 0).
_LAYER_INPUTS = {
    "input_norm": [("previous", TOKEN)],
    "q_proj": [("input_norm", TOKEN)],
    "k_proj": [("input_norm", TOKEN)],
    "v_proj": [("input_norm", TOKEN)],
    "q_norm": [("q_proj", TOKEN)],
    "k_norm": [("k_proj", TOKEN)],
    "rope_q": [("q_norm", TOKEN), ("positions", TOKEN)],
    "rope_k": [("k_norm", TOKEN), ("positions", TOKEN)],
    "attention": [("rope_q", TOKEN), ("rope_k", CONTEXT), ("v_proj", CONTEXT)],
    "o_proj": [("attention", TOKEN)],
    "residual": [("previous", TOKEN), ("o_proj", TOKEN)],
    "post_attention_norm": [("residual", TOKEN)],
    "router_logits": [("post_attention_norm", TOKEN)],
    "topk_ids": [("router_logits", TOKEN)],
    "topk_weights": [("router_logits", TOKEN)],
    "experts": [("post_attention_norm", TOKEN), ("topk_ids", TOKEN)],
    "combine": [("experts", TOKEN), ("topk_weights", TOKEN)],
    "mlp": [("post_attention_norm", TOKEN)],
    "output": [("residual", TOKEN), ("feed_forward", TOKEN)],  # mlp, or combine in an MoE layer
}


# Points a tensor-parallel rank holds only part of, by the part (a field of logdiff.parallel.Shard); every
# other point is whole on every rank (the row-parallel layers, the experts and the log-prob end in a collective).
SHARDED_POINTS = {
    "q_proj": "q_heads", "q_norm": "q_heads", "rope_q": "q_heads", "attention": "q_heads",
    "k_proj": "kv_heads", "v_proj": "kv_heads", "k_norm": "kv_heads", "rope_k": "kv_heads", "logits": "vocab",
}
_UNITS = {"q_heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "vocab": "vocab_size"}


def rank_part(whole: torch.Tensor, name: str, config: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """What tensor-parallel rank `rank` of `tp` holds of one row of point `name`, cut out of the whole row."""
    kind = SHARDED_POINTS.get(split_name(name)[1])
    if kind is None or tp == 1:
        return whole
    units = whole.unflatten(0, (getattr(config, _UNITS[kind]), -1))  # [heads or vocab, ...]
    return units[getattr(shard_of(config, rank, tp), kind)].flatten(0, 1)


def assemble(parts: list[torch.Tensor], name: str, config: ModelConfig, tp: int) -> torch.Tensor:
    """The whole row of point `name` from the parts of the `tp` tensor-parallel ranks, in rank order (a KV
    head that several ranks share is taken from the first). Without tensor parallelism every rank's row is whole."""
    kind = SHARDED_POINTS.get(split_name(name)[1])
    if kind is None or tp == 1:
        return parts[0]
    starts = [getattr(shard_of(config, rank, tp), kind).start for rank in range(tp)]
    return torch.cat([part for rank, part in enumerate(parts) if starts[rank] not in starts[:rank]])


def point_names(num_layers: int) -> list[str]:
    """Every capture point of a model with `num_layers` layers, in forward order."""
    layers = [f"layers.{i}.{p}" for i in range(num_layers) for p in LAYER_POINTS]
    return ["tokens", "positions", "embedding", *layers, "final_norm", *HEAD_POINTS]


def split_name(name: str) -> tuple[int | None, str]:
    """`layers.3.q_proj` -> (3, "q_proj"); `logits` -> (None, "logits")."""
    if name.startswith("layers."):
        _, layer, point = name.split(".", 2)
        return int(layer), point
    return None, name


def direct_inputs(name: str, config: ModelConfig) -> list[tuple[str, str]]:
    """(input point, scope) pairs `name` is computed from, whether or not a stack captures them."""
    layer, point = split_name(name)
    if layer is None:
        last = f"layers.{config.num_hidden_layers - 1}.output"
        return {
            "embedding": [("tokens", TOKEN)],
            "final_norm": [(last, TOKEN)],
            "logits": [("final_norm", TOKEN)],
            "logprob": [("logits", TOKEN)],
        }.get(point, [])
    named = {
        "previous": f"layers.{layer - 1}.output" if layer else "embedding",
        "positions": "positions",
        "feed_forward": f"layers.{layer}." + ("combine" if config.layer_is_moe(layer) else "mlp"),
    }
    return [(named.get(source, f"layers.{layer}.{source}"), scope) for source, scope in _LAYER_INPUTS[point]]


def captured_inputs(name: str, captured: set[str], config: ModelConfig) -> list[tuple[str, str]]:
    """The nearest captured points `name` depends on: an input the stack did not capture is replaced by
    its own inputs (a context scope stays a context scope), so e.g. attention without rope_q is checked
    against q_norm and positions."""
    found: list[tuple[str, str]] = []
    todo = list(direct_inputs(name, config))
    while todo:
        source, scope = todo.pop(0)
        if source in captured:
            if (source, scope) not in found:
                found.append((source, scope))
            continue
        todo += [(s, CONTEXT if CONTEXT in (scope, inner) else TOKEN) for s, inner in direct_inputs(source, config)]
    order = {name: i for i, name in enumerate(point_names(config.num_hidden_layers))}
    kept = [(s, scope) for s, scope in found if scope == CONTEXT or (s, CONTEXT) not in found]
    return sorted(kept, key=lambda pair: order[pair[0]])


class Recorder:
    """A capture that keeps the rows of one request at positions <= `upto`, by point and position."""

    def __init__(self, request: int, upto: int):
        self.request = request
        self.upto = upto
        self.rows: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        self._token: tuple[list[int], list[int], int] | None = None  # (kept rows, their positions, all rows)
        self._head: tuple[list[int], list[int], int] | None = None
        # Set on the copy a rank of a parallel stack fills (mark_rank): its rank, the tensor- and
        # expert-parallel degrees, and the collective each point's op ends in there (KernelSet.collectives).
        self.rank, self.tp, self.ep, self.collectives = 0, 1, 1, {}
        self.ranks: list[Recorder] = []  # the copies every rank filled, in rank order (add_ranks)

    def mark_rank(self, rank: int, tp: int, ep: int, collectives: dict[str, str]) -> None:
        self.rank, self.tp, self.ep, self.collectives = rank, tp, ep, collectives

    def add_ranks(self, copies: list[Recorder]) -> None:
        """The stack ran on several ranks: `copies` are the ones each filled, in rank order."""
        self.ranks = copies

    def locate(self, request: torch.Tensor, position: torch.Tensor, head: torch.Tensor | None = None) -> None:
        request, position = torch.as_tensor(request).flatten(), torch.as_tensor(position).flatten()
        head = torch.arange(request.numel()) if head is None else torch.as_tensor(head, dtype=torch.long).flatten()
        self._token = self._select(request, position)
        self._head = self._select(request[head], position[head])

    def _select(self, request: torch.Tensor, position: torch.Tensor) -> tuple[list[int], list[int], int]:
        keep = ((request == self.request) & (position <= self.upto)).nonzero().squeeze(1)
        return keep.tolist(), position[keep].tolist(), request.numel()

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        located = self._head if name in HEAD_POINTS else self._token
        if located is None:
            raise RuntimeError(f"capture point {name!r} before any locate(): the stack must announce its rows first")
        rows, positions, expected = located
        if tensor.shape[0] != expected:
            raise RuntimeError(f"capture point {name!r} has {tensor.shape[0]} rows but {expected} were located")
        store = self.rows[name]
        for row, pos in zip(rows, positions):
            if pos in store:
                raise RuntimeError(f"capture point {name!r}: position {pos} of request {self.request} captured twice")
            store[pos] = tensor[row].detach().clone()


def capture_logprobs(capture: Capture, requests: list[int], first_rows: list[int], logprobs: list[torch.Tensor]) -> None:
    """The `logprob` point: logprobs[b][j] scores the token after position first_rows[b] + j of request requests[b]
    (a trainer's first row is score_from - 1, a rollout's the prompt's last)."""
    if capture is None:
        return
    request = torch.cat([torch.full((len(lp),), r) for r, lp in zip(requests, logprobs)])
    locate(capture, request, torch.cat([first + torch.arange(len(lp)) for first, lp in zip(first_rows, logprobs)]))
    capture("logprob", torch.cat(logprobs))


def replay(capture: Capture, forwards: list[dict]) -> None:
    """Hands `capture` what an engine's own process recorded (logdiff.bisect.hooks.RowFilter.result()), forward by
    forward, as if the engine ran here."""
    for forward in forwards:
        locate(capture, forward["request"], forward["position"], forward["head"])
        for name, tensor in forward["points"].items():
            capture(name, tensor)
