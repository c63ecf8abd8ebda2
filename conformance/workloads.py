"""The catalogue's workloads, each aimed at an edge where a stack can lose bitwise parity: prompt
lengths around the 128-key KV block, decodes that cross several blocks, mixed lengths in one batch, one
request alone or twenty, requests joining mid-decode, temperature sampling, a dense model, the regimes
where engines switch kernels (contexts past 2048 tokens, 256 requests in one decode step, 9,100 prompt
tokens in one prefill step), and the workloads on which each ablation must fail."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from logdiff.api import Request
from logdiff.config import NAMED_CONFIGS
from logdiff.kernels.ablations import BREAKS_ON
from logdiff.weights import ModelSpec, save_checkpoint
from logdiff.workload import Workload

BLOCK_EDGES = (1, 127, 128, 129, 17, 300)

WORKLOADS = {
    "block-edges": Workload(prompt_lens=BLOCK_EDGES, batch_size=6, max_new_tokens=8, stagger=0),
    "joins-mid-decode": Workload(prompt_lens=BLOCK_EDGES, batch_size=6, max_new_tokens=8, stagger=2),
    "sampled": Workload(prompt_lens=(17, 129, 64, 300), batch_size=4, max_new_tokens=8, temperature=1.0, stagger=1),
    "dense": Workload(model="qwen3-dense-tiny", prompt_lens=(5, 128, 200), batch_size=3, max_new_tokens=8, stagger=1),
    "block-edges-sampled": Workload(prompt_lens=BLOCK_EDGES, batch_size=6, max_new_tokens=8, temperature=1.0, stagger=1),
    # decode crosses the 128, 256 and 384 block boundaries
    "long-decode": Workload(prompt_lens=(120, 250), batch_size=2, max_new_tokens=140, stagger=0),
    # 20 decode rows: more than one GEMM tile of rows on every tier
    "batch-20": Workload(prompt_lens=(3, 60, 127, 129), batch_size=20, max_new_tokens=6, stagger=0),
    # One prefill step of 9,100 prompt tokens (20 prompts arriving at once), past the 8,192 at which engines
    # cap a step's tokens or change kernels; the trainer's forward holds 9,180.
    "prefill-9k": Workload(prompt_lens=(440, 470), batch_size=20, max_new_tokens=4, stagger=0),
    # Regimes where engines switch kernels (split-KV decoding, batch buckets): contexts past 2048 tokens, in the
    # prompt and reached while decoding, and a decode step of 256 requests whose contexts span two KV blocks.
    "long-context": Workload(prompt_lens=(2100, 1990), batch_size=2, max_new_tokens=80, stagger=0),
    "batch-256": Workload(prompt_lens=(129, 140, 200, 7), batch_size=256, max_new_tokens=4, stagger=0),
    # The seed's workload lengths: a 2048-token prompt and a 2048-token response (40 s for the reference).
    "seed-lengths": Workload(prompt_lens=(2048,), batch_size=1, max_new_tokens=2048, stagger=0),
}

# The standard workload on which each ablation loses parity (logdiff.kernels.ablations).
ABLATION_WORKLOADS = {f"breaks-{name.removeprefix('reference-')}": Workload(**fields) for name, fields in BREAKS_ON.items()}


def with_dtype(workload: Workload, dtype: str) -> Workload:
    return dataclasses.replace(workload, dtype=dtype)


def all_at_once(requests: list[Request]) -> list[Request]:
    return [dataclasses.replace(r, arrival=0) for r in requests]


def scored_sequences(workload: Workload, seed: int = 1):
    """The workload's prompts followed by random responses: (sequences, score_from, temperatures), for
    checks of the trainer alone."""
    vocab = workload.spec.config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    requests = workload.requests()
    sequences = [list(r.prompt) + torch.randint(vocab, (r.max_new_tokens,), generator=gen).tolist() for r in requests]
    return sequences, [len(r.prompt) for r in requests], [r.temperature for r in requests]


# C9: the router rows of these experts are copies, so each pair gets bitwise equal router logits on
# every token; with top-4 of 8, a tie decides both which experts a token uses and their combine order.
TIED_MODEL = "qwen3-moe-tiny-tied"
TIED_EXPERTS = NAMED_CONFIGS[TIED_MODEL].tied_router_experts
TIED_TOP_K = NAMED_CONFIGS[TIED_MODEL].num_experts_per_tok


def write_tied_router_checkpoint(directory: Path, seed: int = 0) -> Path:
    """The tied model as a checkpoint directory (the same weights), for tests of checkpoint loading."""
    save_checkpoint(ModelSpec(TIED_MODEL, seed).build(torch.float32), directory)
    return directory
