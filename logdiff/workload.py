"""A workload: model, dtype, prompts, sampling and batch schedule, all deterministic from parameters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from logdiff.api import DEFAULT_PAGE_SIZE, Request
from logdiff.errors import UserError
from logdiff.weights import ModelSpec, parse_dtype

# Prompt lengths that straddle the 128-token KV block (DEFAULT_PAGE_SIZE): 1, B-1, B, B+1, and two in between.
DEFAULT_PROMPT_LENS = (1, 127, 128, 129, 17, 300)


@dataclass(frozen=True)
class Workload:
    model: str = "qwen3-moe-tiny"
    dtype: str = "fp32"
    batch_size: int = 6
    prompt_lens: tuple[int, ...] = DEFAULT_PROMPT_LENS  # one per request, cycled to batch_size
    max_new_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0
    block_size: int = DEFAULT_PAGE_SIZE  # KV cache page size
    stagger: int = 2  # request i joins the running batch at engine step i * stagger
    prefill_chunk: int | None = None

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.seed)

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
        if self.block_size < 1:
            raise UserError(
                f"block size {self.block_size} is not positive; pass --block-size 1 or more (default {DEFAULT_PAGE_SIZE})")
        if self.stagger < 0:
            raise UserError(f"stagger {self.stagger} is negative; pass --stagger 0 or more")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise UserError(f"prefill chunk {self.prefill_chunk} is not positive")
        limit = self.spec.config().max_position_embeddings
        longest = max(self.prompt_lens) + self.max_new_tokens
        if longest > limit:
            raise UserError(
                f"prompt of {max(self.prompt_lens)} + {self.max_new_tokens} new tokens exceeds the {limit} positions "
                f"of model {self.model}; shorten --prompt-lens or --max-new-tokens"
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
                Request(prompt, self.max_new_tokens, self.temperature, seed=self.seed * 1_000_003 + i, arrival=i * self.stagger)
            )
        return out

    def describe(self) -> str:
        chunk = f", prefill chunk {self.prefill_chunk}" if self.prefill_chunk else ""
        return (f"{self.model} {self.dtype}, {self.batch_size} requests, prompts {','.join(map(str, self.prompt_lens))}, "
                f"{self.max_new_tokens} new tokens, temperature {self.temperature}, KV page {self.block_size}, "
                f"stagger {self.stagger}{chunk}")

    def command_line(self) -> str:
        """The `logdiff run` options that give this workload (only those that differ from the defaults)."""
        flags = {
            "model": "--model", "dtype": "--dtype", "batch_size": "--batch-size", "prompt_lens": "--prompt-lens",
            "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "seed": "--seed",
            "block_size": "--block-size", "stagger": "--stagger", "prefill_chunk": "--prefill-chunk",
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
