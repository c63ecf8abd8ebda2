"""The built-in stacks and the registry that finds any stack by name.

`KernelStack` is logdiff's own trainer and paged rollout engine on one model, running one kernel set;
`reference`, `baseline`, `naive` and the ablations are KernelStacks. `resolve` finds a factory by
built-in name, `module:attr`, or entry point (group `logdiff.stacks`); `StackCache` builds each stack
once per model and dtype and remembers a stack that declined.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from typing import Callable

import torch

from logdiff import devices
from logdiff.api import ENTRY_POINT_GROUP, Capture, EngineOptions, Stack, StackFactory, Unsupported
from logdiff.engine.engine import RolloutEngine, inference_copy, refresh_inference_copy
from logdiff.errors import UserError
from logdiff.kernelset import KernelSet
from logdiff.trainer import Trainer
from logdiff.weights import ModelSpec, own_weights

# The stack lists the commands, sessions and benchmarks default to.
KERNEL_STACKS = ("reference", "baseline", "naive")  # kernel sets compared at the kernel level
RUN_STACKS = ("reference", "baseline")  # `logdiff run`
BENCH_STACKS = ("reference", "baseline", "naive", "hf")  # `logdiff bench`, perf/, asv
TRAIN_STACKS = ("reference", "baseline", "reference-no-precision")  # `logdiff train`


class KernelStack(Stack):
    """logdiff's own trainer and rollout engine on one model, running a given kernel set."""

    supports_capture = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, max_model_len: int, kernels: KernelSet):
        self.name = kernels.name
        self.ops = kernels
        device = devices.current()
        if kernels.devices is not None and device.type not in kernels.devices:
            raise Unsupported(f"kernel set {kernels.name} has order-fixed kernels for {', '.join(kernels.devices)} only, "
                              f"not {device.type}: no verdict it has not earned")
        self.spec, self.max_model_len = spec, max_model_len
        self.model = spec.build(dtype)
        self.device = str(next(self.model.parameters()).device)
        self.trainer = Trainer(self.model, kernels)

    @functools.cached_property
    def engine_model(self):
        """Made on the first rollout: an instance that only scores (the trainer side of a run) holds one model."""
        return inference_copy(self.model, self.ops)

    def engine(self, options: EngineOptions) -> RolloutEngine:
        return RolloutEngine(self.engine_model, self.ops, options.page_size, options.prefill_chunk, options.shuffle_pages)

    def rollout(self, requests, options=EngineOptions(), capture: Capture = None):
        outputs = self.engine(options).generate(list(requests), capture)
        for out in outputs:
            out.logprobs = out.logprobs.cpu()
        return outputs

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture: Capture = None, processing=None):
        return [t.cpu() for t in self.trainer.logprobs(sequences, score_from, temperatures, grad=grad, capture=capture,
                                                       processing=processing)]

    def prompt_logprobs(self, sequences, score_from, temperatures, options=EngineOptions(), processing=None):
        return [t.cpu() for t in self.engine(options).prompt_logprobs(sequences, score_from, temperatures, processing)]

    def describe(self) -> dict:
        return {**super().describe(), "kernels": self.ops.provenance()}

    def trainer_parameters(self):
        self._own_weights()
        return dict(self.model.named_parameters())

    def sync_weights(self):
        self._own_weights()
        refresh_inference_copy(self.engine_model, self.model)

    def _own_weights(self):
        """The trainer updates its weights in place and the sync writes the engine's: both get their own
        copies first (until then they read the weights every build of the spec shares)."""
        if not getattr(self, "owns_weights", False):
            own_weights(self.model, self.engine_model)
            self.owns_weights = True

    @property
    def parallel_degrees(self):
        from logdiff.parallel import EP_DEGREES, TP_DEGREES

        return {"tp": TP_DEGREES, "ep": EP_DEGREES} if self._shardable else Stack.parallel_degrees

    @property
    def _shardable(self) -> bool:
        """Built-in kernel sets on the CPU: each rank rebuilds the kernel set by name in its own process (gloo)."""
        return self.ops.name in builtin_kernel_sets() and self.device == "cpu"

    def parallel(self, trainer_tp=1, rollout_tp=1, ep=1):
        from logdiff.parallel import ShardedStack

        if not self._shardable:
            return super().parallel(trainer_tp, rollout_tp, ep)
        return ShardedStack(self, trainer_tp, rollout_tp, ep)


def builtin_kernel_sets() -> dict[str, tuple[Callable[[int], KernelSet], str]]:
    """Name -> (kernel set from max_model_len, description) of every KernelStack."""
    from logdiff.baselines.baseline import baseline_kernels
    from logdiff.baselines.naive import naive_kernels
    from logdiff.kernels import ablations, reference_kernels

    sets = {
        "reference": (lambda span: reference_kernels(), "aligned kernels: mask, order, blocks, precision all on"),
        "baseline": (lambda span: baseline_kernels(), baseline_kernels.__doc__),
        "naive": (naive_kernels, naive_kernels.__doc__),  # attention spans the whole context
    }
    for name, make in (ablations.ABLATIONS | ablations.PARALLEL_ABLATIONS).items():
        sets[name] = (lambda span, make=make: make(), make.__doc__)
    return sets


def builtin_stacks() -> dict[str, StackFactory]:
    from logdiff.baselines.hf import hf_eager_stack, hf_stack
    from logdiff.baselines.openai import openai_hf_stack, openai_stack
    from logdiff.baselines.vllm import ascend_stack, vllm_batch_invariant_stack, vllm_hf_stack, vllm_stack

    stacks = {}
    for name, (make, doc) in builtin_kernel_sets().items():
        def factory(spec: ModelSpec, dtype: torch.dtype, max_model_len: int, make=make) -> Stack:
            return KernelStack(spec, dtype, max_model_len, make(max_model_len))

        factory.__doc__ = doc
        stacks[name] = factory
    stacks["hf"] = hf_stack
    stacks["hf-eager"] = hf_eager_stack
    # Rollout engines in another process or a server (logdiff.remote); `all` leaves them out.
    stacks.update({"vllm": vllm_stack, "vllm+hf": vllm_hf_stack, "vllm-batch-invariant": vllm_batch_invariant_stack,
                   "ascend": ascend_stack, "openai": openai_stack, "openai+hf": openai_hf_stack})
    return stacks


EXTERNAL_STACKS = ("vllm", "vllm+hf", "vllm-batch-invariant", "ascend", "openai", "openai+hf")


def unavailable(factory: StackFactory) -> str | None:
    """Why a stack cannot run on this host (its factory's optional `unavailable()`), or None."""
    check = getattr(factory, "unavailable", None)
    return check() if check else None


def require(name: str) -> StackFactory:
    """`resolve`, and fail in one line before any work if the stack cannot run on this host (its engine is not
    installed, no server named)."""
    factory = resolve(name)
    reason = unavailable(factory)
    if reason:
        raise UserError(f"stack {name!r} cannot run here: {reason}")
    return factory


def plugin_stacks() -> dict[str, str]:
    """Entry-point name -> `module:attr` of every installed plugin stack."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


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
    known = ", ".join(sorted(builtins) + sorted(plugin_stacks()))
    raise UserError(f"unknown stack {name!r}; choose one of {known}, or pass module:attr")


def build(name: str, spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack:
    return resolve(name)(spec, dtype, max_model_len)


def parallel_factory(name: str, layout: dict) -> StackFactory:
    """Stack `name` sharded as `layout` (trainer_tp, rollout_tp, ep; spawns its ranks, rank 0 gathers the
    log-probs); `name`'s own factory for one process."""
    if not layout:
        return resolve(name)

    def factory(spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack:
        return resolve(name)(spec, dtype, max_model_len).parallel(**layout)

    return factory


class StackCache:
    """Builds each (stack, model spec, dtype, max_model_len) once: building copies the weights. A stack that
    declined (`Unsupported`) declines again from the cache. `keep_one_model` frees a stack's earlier
    models when it builds another (benchmarks at qwen3-moe-small sizes)."""

    def __init__(self, keep_one_model: bool = False):
        self.built: dict[tuple, Stack | Unsupported] = {}
        self.keep_one_model = keep_one_model

    def get(self, name: str | StackFactory, spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack:
        """`name`: anything `resolve` takes, or a factory itself."""
        key = (name, spec, dtype, max_model_len)
        if key not in self.built:
            if self.keep_one_model:
                for old in [k for k in self.built if k[0] == name]:
                    del self.built[old]
            try:
                factory = resolve(name) if isinstance(name, str) else name
                self.built[key] = factory(spec, dtype, max_model_len)
            except Unsupported as e:
                self.built[key] = e
        if isinstance(self.built[key], Unsupported):
            raise self.built[key]
        return self.built[key]


def first_line(doc: str | None) -> str:
    return doc.strip().splitlines()[0] if doc and doc.strip() else ""
