"""The stack contract: everything a candidate stack implements or receives, in one module that needs
only torch.

A stack is a (trainer, rollout engine) pair under test. A stack factory is any callable
`factory(spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack`; `logdiff` finds it by a
built-in name, by `module:attr`, or by a name that an installed package registers under the entry-point
group `logdiff.stacks` (see `logdiff.stacks`). The factory's docstring is its line in `logdiff list`.
Any two stacks pair up: `--rollout R --trainer T` (or the stack name `R+T`) runs R's rollout engine against
T's trainer on the same weights; a factory may return a `TrainerOnly` or a `RolloutOnly` side, which runs
only in such a pair.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

ENTRY_POINT_GROUP = "logdiff.stacks"
DEFAULT_PAGE_SIZE = 128  # tokens per KV page; the seed's KV block

Capture = Optional[Callable[[str, torch.Tensor], None]]


class Unsupported(Exception):
    """Raised by a stack that declines a dtype, an engine option or a property; the suite reports a skip
    with this reason, never a pass."""


# What a recorded log-prob means (docs/logprob-semantics.md). "processed" (the default): the log-prob under
# the distribution the token was sampled from (temperature, then top-k, top-p, min-p, renormalised), the
# behaviour policy's probability in an RL importance ratio; a token outside the kept set is impossible
# (-inf). "raw": log_softmax of the model's logits at temperature 1, whatever the sampler did.
LOGPROB_MODES = ("processed", "raw")
DEFAULT_LOGPROBS_MODE = "processed"


@dataclass(frozen=True)
class Processing:
    """What the sampler does to a sequence's tempered logits, and which distribution its log-probs are taken
    from. Truncation applies to sampled tokens only (temperature > 0): a greedy token is the argmax, kept by
    every truncation, and scores untruncated at temperature 1, as vLLM and transformers do.

    top_k: keep the k likeliest tokens (0: off); top_p: keep the likeliest tokens until their mass reaches
    top_p (1: off); min_p: keep tokens at least min_p times as likely as the likeliest (0: off). Applied in
    that order, top-p on the top-k set renormalised; a token tied with the last one kept is kept too.
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def truncation(self) -> str:
        """'top-k 50, top-p 0.9' (the truncations that are on), or 'no truncation'."""
        parts = [f"top-k {self.top_k}"] * (self.top_k > 0) + [f"top-p {self.top_p:g}"] * (self.top_p < 1.0) + (
            [f"min-p {self.min_p:g}"] * (self.min_p > 0.0))
        return ", ".join(parts) or "no truncation"

    def describe(self) -> str:
        """'top-k 50, top-p 0.9, processed log-probs'."""
        return f"{self.truncation()}, {self.logprobs_mode} log-probs"


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # per-request sampling seed
    arrival: int = 0  # engine step at which the request joins the batch
    top_k: int = 0  # truncation of the sampled distribution, and the log-prob mode: see Processing
    top_p: float = 1.0
    min_p: float = 0.0
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE

    @property
    def processing(self) -> Processing:
        return Processing(self.top_k, self.top_p, self.min_p, self.logprobs_mode)


@dataclass
class RolloutOutput:
    tokens: list[int]
    logprobs: torch.Tensor  # fp32 [len(tokens)]: what the engine computed when it sampled each token


@dataclass(frozen=True)
class EngineOptions:
    page_size: int = DEFAULT_PAGE_SIZE
    prefill_chunk: int | None = None
    shuffle_pages: int | None = None  # seed permuting the block tables


PADDINGS = ("packed", "right", "left")


@dataclass(frozen=True)
class TrainerLayout:
    """How a trainer lays a batch out for its forward, the knobs RL trainers expose (conformance C13): none of
    them may change a sequence's log-probs. `padding`: "packed" concatenates the sequences (varlen, verl's
    remove-padding), "right" and "left" pad each to the longest plus `extra_padding` columns; `token_budget`
    caps the tokens per forward (verl's dynamic batch size), None: no cap."""

    micro_batch: int | None = None  # sequences per forward; None: all in one
    padding: str = "packed"
    extra_padding: int = 0
    token_budget: int | None = None

    def describe(self) -> str:
        """'micro-batch 2, right padding +5, token budget 512 per forward'."""
        padding = self.padding if self.padding == "packed" else f"{self.padding} padding +{self.extra_padding}"
        budget = f", token budget {self.token_budget} per forward" if self.token_budget else ""
        return f"micro-batch {self.micro_batch or 'all'}, {padding}{budget}"

    def forwards(self, lengths: Sequence[int]) -> list[list[int]]:
        """The sequences (indices, in order) each forward holds: `micro_batch` at a time, a forward closed early
        when the next sequence would take it past `token_budget` (a longer sequence goes alone)."""
        forwards: list[list[int]] = [[]]
        tokens = 0
        for i, length in enumerate(lengths):
            full = self.micro_batch is not None and len(forwards[-1]) == self.micro_batch
            over = self.token_budget is not None and tokens + length > self.token_budget
            if forwards[-1] and (full or over):
                forwards.append([])
                tokens = 0
            forwards[-1].append(i)
            tokens += length
        return forwards

    def score(self, score: Callable[..., list], sequences: Sequence[Sequence[int]], *columns: Sequence | None) -> list:
        """`score(sequences, *columns)` once per forward, every column cut to that forward's sequences (a None column
        stays None), the results put back in the sequences' order."""
        out: list = [None] * len(sequences)
        for forward in self.forwards([len(s) for s in sequences]):
            picked = [None if c is None else [c[i] for i in forward] for c in (sequences, *columns)]
            for i, result in zip(forward, score(*picked)):
                out[i] = result
        return out


@dataclass(frozen=True)
class TrainerInputs:
    """What the trainer scores after a rollout: prompt + response, scored from the first response token,
    at the temperature, truncation and log-prob mode the rollout sampled and recorded with."""

    sequences: list[list[int]]
    score_from: list[int]
    temperatures: list[float]
    processing: list[Processing] | None = None  # None: Processing() for every sequence

    @classmethod
    def after(cls, requests: Sequence[Request], outputs: Sequence[RolloutOutput]) -> TrainerInputs:
        return cls(
            [list(r.prompt) + o.tokens for r, o in zip(requests, outputs)],
            [len(r.prompt) for r in requests],
            [r.temperature for r in requests],
            [r.processing for r in requests],
        )

    def score(self, stack: Stack, grad: bool = False) -> list[torch.Tensor]:
        """`stack.trainer_logprobs` of these inputs; see `processing_kwargs`."""
        return stack.trainer_logprobs(self.sequences, self.score_from, self.temperatures, grad=grad,
                                      **processing_kwargs(stack, stack.trainer_logprobs, self.processing))


def processing_kwargs(stack: Stack, method: Callable, processing: Sequence[Processing] | None) -> dict:
    """`processing=` for a scoring method (`trainer_logprobs`, `prompt_logprobs`), passed only where some
    sequence is not scored as `Processing()`: a stack written before truncation and log-prob modes existed
    scores plain workloads as it always did, and declines the others."""
    if processing is None or all(p == Processing() for p in processing):
        return {}
    if "processing" not in inspect.signature(method).parameters:
        raise Unsupported(f"stack {stack.name}'s {method.__name__} takes no processing= (top-k, top-p, min-p, "
                          "log-prob mode): it cannot score what this rollout sampled")
    return {"processing": list(processing)}


class Stack(ABC):
    """What a candidate implements. Both paths return fp32 log-probs on the CPU, one tensor per sequence.

    Capabilities are attributes, read by the suite before it asks for anything:
      device            where the stack computes ("cpu", "cuda:0", "npu:0"), for report headers
      supports_capture  `rollout` and `trainer_logprobs` take `capture=` (`logdiff bisect` needs it)
      parallel_degrees  {"tp": tensor-parallel degrees, "ep": expert-parallel degrees} that `parallel`
                        accepts (conformance C8); (1,) each: the stack runs in one process only
      trainer_layouts   {TrainerLayout field: the values its trainer honours, its default first} (conformance
                        C13); a stack that names any takes `layout: TrainerLayout | None` in `trainer_logprobs`
                        (None: its default layout); token budgets are taken at or above the longest sequence

    Isolation is of state, not of weight bytes: the trainer and the rollout engine may read the same
    read-only weight tensors (a checkpoint mapped once), but neither may read what the other computed
    (KV cache, logits, log-probs, activations), so C0/C3 compare two computations, not one result read
    twice. A stack whose trainer changes weights in place (`trainer_parameters`) gives it its own copy first.

    The capture protocol: when `capture` is given, the stack calls, before every model forward,
    `locate(capture, request, position, head)`: the request index (-1 for padding) and absolute position
    of each row of that forward, and the rows whose next-token logits and log-probs it computes; then
    `capture(name, tensor)` at each capture point it can observe, rows first, in the order just announced
    (`logits`, `logprob`: the `head` rows). Point names and their order are
    `logdiff.bisect.capture.point_names`. With `capture=None` the stack runs exactly as without the hook.
    A stack that runs a path on several ranks sends each rank a copy of the capture (it pickles), lets
    each rank fill its copy as above, and hands the copies back in rank order with `capture.add_ranks(copies)`,
    each marked with `mark_rank(rank, tp, ep, collectives)` (see logdiff.bisect.capture.Recorder and
    logdiff.parallel); a rank's tensors are what that rank holds (its heads, its vocabulary slice).
    """

    name: str = "unnamed"
    device: str = "cpu"
    supports_capture: bool = False
    parallel_degrees: dict[str, tuple[int, ...]] = {"tp": (1,), "ep": (1,)}
    trainer_layouts: dict[str, tuple] = {}

    @abstractmethod
    def rollout(self, requests: Sequence[Request], options: EngineOptions = EngineOptions()) -> list[RolloutOutput]:
        """Generate `max_new_tokens` tokens per request, with the log-prob of each sampled token."""

    @abstractmethod
    def trainer_logprobs(
        self, sequences: Sequence[Sequence[int]], score_from: Sequence[int], temperatures: Sequence[float],
        grad: bool = False,
    ) -> list[torch.Tensor]:
        """Teacher-forced log p(token i | tokens < i) for i >= score_from[s] (temperature 0 scores at 1).

        A stack that honours truncation and log-prob modes takes `processing: list[Processing] | None`
        (one per sequence; None: Processing() each) and scores each token in its sequence's mode, with
        the truncation the rollout sampled under; the suite passes it only when some sequence needs it."""

    def prompt_logprobs(
        self, sequences: Sequence[Sequence[int]], score_from: Sequence[int], temperatures: Sequence[float],
        options: EngineOptions = EngineOptions(),
    ) -> list[torch.Tensor]:
        """Optional (conformance C4): what `trainer_logprobs` returns, computed by the rollout engine from
        one prefill over each whole sequence, as vLLM's `prompt_logprobs` does."""
        raise Unsupported(f"stack {self.name} does not score given tokens with its rollout engine (prompt_logprobs)")

    def trainer_parameters(self) -> dict[str, torch.Tensor]:
        """Optional (conformance C11, `logdiff train`): the trainer's parameters by name. The suite switches
        their `requires_grad` on, differentiates `trainer_logprobs(..., grad=True)` with respect to them,
        and switches it off again."""
        raise Unsupported(f"stack {self.name} does not expose its trainer's parameters (trainer_parameters)")

    def sync_weights(self) -> None:
        """Optional (`logdiff train`): after the trainer's parameters changed in place (an optimizer step
        on `trainer_parameters()`), make the rollout engine generate with them, as an RL framework's weight
        sync does after every step (verl's FSDP -> vLLM `load_weights`). A stack whose engine holds its own
        copy of the weights copies them over here; one whose engine runs on the trainer's tensors has
        nothing to do."""
        raise Unsupported(f"stack {self.name} cannot load its trainer's updated weights into its rollout engine (sync_weights)")

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Optional (conformance C14 for a pair `R+T`): the rollout engine takes these weights in place, through
        its own weight-update path (vLLM's in-place `reload_weights` in its worker), named as `trainer_parameters`
        names them (the transformers model's parameter names); what `PairedStack.sync_weights` calls with the
        other stack's trainer parameters."""
        raise Unsupported(f"stack {self.name}'s rollout engine cannot take new weights in place (load_weights)")

    def parallel(self, trainer_tp: int = 1, rollout_tp: int = 1, ep: int = 1) -> Stack:
        """Optional (conformance C8, `logdiff run --tp/--ep`): this stack with its trainer sharded over
        `trainer_tp` tensor-parallel ranks, its rollout engine over `rollout_tp`, the experts of both over
        `ep` expert-parallel ranks. Log-probs come back whole, as from one process."""
        raise Unsupported(f"stack {self.name} runs in one process only (parallel)")

    def describe(self) -> dict:
        """Versions and device, for report headers."""
        from logdiff import __version__

        return {"name": self.name, "device": self.device, "versions": {"logdiff": __version__, "torch": torch.__version__}}


class TrainerOnly(Stack):
    """A trainer registered alone (e.g. an RL framework's actor): it runs paired with a rollout engine,
    `--trainer NAME --rollout R`. Its factory says so with `factory.side = "trainer"`, so that the suite
    refuses it alone before building it."""

    def rollout(self, requests, options=EngineOptions()):
        raise Unsupported(f"{self.name} is a trainer only: pair it with a rollout engine (--trainer {self.name} --rollout NAME)")


class RolloutOnly(Stack):
    """A rollout engine registered alone: it runs paired with a trainer, `--rollout NAME --trainer T`; its
    factory sets `factory.side = "rollout"`."""

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False):
        raise Unsupported(f"{self.name} is a rollout engine only: pair it with a trainer (--rollout {self.name} --trainer NAME)")


def locate(capture: Capture, request: torch.Tensor, position: torch.Tensor, head: torch.Tensor | None = None) -> None:
    """Tells a row-aware capture which (request, position) each row of the coming forward holds.

    request [N] (-1 for padding rows), position [N], head: the rows whose logits and log-probs follow
    (None: all N). Plain callables have no `locate` and are left alone.
    """
    announce = getattr(capture, "locate", None)
    if announce is not None:
        announce(request, position, head)


StackFactory = Callable[..., Stack]  # (spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack
