"""Tensor and expert parallelism on torch.distributed: the same model and kernels, one process per rank.

`shard_model` cuts a rank's weights out of the whole model: q/k/v and gate/up by output rows
(column-parallel: each output column computed whole on one rank), o/down by input columns
(row-parallel: a partial result per rank, reduced as the kernel set's `row_parallel` says), lm_head by
vocabulary rows (vocab-parallel: each rank scores its vocabulary slice with the vocab-parallel fp32
log-softmax, `KernelSet.vocab_parallel_logprobs`; only the sampler gathers the logits), the experts by
expert (expert-parallel, all-to-all dispatch, combine in routing order). Every rank holds the whole
embedding table, norms and router. `shard_of` says which heads, columns and vocabulary ids a rank holds.

A capture (`logdiff bisect`) goes to every rank of a path; each rank fills its copy, rank 0 gathers them
and the parent hands them to the capture's `add_ranks`.

`ShardedStack` runs a KernelStack's trainer at one degree and its paged rollout engine at another:
each path with degree > 1 runs in a `Pool` of worker processes (torch.multiprocessing spawn; gloo on
CPU, nccl or hccl where the stack's device is one), which rank 0 answers for. One pool per world size
serves every model, dtype and kernel set of the session.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import queue
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn

from logdiff.api import Capture, EngineOptions, Stack, Unsupported
from logdiff.comm import SINGLE_PROCESS, DistributedComm
from logdiff.kernels.linear import REDUCE_CHUNKS
from logdiff.model import MLP, Qwen3ForCausalLM, SparseMoe

TP_DEGREES = tuple(d for d in (1, 2, 4) if REDUCE_CHUNKS % d == 0)
EP_DEGREES = (1, 2)
TIMEOUT_S = 600


def backend_for(device: str) -> str:
    """The torch.distributed backend for a stack computing on `device`."""
    kind = device.split(":")[0]
    return {"cuda": "nccl", "npu": "hccl"}.get(kind, "gloo")


def check_degrees(config, tp: int, ep: int) -> int:
    """The world size of a (tp, ep) layout of `config`; Unsupported with the reason when it has none."""
    world = max(tp, ep)
    if tp not in TP_DEGREES or ep not in EP_DEGREES:
        raise Unsupported(f"TP {tp} / EP {ep}: supported TP degrees {TP_DEGREES}, EP degrees {EP_DEGREES}")
    if tp not in (1, world) or ep not in (1, world):
        raise Unsupported(f"TP {tp} with EP {ep}: both degrees must be 1 or the world size")
    c = config
    kv_ok = c.num_key_value_heads % tp == 0 or tp % c.num_key_value_heads == 0
    sizes = [c.num_attention_heads, c.vocab_size] + ([c.intermediate_size] if any(
        not c.layer_is_moe(i) for i in range(c.num_hidden_layers)) else [])
    if not kv_ok or any(n % tp for n in sizes):
        raise Unsupported(f"model {c.name} does not shard over {tp} tensor-parallel ranks (heads, KV heads, "
                          f"intermediate size and vocabulary must divide)")
    if ep > 1 and (not c.is_moe or c.num_experts % ep):
        raise Unsupported(f"model {c.name} has no {ep}-way expert parallelism (a MoE with experts divisible by {ep})")
    return world


@dataclass(frozen=True)
class Shard:
    """What a tensor-parallel rank holds of a model (`shard_of`): its query heads, its key/value heads (a
    head shared by several ranks when there are fewer KV heads than ranks), its part of the MLP's
    intermediate size and its slice of the vocabulary."""

    q_heads: slice
    kv_heads: slice
    intermediate: slice
    vocab: slice


def shard_of(config, rank: int, tp: int) -> Shard:
    c = config
    heads = c.num_attention_heads // tp
    kv_heads = max(c.num_key_value_heads // tp, 1)
    kv_first = rank * heads // (c.num_attention_heads // c.num_key_value_heads)
    i, v = c.intermediate_size // tp, c.vocab_size // tp
    return Shard(slice(rank * heads, (rank + 1) * heads), slice(kv_first, kv_first + kv_heads),
                 slice(rank * i, (rank + 1) * i), slice(rank * v, (rank + 1) * v))


def shard_model(model: Qwen3ForCausalLM, tp_rank: int, tp: int, ep_rank: int, ep: int) -> Qwen3ForCausalLM:
    """This rank's part of `model` (in place): a model whose config counts the local heads and
    intermediate size, so the model code and the paged KV cache run unchanged."""
    c = model.config
    if tp == 1 and ep == 1:
        return model
    part, d = shard_of(c, tp_rank, tp), c.head_dim
    q_rows = slice(part.q_heads.start * d, part.q_heads.stop * d)
    kv_rows = slice(part.kv_heads.start * d, part.kv_heads.stop * d)

    def cut(module, name, rows=None, cols=None):
        w = getattr(module, name)
        w = w[rows] if rows is not None else w
        w = w[:, cols] if cols is not None else w
        setattr(module, name, nn.Parameter(w.clone(), requires_grad=False))

    for layer in model.model.layers:
        a = layer.self_attn
        cut(a.q_proj, "weight", rows=q_rows)
        cut(a.k_proj, "weight", rows=kv_rows)
        cut(a.v_proj, "weight", rows=kv_rows)
        cut(a.o_proj, "weight", cols=q_rows)
        if isinstance(layer.mlp, MLP):
            cut(layer.mlp.gate_proj, "weight", rows=part.intermediate)
            cut(layer.mlp.up_proj, "weight", rows=part.intermediate)
            cut(layer.mlp.down_proj, "weight", cols=part.intermediate)
        elif isinstance(layer.mlp, SparseMoe) and ep > 1:
            e = c.num_experts // ep
            experts = slice(ep_rank * e, (ep_rank + 1) * e)
            cut(layer.mlp.experts, "gate_up_proj", rows=experts)
            cut(layer.mlp.experts, "down_proj", rows=experts)
    cut(model.lm_head, "weight", rows=part.vocab)
    model.config = c.replace(num_attention_heads=c.num_attention_heads // tp,
                             num_key_value_heads=part.kv_heads.stop - part.kv_heads.start,
                             intermediate_size=c.intermediate_size // tp)
    return model


# --------------------------------------------------------------------------- worker processes


def _worker(rank: int, world: int, port: int, backend: str, inbox, outbox) -> None:
    import torch.distributed as dist

    from logdiff.engine.engine import RolloutEngine, inference_copy
    from logdiff.stacks import builtin_kernel_sets
    from logdiff.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    comm = DistributedComm()
    built = {}
    while True:
        command = inbox.get()
        if command is None:
            break
        kind, key, args, capture = command
        try:
            if key not in built:
                kernels, spec, dtype, max_model_len, tp, ep = key
                ops = builtin_kernel_sets()[kernels][0](max_model_len)
                ops = dataclasses.replace(ops, tp=comm if tp > 1 else SINGLE_PROCESS, ep=comm if ep > 1 else SINGLE_PROCESS)
                shard = shard_model(spec.build(dtype), rank if tp > 1 else 0, tp, rank if ep > 1 else 0, ep)
                built[key] = (ops, Trainer(shard, ops), inference_copy(shard, ops))
            ops, trainer, engine_model = built[key]
            if kind == "rollout":
                requests, o = args
                engine = RolloutEngine(engine_model, ops, o.page_size, o.prefill_chunk, o.shuffle_pages)
                result = engine.generate(requests, capture)
            elif kind == "trainer":
                *scored, processing = args
                result = trainer.logprobs(*scored, capture=capture, processing=processing)
            else:
                result = RolloutEngine(engine_model, ops, *args[3]).prompt_logprobs(*args[:3], processing=args[4])
            if capture is not None:
                result = (result, _captures_at_rank_0(capture, rank, world, ops))
        except Exception:  # noqa: BLE001 (handed to the parent, which raises it)
            result = RuntimeError(f"rank {rank}: {traceback.format_exc()}")
        if rank == 0 or isinstance(result, Exception):
            outbox.put(result)
    dist.destroy_process_group()


def _captures_at_rank_0(capture, rank: int, world: int, ops) -> bytes | None:
    """Every rank's filled copy of `capture`, in rank order, on rank 0 (gathered over torch.distributed);
    pickled, so the parent gets them as one message: a torch queue would pass each captured row through a
    file descriptor of its own (torch's file_descriptor sharing), ~40 points x positions per rank."""
    import torch.distributed as dist

    capture.mark_rank(rank, ops.tp.size, ops.ep.size, ops.collectives())
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(capture, gathered, dst=0)
    return pickle.dumps(gathered) if rank == 0 else None


class Pool:
    """`world` spawned ranks that run the same command; rank 0 (or the first rank that fails) answers."""

    def __init__(self, world: int, backend: str = "gloo"):
        self.key = (world, backend)
        ctx = torch.multiprocessing.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.world = world
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, backend, self.inboxes[r], self.outbox), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def call(self, kind: str, key: tuple, args: tuple, capture=None):
        """`capture`: a copy goes to every rank; the answer is then (result, the filled copies pickled)."""
        for box in self.inboxes:
            box.put((kind, key, args, capture))
        waited = 0
        while True:
            try:
                result = self.outbox.get(timeout=5)
                break
            except queue.Empty:
                waited += 5
                if waited > TIMEOUT_S or not all(p.is_alive() for p in self.procs):
                    self.close()
                    raise RuntimeError(f"a rank of the {self.world}-process pool died or hung") from None
        if isinstance(result, Exception):
            self.close()  # the other ranks may wait in a collective
            raise result
        return result

    def close(self) -> None:
        for box, p in zip(self.inboxes, self.procs):
            if p.is_alive():
                box.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if _POOLS.get(self.key) is self:
            del _POOLS[self.key]


_POOLS: dict[tuple[int, str], Pool] = {}


def pool(world: int, backend: str = "gloo") -> Pool:
    """The session's pool of `world` ranks, spawned on first use."""
    key = (world, backend)
    if key not in _POOLS or not all(p.is_alive() for p in _POOLS[key].procs):
        _POOLS[key] = Pool(world, backend)
    return _POOLS[key]


@atexit.register
def close_pools() -> None:
    for p in list(_POOLS.values()):
        p.close()


# --------------------------------------------------------------------------- the stack


class ShardedStack(Stack):
    """A built-in KernelStack (`base`) whose trainer runs at tensor-parallel degree `trainer_tp` and whose
    rollout engine at `rollout_tp`, both with expert-parallel degree `ep`. A path at degree 1 runs in
    this process, on `base` itself."""

    supports_capture = True

    def __init__(self, base, trainer_tp: int = 1, rollout_tp: int = 1, ep: int = 1):
        self.base = base
        config = base.model.config
        self.worlds = {"trainer": check_degrees(config, trainer_tp, ep), "rollout": check_degrees(config, rollout_tp, ep)}
        self.degrees = {"trainer": trainer_tp, "rollout": rollout_tp, "ep": ep}
        self.name = base.name
        self.device = base.device
        self.backend = backend_for(base.device)
        spec = base.spec
        dtype, span = base.model.dtype, base.max_model_len
        self.keys = {path: (base.ops.name, spec, dtype, span, self.degrees[path], ep)
                     for path in ("trainer", "rollout")}

    def _call(self, path: str, kind: str, *args, capture: Capture = None):
        if capture is not None and not hasattr(capture, "add_ranks"):
            raise Unsupported(f"a capture on {self.worlds[path]} ranks is filled on each rank and handed back with "
                              "add_ranks (logdiff.bisect.capture.Recorder); this capture has no add_ranks")
        ranks = pool(self.worlds[path], self.backend)
        if capture is None:
            return ranks.call(kind, self.keys[path], args)
        result, filled = ranks.call(kind, self.keys[path], args, capture)
        capture.add_ranks(pickle.loads(filled))
        return result

    def rollout(self, requests, options=EngineOptions(), capture: Capture = None):
        if self.worlds["rollout"] == 1:
            return self.base.rollout(requests, options, capture)
        return self._call("rollout", "rollout", list(requests), options, capture=capture)

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture: Capture = None, processing=None):
        if self.worlds["trainer"] == 1:
            return self.base.trainer_logprobs(sequences, score_from, temperatures, grad, capture, processing)
        if grad:
            raise Unsupported("the sharded trainer runs without autograd (collectives are not differentiated)")
        return self._call("trainer", "trainer", [list(s) for s in sequences], list(score_from), list(temperatures),
                          processing, capture=capture)

    def prompt_logprobs(self, sequences, score_from, temperatures, options=EngineOptions(), processing=None):
        if self.worlds["rollout"] == 1:
            return self.base.prompt_logprobs(sequences, score_from, temperatures, options, processing)
        opts = (options.page_size, options.prefill_chunk, options.shuffle_pages)
        return self._call("rollout", "prompt", [list(s) for s in sequences], list(score_from), list(temperatures), opts,
                          processing)

    def describe(self) -> dict:
        return {**self.base.describe(), "parallel": dict(self.degrees), "backend": self.backend}
