"""The machine's limits and each case's share of them: how far a stack is from what the hardware allows.

Measured once per `logdiff bench` run, with torch's current thread count:
  bandwidth   bytes/s of a reduction over a 256 MiB fp32 tensor (streamed from memory, far beyond any
              cache), best of 5
  GEMM peak   FLOP/s of torch's 2048 x 2048 x 2048 GEMM in the dtype it runs natively for the model
              (`native_gemm_dtype`: bf16 through oneDNN's AMX or AVX512-BF16 kernels where the CPU has
              them, fp32 where bf16 upcasts), best of 5: the machine's peak, not logdiff's GEMM's
Bounds, from the model's shapes (`ModelCosts`):
  decode      tokens/s <= batch x bandwidth / bytes one decode step must read: every non-expert matrix,
              the experts the batch's tokens can reach (E x (1 - (1 - k/E)^B), uniform routing) and the
              KV cache, all in the model dtype (the bytes of the model itself; a stack that keeps an
              upcast copy of its weights reads more, and that shows as a lower fraction)
  trainer     tokens/s <= GEMM peak / (3 x forward FLOPs per token): forward + backward
  prefill     tokens/s <= GEMM peak / forward FLOPs per token
Forward FLOPs per token: 2 x active parameters (GEMM weights a token meets, experts: top-k) plus the
attention's 4 x layers x heads x head_dim x (keys a query sees, on average); the vocabulary projection
counts for the tokens that need it only (a prefill's last token per prompt, a trainer's scored tokens: a
bound that charged it to every prompt token read 1.1x the "bound" at Qwen3-0.6B's 151936 words). rl-step and the kernel
cases have no single bound and get none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from logdiff.bench.cases import Case
from logdiff.config import ModelConfig
from logdiff.kernels.linear import native_gemm_dtype

BANDWIDTH_ELEMENTS = 64 * 2**20  # 256 MiB of fp32
GEMM_SIZE = 2048
TRIES = 5


def measure_machine(model_dtype: torch.dtype) -> dict:
    """Memory bandwidth (bytes/s) and GEMM peak (FLOP/s) of this machine now, best of TRIES each."""
    x = torch.ones(BANDWIDTH_ELEMENTS)
    best = float("inf")
    for _ in range(TRIES):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    bandwidth = x.numel() * x.element_size() / best
    del x
    compute = native_gemm_dtype(model_dtype)
    a = torch.randn(GEMM_SIZE, GEMM_SIZE).to(compute)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE).to(compute)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(TRIES):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return {"bandwidth_bytes_per_s": bandwidth, "gemm_flop_per_s": 2 * GEMM_SIZE**3 / best,
            "gemm_dtype": str(compute).removeprefix("torch."), "threads": torch.get_num_threads(),
            "method": f"bandwidth: sum over {BANDWIDTH_ELEMENTS * 4 >> 20} MiB fp32; peak: {GEMM_SIZE}^3 GEMM; "
                      f"best of {TRIES}"}


@dataclass(frozen=True)
class ModelCosts:
    config: ModelConfig
    dtype_bytes: int

    def _matrices(self) -> tuple[int, int]:
        """(parameters every token meets, parameters of one expert)."""
        c = self.config
        attn = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        attn += c.num_attention_heads * c.head_dim * c.hidden_size
        dense, expert = c.num_hidden_layers * attn + c.vocab_size * c.hidden_size, 3 * c.hidden_size * c.moe_intermediate_size
        for layer in range(c.num_hidden_layers):
            if c.layer_is_moe(layer):
                dense += c.num_experts * c.hidden_size  # router
            else:
                dense += 3 * c.hidden_size * c.intermediate_size
        return dense, expert

    @property
    def moe_layers(self) -> int:
        return sum(self.config.layer_is_moe(i) for i in range(self.config.num_hidden_layers))

    def active_params(self) -> int:
        dense, expert = self._matrices()
        return dense + self.moe_layers * self.config.num_experts_per_tok * expert

    def forward_flops_per_token(self, mean_keys: float, projected: float = 1.0) -> float:
        """FLOPs of a forward per token, of which the share `projected` meets the vocabulary projection (a
        prefill projects each prompt's last token only, a trainer the scored tokens only)."""
        c = self.config
        skipped = 2 * (1 - projected) * c.vocab_size * c.hidden_size
        return 2 * self.active_params() - skipped + 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * mean_keys

    def decode_step_bytes(self, batch: int, context: float) -> float:
        c = self.config
        dense, expert = self._matrices()
        reached = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** batch) if c.is_moe else 0
        kv = batch * context * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim
        return (dense + self.moe_layers * reached * expert + kv) * self.dtype_bytes


def case_bound(case: Case, costs: ModelCosts, machine: dict) -> dict | None:
    """The case's bound in tokens/s and what limits it, or None (rl-step, kernel cases)."""
    if case.kind == "decode":
        context = case.prompt_len + case.new_tokens / 2  # mean keys per decode step
        step = costs.decode_step_bytes(case.batch, context)
        return {"limit": "memory bandwidth", "bytes_per_token": step / case.batch,
                "bound_tokens_per_s": case.batch * machine["bandwidth_bytes_per_s"] / step}
    if case.kind in ("trainer", "prefill"):
        length = case.prompt_len + case.new_tokens if case.kind == "trainer" else case.prompt_len
        projected = case.new_tokens / length if case.kind == "trainer" else 1 / length
        flops = costs.forward_flops_per_token((length + 1) / 2, projected) * (3 if case.kind == "trainer" else 1)
        return {"limit": "GEMM peak", "flops_per_token": flops, "bound_tokens_per_s": machine["gemm_flop_per_s"] / flops}
    return None
