"""The rollout engine's data structures and schedule."""

import torch

from logdiff.api import Request
from logdiff.engine import RolloutEngine
from logdiff.engine.kv_cache import BlockManager, PagedKVCache
from logdiff.engine.scheduler import Scheduler
from logdiff.kernels import reference_kernels
from logdiff.weights import ModelSpec


def test_block_manager_grows_tables_and_recycles_pages():
    blocks = BlockManager(num_pages=4, page_size=16)
    a, b = [], []
    blocks.reserve(a, 17)
    blocks.reserve(b, 16)
    assert a == [0, 1] and b == [2]
    blocks.release(a)
    assert a == [] and list(blocks.free_pages) == [3, 0, 1]
    blocks.reserve(b, 40)
    assert b == [2, 3, 0]


def test_shuffled_free_list_gives_permuted_block_tables():
    blocks = BlockManager(num_pages=8, page_size=4, shuffle_seed=1)
    table = []
    blocks.reserve(table, 32)
    assert sorted(table) == list(range(8)) and table != list(range(8))


def test_slots_follow_the_block_table():
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=4, kv_heads=1, head_dim=2, dtype=torch.float32)
    slots = cache.slots([[2, 0], [3]], torch.arange(6).expand(2, 6))
    assert slots[0].tolist() == [8, 9, 10, 11, 0, 1]
    assert slots[1, :4].tolist() == [12, 13, 14, 15]


def test_scheduler_admits_on_arrival_and_jumps_idle_gaps():
    sched = Scheduler([Request((1,), 2, arrival=0), Request((1,), 2, arrival=1), Request((1,), 1, arrival=9)])
    joined = sched.admit()
    assert [s.index for s in joined] == [0]
    sched.finish_step(joined)
    joined = sched.admit()
    assert [s.index for s in joined] == [1]
    sched.running[0].tokens += [7, 7]
    assert [s.index for s in sched.finish_step(joined)] == [0]
    assert sched.admit() == []  # request 2 arrives at step 9
    sched.running[0].tokens += [7, 7]
    assert [s.index for s in sched.finish_step([])] == [1]
    assert [s.index for s in sched.admit()] == [2] and sched.step == 9


def test_requests_join_and_finish_at_different_steps():
    engine = RolloutEngine(ModelSpec("qwen3-dense-tiny").build(torch.float32), reference_kernels(), page_size=16)
    reqs = [Request(tuple(range(1, 1 + n)), max_new_tokens=m, arrival=a) for n, m, a in [(5, 9, 0), (30, 3, 2), (17, 6, 4)]]
    out = engine.generate(reqs)
    assert [len(o.tokens) for o in out] == [9, 3, 6]
    assert all(o.logprobs.dtype == torch.float32 and len(o.logprobs) == len(o.tokens) for o in out)
    assert all((o.logprobs <= 0).all() for o in out)
    assert len(engine.blocks.free_pages) == sum(-(-(len(r.prompt) + r.max_new_tokens) // 16) for r in reqs)


def test_chunked_prefill_and_page_size_do_not_change_reference_bits():
    model = ModelSpec("qwen3-moe-tiny").build(torch.bfloat16)
    reqs = [Request(tuple(range(3, 203)), 6), Request(tuple(range(7, 40)), 6, temperature=0.9, seed=5)]
    base = RolloutEngine(model, reference_kernels()).generate(reqs)
    other = RolloutEngine(model, reference_kernels(), page_size=7, prefill_chunk=33, shuffle_pages=3).generate(reqs)
    for a, b in zip(base, other):
        assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)


def test_log_probs_come_back_as_ordinary_tensors():
    """The engine computes under inference_mode; what it hands back can still be updated in place and saved
    for backward, as an RL loss does with the rollout's log-probs."""
    engine = RolloutEngine(ModelSpec("qwen3-dense-tiny").build(torch.float32), reference_kernels(), page_size=16)
    rollout = engine.generate([Request((1, 2, 3), max_new_tokens=4)])[0].logprobs
    scored = engine.prompt_logprobs([[1, 2, 3, 4]], [1], torch.zeros(1))[0]
    for logprobs in (rollout, scored):
        assert not logprobs.is_inference()
        weight = torch.ones_like(logprobs, requires_grad=True)
        (weight * logprobs).sum().backward()  # saves logprobs for backward
        logprobs.add_(0.0)
