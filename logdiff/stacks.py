"""The stack API and registry.

A stack is a (trainer, rollout engine) pair under test. A stack factory is any callable
`factory(spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack`; `logdiff` finds it by a
built-in name, by `module:attr`, or by a name that an installed package registers under the entry-point
group `logdiff.stacks`. The factory's docstring is its description in `logdiff list`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

import logdiff
from logdiff.engine import Request, RolloutEngine, RolloutOutput
from logdiff.engine.engine import DEFAULT_PAGE_SIZE, inference_copy
from logdiff.errors import UserError
from logdiff.kernelset import KernelSet
from logdiff.model import Capture
from logdiff.trainer import Trainer
from logdiff.weights import ModelSpec, dtype_name

ENTRY_POINT_GROUP = "logdiff.stacks"


class Unsupported(Exception):
    """Raised by a stack that declines a dtype or an engine option; the suite reports a skip, with this reason."""


@dataclass(frozen=True)
class EngineOptions:
    page_size: int = DEFAULT_PAGE_SIZE
    prefill_chunk: int | None = None
    shuffle_pages: int | None = None  # seed permuting the block tables


class Stack(ABC):
    """What a candidate implements. Both methods return fp32 log-probs, one tensor per sequence.

    The capture hook (optional; `logdiff bisect` needs it): `rollout` and `trainer_logprobs` accept a
    keyword `capture=None`. When one is given, the stack calls, before every model forward,
    `logdiff.capture.locate(capture, request, position, head)`: the request index (-1 for padding) and
    absolute position of each row of that forward, and the rows whose next-token logits and log-probs
    it computes; then `capture(name, tensor)` at each capture point it can observe, with the rows first,
    in the order just announced (`logits`, `logprob`: the `head` rows). Point names and their order are
    `logdiff.capture.point_names`. With `capture=None` the stack must run exactly as it does without
    the hook. `KernelStack` and the `hf` stacks implement it.
    """

    name: str = "unnamed"

    @abstractmethod
    def rollout(self, requests: Sequence[Request], options: EngineOptions = EngineOptions()) -> list[RolloutOutput]:
        """Generate `max_new_tokens` tokens per request, with the log-prob of each sampled token."""

    @abstractmethod
    def trainer_logprobs(
        self, sequences: Sequence[Sequence[int]], score_from: Sequence[int], temperatures: Sequence[float],
        grad: bool = False,
    ) -> list[torch.Tensor]:
        """Teacher-forced log p(token i | tokens < i) for i >= score_from[s] (temperature 0 scores at 1)."""

    def prompt_logprobs(
        self, sequences: Sequence[Sequence[int]], score_from: Sequence[int], temperatures: Sequence[float],
        options: EngineOptions = EngineOptions(),
    ) -> list[torch.Tensor]:
        """Optional (conformance C4): what `trainer_logprobs` returns, computed by the rollout engine from
        one prefill over each whole sequence, as vLLM's `prompt_logprobs` does."""
        raise Unsupported(f"stack {self.name} does not score given tokens with its rollout engine (prompt_logprobs)")

    def trainer_parameters(self) -> dict[str, torch.Tensor]:
        """Optional (conformance C11): the trainer's parameters by name. The suite switches their
        `requires_grad` on, differentiates `trainer_logprobs(..., grad=True)` with respect to them, and
        switches it off again."""
        raise Unsupported(f"stack {self.name} does not expose its trainer's parameters (trainer_parameters)")

    def describe(self) -> dict:
        """Versions and device, for report headers."""
        return {"name": self.name, "device": "cpu", "versions": {"logdiff": logdiff.__version__, "torch": torch.__version__}}


class KernelStack(Stack):
    """logdiff's own trainer and rollout engine on one model, running a given kernel set."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, max_model_len: int, kernels: KernelSet):
        self.name = kernels.name
        self.ops = kernels
        self.model = spec.build(dtype)
        self.trainer = Trainer(self.model, kernels)
        self.engine_model = inference_copy(self.model)

    def engine(self, options: EngineOptions) -> RolloutEngine:
        return RolloutEngine(self.engine_model, self.ops, options.page_size, options.prefill_chunk, options.shuffle_pages)

    def rollout(self, requests, options=EngineOptions(), capture: Capture = None):
        return self.engine(options).generate(list(requests), capture)

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture: Capture = None):
        return self.trainer.logprobs(sequences, score_from, temperatures, grad=grad, capture=capture)

    def prompt_logprobs(self, sequences, score_from, temperatures, options=EngineOptions()):
        return self.engine(options).prompt_logprobs(sequences, score_from, temperatures)

    def trainer_parameters(self):
        return dict(self.model.named_parameters())


StackFactory = Callable[[ModelSpec, torch.dtype, int], Stack]


def _kernel_stack(make_kernels: Callable[..., KernelSet], doc: str, wants_span: bool = False) -> StackFactory:
    def factory(spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack:
        kernels = make_kernels(max_model_len) if wants_span else make_kernels()
        return KernelStack(spec, dtype, max_model_len, kernels)

    factory.__doc__ = doc
    return factory


def builtin_stacks() -> dict[str, StackFactory]:
    from logdiff.baselines.baseline import baseline_kernels
    from logdiff.baselines.hf import hf_eager_stack, hf_stack
    from logdiff.baselines.naive import naive_kernels
    from logdiff.kernels import ablations, reference_kernels

    stacks = {
        "reference": _kernel_stack(reference_kernels, "aligned kernels: mask, order, blocks, precision all on"),
        "baseline": _kernel_stack(baseline_kernels, baseline_kernels.__doc__),
        "naive": _kernel_stack(naive_kernels, naive_kernels.__doc__, wants_span=True),
    }
    for name, make in ablations.ABLATIONS.items():
        stacks[name] = _kernel_stack(make, make.__doc__)
    stacks["hf"] = hf_stack
    stacks["hf-eager"] = hf_eager_stack
    return stacks


def resolve(name: str) -> StackFactory:
    """A built-in name, `module:attr`, or an entry point registered under `logdiff.stacks`."""
    builtins = builtin_stacks()
    if name in builtins:
        return builtins[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise UserError(f"cannot import stack module {module_name!r} ({e}); check PYTHONPATH or install it") from None
        try:
            return getattr(module, attr)
        except AttributeError:
            raise UserError(f"module {module_name!r} has no attribute {attr!r}; name the stack factory as module:attr") from None
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    known = ", ".join(sorted(builtins) + sorted(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)))
    raise UserError(f"unknown stack {name!r}; choose one of {known}, or pass module:attr")


def build(name: str, spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack:
    stack = resolve(name)(spec, dtype, max_model_len)
    stack.name = name
    return stack


def first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc and doc.strip() else ""


def platform_info() -> dict:
    return {
        "machine": platform.node(),
        "system": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "target": "cpu",
    }


__all__ = [
    "EngineOptions", "KernelStack", "Stack", "StackFactory", "Unsupported", "build", "builtin_stacks", "resolve",
    "dtype_name", "platform_info",
]
