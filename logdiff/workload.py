"""A workload: model, dtype, prompts, sampling and batch schedule, all deterministic from parameters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from logdiff.api import DEFAULT_LOGPROBS_MODE, DEFAULT_PAGE_SIZE, LOGPROB_MODES, Processing, Request
from logdiff.errors import UserError
from logdiff.weights import ModelSpec, parse_dtype

# Prompt lengths that straddle the 128-token KV block (DEFAULT_PAGE_SIZE): 1, B-1, B, B+1, and two in between.
DEFAULT_PROMPT_LENS = (1, 127, 128, 129, 17, 300)


def validate_processing(p: Processing) -> None:
    """Raises UserError for a truncation or log-prob mode no sampler could honour."""
    if p.top_k < 0:
        raise UserError(f"top-k {p.top_k} is negative; pass --top-k 0 (off) or the number of tokens to keep")
    if not 0 < p.top_p <= 1:
        raise UserError(f"top-p {p.top_p} is outside (0, 1]; pass --top-p 1 (off) or the mass to keep, e.g. 0.9")
    if not 0 <= p.min_p <= 1:
        raise UserError(f"min-p {p.min_p} is outside [0, 1]; pass --min-p 0 (off) or a fraction, e.g. 0.05")
    if p.logprobs_mode not in LOGPROB_MODES:
        raise UserError(f"log-prob mode {p.logprobs_mode!r} is unknown; pass --logprobs-mode {' or '.join(LOGPROB_MODES)}")


@dataclass(frozen=True)
class Workload:
    model: str = "qwen3-moe-tiny"
    layers: int | None = None  # the first N decoder layers only (ModelSpec.layers)
    dtype: str = "fp32"
    batch_size: int = 6
    prompt_lens: tuple[int, ...] = DEFAULT_PROMPT_LENS  # one per request, cycled to batch_size
    max_new_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0
    block_size: int = DEFAULT_PAGE_SIZE  # KV cache page size
    stagger: int = 2  # request i joins the running batch at engine step i * stagger
    prefill_chunk: int | None = None
    top_k: int = 0  # truncation of the sampled distribution and the log-prob mode (logdiff.api.Processing)
    top_p: float = 1.0
    min_p: float = 0.0
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE

    @property
    def processing(self) -> Processing:
        return Processing(self.top_k, self.top_p, self.min_p, self.logprobs_mode)

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.seed, self.layers)

    @property
    def max_model_len(self) -> int:
        """Longest context of the workload, rounded up to whole KV blocks of the default page size."""
        return -(-(max(self.prompt_lens) + self.max_new_tokens) // DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def validate(self) -> None:
        """Raises UserError for anything a run could not honour."""
        self.torch_dtype
        if self.batch_size < 1:
            raise UserError(f"batch size {self.batch_size} is not positive; pass --batch-size 1 or more")
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise UserError(f"prompt lengths {list(self.prompt_lens)} must all be >= 1; pass e.g. --prompt-lens 16,130")
        if self.max_new_tokens < 1:
            raise UserError(f"max new tokens {self.max_new_tokens} is not positive; pass --max-new-tokens 1 or more")
        if self.temperature < 0:
            raise UserError(f"temperature {self.temperature} is negative; pass --temperature 0 (greedy) or more")
        validate_processing(self.processing)
        if self.block_size < 1:
            raise UserError(
                f"block size {self.block_size} is not positive; pass --block-size 1 or more (default {DEFAULT_PAGE_SIZE})")
        if self.stagger < 0:
            raise UserError(f"stagger {self.stagger} is negative; pass --stagger 0 or more")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise UserError(f"prefill chunk {self.prefill_chunk} is not positive")
        config = self.spec.config()  # an unreadable model, a --layers depth outside it: one line
        longest = max(self.prompt_lens) + self.max_new_tokens
        if longest > config.max_position_embeddings:
            raise UserError(
                f"prompt of {max(self.prompt_lens)} + {self.max_new_tokens} new tokens exceeds the "
                f"{config.max_position_embeddings} positions of model {config.name}; shorten --prompt-lens or --max-new-tokens"
            )

    def requests(self) -> list[Request]:
        """Request i: its own prompt and sampling seed, derived from (seed, i) only."""
        vocab = self.spec.config().vocab_size
        out = []
        for i in range(self.batch_size):
            length = self.prompt_lens[i % len(self.prompt_lens)]
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            prompt = tuple(torch.randint(vocab, (length,), generator=gen).tolist())
            out.append(
                Request(prompt, self.max_new_tokens, self.temperature, seed=self.seed * 1_000_003 + i, arrival=i * self.stagger,
                        top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, logprobs_mode=self.logprobs_mode)
            )
        return out

    def describe(self) -> str:
        chunk = f", prefill chunk {self.prefill_chunk}" if self.prefill_chunk else ""
        processing = f", {self.processing.describe()}" if self.processing != Processing() else ""
        depth = f" (--layers {self.layers})" if self.layers is not None else ""
        return (f"{self.model}{depth} {self.dtype}, {self.batch_size} requests, prompts {','.join(map(str, self.prompt_lens))}, "
                f"{self.max_new_tokens} new tokens, temperature {self.temperature}{processing}, KV page {self.block_size}, "
                f"stagger {self.stagger}{chunk}")

    def command_line(self) -> str:
        """The `logdiff run` options that give this workload (only those that differ from the defaults)."""
        flags = {
            "model": "--model", "layers": "--layers", "dtype": "--dtype", "batch_size": "--batch-size",
            "prompt_lens": "--prompt-lens",
            "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "seed": "--seed",
            "block_size": "--block-size", "stagger": "--stagger", "prefill_chunk": "--prefill-chunk",
            "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p", "logprobs_mode": "--logprobs-mode",
        }
        default = Workload()
        parts = []
        for field, flag in flags.items():
            value = getattr(self, field)
            if value != getattr(default, field):
                parts.append(f"{flag} {','.join(map(str, value)) if field == 'prompt_lens' else value}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompt_lens"] = list(self.prompt_lens)
        return d
