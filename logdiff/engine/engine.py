"""RolloutEngine: generates tokens for a list of requests and records the log-prob of each sampled
token, as vLLM/SGLang do for an RL rollout, over a paged KV cache with continuous batching."""

from __future__ import annotations

import copy

import torch

from logdiff.batch import SeqBatch
from logdiff.engine.kv_cache import BlockManager, PagedKVCache
from logdiff.engine.scheduler import Request, RolloutOutput, Scheduler, Sequence
from logdiff.kernelset import KernelSet
from logdiff.model import Capture, Qwen3ForCausalLM

DEFAULT_PAGE_SIZE = 128


class RolloutEngine:
    """`page_size`: tokens per KV page. `prefill_chunk`: prompt tokens per prefill forward (None: whole
    prompts). `shuffle_pages`: seed that permutes the free-page list, so block tables are not in order."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        ops: KernelSet,
        page_size: int = DEFAULT_PAGE_SIZE,
        prefill_chunk: int | None = None,
        shuffle_pages: int | None = None,
    ):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.model = inference_copy(model)
        self.ops = ops
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.shuffle_pages = shuffle_pages

    @torch.no_grad()
    def generate(self, requests: list[Request], capture: Capture = None) -> list[RolloutOutput]:
        c = self.model.config
        pages = sum(-(-(len(r.prompt) + r.max_new_tokens) // self.page_size) for r in requests)
        self.blocks = BlockManager(pages, self.page_size, self.shuffle_pages)
        self.cache = PagedKVCache(c.num_hidden_layers, pages, self.page_size, c.num_key_value_heads, c.head_dim, self.model.dtype)
        self.capture = capture
        sched = Scheduler(requests)
        while not sched.idle:
            joined = sched.admit()
            decoding = [s for s in sched.running if not s.finished]
            if joined:
                self._prefill(joined)
            if decoding:
                self._decode(decoding)
            for seq in sched.finish_step(joined):
                self.blocks.release(seq.table)
        done = sorted(sched.done, key=lambda s: s.index)
        return [RolloutOutput(s.tokens, torch.cat(s.logprobs)) for s in done]

    def _prefill(self, seqs: list[Sequence]) -> None:
        chunk = self.prefill_chunk or max(s.prompt_len for s in seqs)
        while any(s.prefilled < s.prompt_len for s in seqs):
            part = [s for s in seqs if s.prefilled < s.prompt_len]
            starts = [s.prefilled for s in part]
            lengths = [min(chunk, s.prompt_len - s.prefilled) for s in part]
            tokens = [t for s, a, n in zip(part, starts, lengths) for t in s.request.prompt[a : a + n]]
            last = [s.prefilled + n == s.prompt_len for s, n in zip(part, lengths)]
            logits = self._forward(part, tokens, starts, lengths, last)
            for s, n in zip(part, lengths):
                s.prefilled += n
            self._sample([s for s, is_last in zip(part, last) if is_last], logits)

    def _decode(self, seqs: list[Sequence]) -> None:
        tokens = [s.tokens[-1] for s in seqs]
        starts = [s.prompt_len + len(s.tokens) - 1 for s in seqs]
        logits = self._forward(seqs, tokens, starts, [1] * len(seqs), [True] * len(seqs))
        self._sample(seqs, logits)

    def _forward(self, seqs: list[Sequence], tokens, starts, lengths, emit) -> torch.Tensor:
        """One forward over the new tokens of `seqs`; logits of each sequence's last new token where `emit`."""
        for s, a, n in zip(seqs, starts, lengths):
            self.blocks.reserve(s.table, a + n)
        batch = SeqBatch.from_lengths(lengths, starts)
        tables = [s.table for s in seqs]
        new_slots = self.cache.slots(tables, batch.positions[None, :].expand(len(seqs), -1))
        new_slots = new_slots[batch.seq_of_token, torch.arange(batch.num_tokens)]
        context = int((batch.starts + batch.lengths).max())
        slot_table = self.cache.slots(tables, torch.arange(context).expand(len(seqs), context))
        ops, cache = self.ops, self.cache

        def attend(layer, q, k, v):
            cache.write(layer, new_slots, k, v)
            return ops.rollout_attention(q, cache.k[layer], cache.v[layer], batch, slot_table)

        hidden = self.model.hidden_states(torch.tensor(tokens), batch, ops, attend, self.capture)
        last_rows = (batch.offsets + batch.lengths - 1)[torch.tensor(emit)]
        return self.model.logits(hidden[last_rows], ops, self.capture)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        if not seqs:
            return
        temps = torch.tensor([s.request.temperature for s in seqs], dtype=torch.float32)
        seeds = torch.tensor([s.request.seed for s in seqs], dtype=torch.long)
        index = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long)
        tokens = self.ops.sample(logits, temps, seeds, index)
        logp = self.ops.token_logprobs(logits, tokens, torch.where(temps > 0, temps, 1.0))
        if self.capture:
            self.capture("logprob", logp)
        for s, t, lp in zip(seqs, tokens.tolist(), logp):
            s.tokens.append(t)
            s.logprobs.append(lp.reshape(1))


def inference_copy(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """The model with its GEMM weights stored in fp32.

    Every kernel set computes GEMMs in fp32 and rounds the result to the model dtype, so an fp32 copy of
    a bf16 weight gives the same bits while sparing the upcast on every decode step.
    """
    twin = copy.deepcopy(model)
    for name, param in twin.named_parameters():
        if name.endswith("proj.weight") or name.endswith("_proj") or name.endswith("gate.weight") or name == "lm_head.weight":
            param.data = param.data.float()
    if model.config.tie_word_embeddings:
        twin.lm_head.weight = torch.nn.Parameter(twin.model.embed_tokens.weight.float(), requires_grad=False)
    return twin
