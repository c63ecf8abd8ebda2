"""RolloutEngine: generates tokens for a list of requests and records the log-prob of each sampled
token, as vLLM/SGLang do for an RL rollout, over a paged KV cache with continuous batching."""

from __future__ import annotations

import copy

import torch
from torch import nn

from logdiff.api import DEFAULT_PAGE_SIZE, Capture, Processing, Request, RolloutOutput, locate
from logdiff.batch import SeqBatch, check_score_from
from logdiff.engine.kv_cache import BlockManager, PagedKVCache
from logdiff.engine.scheduler import Scheduler, Sequence
from logdiff.kernelset import KernelSet
from logdiff.model import Qwen3ForCausalLM


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
        self.model = inference_copy(model, ops)
        self.ops = ops
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.shuffle_pages = shuffle_pages

    def generate(self, requests: list[Request], capture: Capture = None) -> list[RolloutOutput]:
        done = self._generate(requests, capture)
        return [RolloutOutput(s.tokens, torch.cat(s.logprobs)) for s in done]  # outside: see _generate

    # inference_mode, not no_grad: no version counters or view tracking on the step's ~1500 small tensors
    # (qwen3-moe-small bf16 decode-b1, 2 threads: 5.9 -> 5.5 ms per token, the same bits). Its tensors may
    # not be saved for backward or updated in place afterwards, so what a caller gets is concatenated
    # outside it: ordinary tensors. A capture hook, called inside, gets values to read (bisect compares them).
    @torch.inference_mode()
    def _generate(self, requests: list[Request], capture: Capture) -> list[Sequence]:
        self._allocate(requests, capture)
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
        return sorted(sched.done, key=lambda s: s.index)

    def prompt_logprobs(self, sequences, score_from, temperatures, processing=None) -> list[torch.Tensor]:
        """log p(token i | tokens < i) for i >= score_from[s] from prefill alone, as vLLM's prompt_logprobs:
        each whole sequence goes through the rollout's prefill path (in chunks if asked) over the paged cache.
        Temperature 0 scores at 1, as for a greedy rollout; `processing` as for the trainer."""
        scored = self._prompt_logprobs(sequences, score_from, temperatures, processing)
        return [torch.cat(pieces) if pieces else torch.empty(0) for pieces in scored]  # outside: see _generate

    @torch.inference_mode()
    def _prompt_logprobs(self, sequences, score_from, temperatures, processing) -> list[list[torch.Tensor]]:
        processing = processing or [Processing()] * len(sequences)
        requests = [Request(tuple(s), max_new_tokens=0, temperature=t, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                            logprobs_mode=p.logprobs_mode) for s, t, p in zip(sequences, temperatures, processing)]
        check_score_from(sequences, score_from)
        self._allocate(requests, capture=None)
        seqs = [Sequence(i, r) for i, r in enumerate(requests)]
        scored = [[] for _ in seqs]

        def predicting_scored_tokens(s: Sequence, start: int, n: int) -> list[int]:
            # chunk row r holds position start + r and predicts the token at start + r + 1
            return [r for r in range(n) if score_from[s.index] <= start + r + 1 < s.prompt_len]

        for part, starts, emitted, logits in self._prefill_chunks(seqs, predicting_scored_tokens):
            targets = [s.request.prompt[a + r + 1] for s, a, rows in zip(part, starts, emitted) for r in rows]
            if not targets:
                continue
            temps = torch.tensor([s.request.temperature for s, rows in zip(part, emitted) for _ in rows], dtype=torch.float32)
            processing = [s.request.processing for s, rows in zip(part, emitted) for _ in rows]
            truncated = self.ops.truncated(logits, temps, processing)
            logp = self.ops.mode_logprobs(logits, truncated, torch.tensor(targets), temps, processing)
            for s, piece in zip(part, logp.split([len(rows) for rows in emitted])):
                scored[s.index].append(piece)
        for s in seqs:
            self.blocks.release(s.table)
        return scored

    def _allocate(self, requests: list[Request], capture: Capture) -> None:
        c = self.model.config
        pages = sum(-(-(len(r.prompt) + r.max_new_tokens) // self.page_size) for r in requests)
        self.blocks = BlockManager(pages, self.page_size, self.shuffle_pages)
        self.cache = PagedKVCache(c.num_hidden_layers, pages, self.page_size, c.num_key_value_heads, c.head_dim, self.model.dtype)
        self.capture = capture

    def _prefill(self, seqs: list[Sequence]) -> None:
        def last_prompt_token(s: Sequence, start: int, n: int) -> list[int]:
            return [n - 1] if start + n == s.prompt_len else []

        for part, _, emitted, logits in self._prefill_chunks(seqs, last_prompt_token):
            self._sample([s for s, rows in zip(part, emitted) if rows], logits)

    def _prefill_chunks(self, seqs: list[Sequence], emit):
        """Puts the prompts into the cache, `prefill_chunk` tokens per sequence and forward. Yields, per
        forward, its sequences, their chunk starts, the rows each emits and the logits of those rows:
        `emit(seq, start, n)` picks them among the n rows of a chunk that starts at position `start`."""
        chunk = self.prefill_chunk or max(s.prompt_len for s in seqs)
        while any(s.prefilled < s.prompt_len for s in seqs):
            part = [s for s in seqs if s.prefilled < s.prompt_len]
            starts = [s.prefilled for s in part]
            lengths = [min(chunk, s.prompt_len - s.prefilled) for s in part]
            tokens = [t for s, a, n in zip(part, starts, lengths) for t in s.request.prompt[a : a + n]]
            emitted = [emit(s, a, n) for s, a, n in zip(part, starts, lengths)]
            logits = self._forward(part, tokens, starts, lengths, emitted)
            for s, n in zip(part, lengths):
                s.prefilled += n
            yield part, starts, emitted, logits

    def _decode(self, seqs: list[Sequence]) -> None:
        tokens = [s.tokens[-1] for s in seqs]
        starts = [s.prompt_len + len(s.tokens) - 1 for s in seqs]
        logits = self._forward(seqs, tokens, starts, [1] * len(seqs), [[0]] * len(seqs))
        self._sample(seqs, logits)

    def _forward(self, seqs: list[Sequence], tokens, starts, lengths, emit: list[list[int]]) -> torch.Tensor:
        """One forward over the new tokens of `seqs`; logits of the rows `emit[i]` of sequence i's new tokens."""
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

        last_rows = torch.tensor([o + r for o, rows in zip(batch.offsets.tolist(), emit) for r in rows], dtype=torch.long)
        if self.capture:
            requests = torch.tensor([s.index for s in seqs])[batch.seq_of_token]
            locate(self.capture, requests, batch.positions, last_rows)
        hidden = self.model.hidden_states(torch.tensor(tokens), batch, ops, attend, self.capture)
        return self.model.logits(hidden[last_rows], ops, self.capture)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        if not seqs:
            return
        temps = torch.tensor([s.request.temperature for s in seqs], dtype=torch.float32)
        seeds = torch.tensor([s.request.seed for s in seqs], dtype=torch.long)
        index = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long)
        processing = [s.request.processing for s in seqs]
        # Sampled from the processed distribution whatever the mode; the mode decides what is recorded.
        truncated = self.ops.truncated(logits, temps, processing)
        tokens = self.ops.vocab_parallel_sample(truncated, temps, seeds, index)
        logp = self.ops.mode_logprobs(logits, truncated, tokens, temps, processing)
        if self.capture:
            self.capture("logprob", logp)
        for s, t, lp in zip(seqs, tokens.tolist(), logp):
            s.tokens.append(t)
            s.logprobs.append(lp.reshape(1))


def inference_copy(model: Qwen3ForCausalLM, ops: KernelSet) -> Qwen3ForCausalLM:
    """The model with its GEMM weights stored as the kernel set's GEMMs read them (`ops.inference_weight`:
    a dtype and a layout, the same values). A model that already is an inference copy is returned as it
    is: engines share it. The twin's modules are its own; a weight the kernel set reads as stored (norms,
    the table, GEMM weights on amx-bf16) is the model's own tensor, not a copy: the engine only reads it, and
    a trainer that updates weights in place gives the engine its own copy first (`weights.own_weights`).
    """
    if getattr(model, "is_inference_copy", False):
        return model
    memo = {}
    for name, param in model.named_parameters():
        gemm_weight = param.ndim >= 2 and name != "model.embed_tokens.weight"  # every matrix but the table
        memo[id(param)] = nn.Parameter(ops.inference_weight(param.data) if gemm_weight else param.data, requires_grad=False)
    twin = copy.deepcopy(model, memo)
    # A tied lm_head reads the table as a GEMM weight: its own copy. (A tensor-parallel rank's lm_head holds
    # its vocabulary slice, already its own tensor, converted above: re-tying it would score all of V.)
    if twin.lm_head.weight is twin.model.embed_tokens.weight:
        twin.lm_head.weight = torch.nn.Parameter(ops.inference_weight(twin.model.embed_tokens.weight.data),
                                                 requires_grad=False)
    twin.is_inference_copy = True
    return twin


@torch.no_grad()
def refresh_inference_copy(twin: Qwen3ForCausalLM, model: Qwen3ForCausalLM) -> None:
    """Weight sync: copies the current weights of `model` into its inference copy `twin` in place, in the
    dtypes `inference_copy` chose, as an RL framework loads the trainer's weights into its rollout engine
    after every optimizer step. The same conversion as `inference_copy`, so the rollout sees the trainer's
    weights bit for bit."""
    if twin is model:
        return
    source = dict(model.named_parameters(remove_duplicate=False))  # a tied lm_head is its own tensor in the twin
    for name, param in twin.named_parameters(remove_duplicate=False):
        param.copy_(source[name])
