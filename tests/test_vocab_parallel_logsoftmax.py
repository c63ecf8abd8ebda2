"""The vocab-parallel fp32 log-softmax on real gloo ranks, at a vocabulary large enough that each fixed part
spans several VOCAB_CHUNK chunks and a padded tail (the catalogue's tiny models have 1024 ids): the fixed
order gives one process's bits at TP2 and TP4, log-probs and gradient; the native all_reduce is the same
quantity in other bits."""

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from logdiff.comm import DistributedComm
from logdiff.kernels.logsoftmax import (
    VOCAB_CHUNK,
    VOCAB_PARTS,
    fixed_order_token_logprobs,
    native_vocab_parallel_logprobs,
)

VOCAB = VOCAB_PARTS * (2 * VOCAB_CHUNK + 1308)  # 38000 ids: parts of two whole chunks and a padded one
GRAD_WEIGHTS = torch.tensor([1.0, -0.5, 2.0, 0.25, -1.5, 0.75])


def inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=g) * 4
    half = VOCAB // 2
    targets = torch.tensor([0, half - 1, half, VOCAB - 1, 12345, 30001])  # around the rank boundaries too
    temperatures = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 2.0])
    return logits, targets, temperatures


def _ranks(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in one order
    logits, targets, temperatures = inputs()
    mine = logits.chunk(4, -1)[rank].clone().requires_grad_(True)
    tp4 = fixed_order_token_logprobs(mine, targets, temperatures, DistributedComm())
    (grad,) = torch.autograd.grad(tp4, mine, GRAD_WEIGHTS)
    grads = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(grads, grad)
    tp4 = tp4.detach()
    pair = DistributedComm(pairs[rank // 2])
    shard = logits.chunk(2, -1)[pair.rank]
    tp2 = fixed_order_token_logprobs(shard, targets, temperatures, pair)
    native = native_vocab_parallel_logprobs(shard, targets, temperatures, pair)
    if rank == 0:
        torch.save({"tp4": tp4, "tp2": tp2, "native_tp2": native, "tp4_grad": torch.cat(grads, -1)}, out)
    dist.barrier()
    dist.destroy_process_group()


def test_fixed_order_is_degree_invariant_and_native_all_reduce_is_not(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "scores.pt"
    torch.multiprocessing.spawn(_ranks, args=(4, port, str(out)), nprocs=4)
    scores = torch.load(out)
    logits, targets, temperatures = inputs()
    one = fixed_order_token_logprobs(logits, targets, temperatures)
    for degree in ("tp2", "tp4"):
        assert torch.equal(scores[degree].view(torch.int32), one.view(torch.int32)), degree
    # The written-out gradient reads the same max, sum and exp on every degree: each rank's slice of it,
    # with the target's column only on the rank that holds the target, is one process's gradient bit for bit.
    leaf = logits.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fixed_order_token_logprobs(leaf, targets, temperatures), leaf, GRAD_WEIGHTS)
    assert torch.equal(scores["tp4_grad"].view(torch.int32), grad.view(torch.int32))
    exact = torch.log_softmax(logits.double() / torch.where(temperatures > 0, temperatures, 1.0)[:, None].double(), -1)
    exact = exact.gather(1, targets[:, None]).squeeze(1)
    for values in (one, scores["native_tp2"]):
        torch.testing.assert_close(values.double(), exact, rtol=0, atol=1e-5)
    assert not torch.equal(scores["native_tp2"].view(torch.int32), one.view(torch.int32))
