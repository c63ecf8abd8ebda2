"""The built-in stacks and the registry that finds any stack by name.

`KernelStack` is logdiff's own trainer and paged rollout engine on one model, running one kernel set;
`reference`, `baseline`, `naive` and the ablations are KernelStacks. `PairedStack` is one stack's rollout
engine against another's trainer (`--rollout R --trainer T`, the name `R+T`); `vllm`, `openai` and `ascend`
are vLLM's, a server's and vllm-ascend's engines paired with the reference trainer. `resolve` finds a factory
by built-in name, `R+T`, `module:attr`, or entry point (group `logdiff.stacks`); `StackCache` builds each
stack once per model and dtype and remembers a stack that declined.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from typing import Callable

import torch

from logdiff import devices
from logdiff.api import (
    ENTRY_POINT_GROUP,
    Capture,
    EngineOptions,
    Stack,
    StackFactory,
    TrainerLayout,
    Unsupported,
    processing_kwargs,
)
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
    # The trainer packs every sequence into one forward (varlen); it can also run them a few at a time.
    trainer_layouts = {"micro_batch": (None, 1, 2), "token_budget": (None, 512)}

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, max_model_len: int, kernels: KernelSet):
        self.name = kernels.name
        self.ops = kernels
        device = devices.current()
        if kernels.devices is not None and device.type not in kernels.devices:
            raise Unsupported(f"kernel set {kernels.name} has order-fixed kernels for {', '.join(kernels.devices)} only, "
                              f"not {device.type}: no verdict it has not earned")
        self.spec, self.max_model_len = spec, max_model_len
        self.model = spec.build(dtype, kernels.inference_weight)
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

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture: Capture = None, processing=None,
                         layout: TrainerLayout | None = None):
        layout = layout or TrainerLayout()
        if layout != TrainerLayout() and capture is not None:
            raise Unsupported("a capture follows one packed forward; score with the default layout to bisect")

        def score(sequences, score_from, temperatures, processing):
            return [t.cpu() for t in self.trainer.logprobs(sequences, score_from, temperatures, grad=grad, capture=capture,
                                                           processing=processing)]

        return layout.score(score, sequences, score_from, temperatures, processing)

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

    @torch.no_grad()
    def load_weights(self, weights):
        self._own_weights()
        for name, param in self.model.named_parameters():
            param.copy_(weights[name])
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


class PairedStack(Stack):
    """One stack's rollout engine against another stack's trainer, on the same weights (both are built from the
    spec). Each side keeps its own capabilities: capture where both capture, the trainer's layouts, the
    rollout's `prompt_logprobs`, the trainer's parameters; the weight sync hands the trainer's parameters to the
    rollout engine's `load_weights`."""

    def __init__(self, rollout: Stack, trainer: Stack, name: str | None = None):
        self.rollout_side = rollout.rollout_side if isinstance(rollout, PairedStack) else rollout
        self.trainer_side = trainer.trainer_side if isinstance(trainer, PairedStack) else trainer
        self.name = name or f"{rollout.name}+{trainer.name}"
        self.device = " / ".join(dict.fromkeys([self.rollout_side.device, self.trainer_side.device]))
        self.supports_capture = self.rollout_side.supports_capture and self.trainer_side.supports_capture
        self.trainer_layouts = self.trainer_side.trainer_layouts

    def rollout(self, requests, options=EngineOptions(), capture: Capture = None):
        return self.rollout_side.rollout(requests, options, **({"capture": capture} if capture is not None else {}))

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture: Capture = None, processing=None,
                         layout: TrainerLayout | None = None):
        side = self.trainer_side
        kwargs = processing_kwargs(side, side.trainer_logprobs, processing)
        kwargs.update({"capture": capture} if capture is not None else {})
        kwargs.update({"layout": layout} if layout is not None else {})
        return side.trainer_logprobs(sequences, score_from, temperatures, grad=grad, **kwargs)

    def prompt_logprobs(self, sequences, score_from, temperatures, options=EngineOptions(), processing=None):
        side = self.rollout_side
        return side.prompt_logprobs(sequences, score_from, temperatures, options,
                                    **processing_kwargs(side, side.prompt_logprobs, processing))

    def trainer_parameters(self):
        return self.trainer_side.trainer_parameters()

    def sync_weights(self) -> None:
        """The trainer's current weights into the rollout engine, through the engine's own `load_weights`."""
        self.rollout_side.load_weights({name: p.detach() for name, p in self.trainer_side.trainer_parameters().items()})

    def start(self) -> None:
        _call_optional(self.rollout_side, "start")

    def settle(self) -> None:
        _call_optional(self.rollout_side, "settle")

    def close(self) -> None:
        for side in (self.rollout_side, self.trainer_side):
            _call_optional(side, "close")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def describe(self) -> dict:
        rollout, trainer = self.rollout_side.describe(), self.trainer_side.describe()
        info = super().describe()
        info["versions"].update({**rollout.get("versions", {}), **trainer.get("versions", {})})
        return {**info, "rollout": rollout, "trainer": trainer}


def _call_optional(stack: Stack, method: str) -> None:
    """Engines elsewhere start, settle and close (logdiff.remote); a stack in this process has nothing to do."""
    call = getattr(stack, method, None)
    if call is not None:
        call()


def paired(rollout: StackFactory, trainer: StackFactory, name: str, trainer_name: str) -> StackFactory:
    """The factory of `rollout`'s engine against `trainer`'s trainer (the stack `trainer_name`'s), named `name`;
    it runs where both can."""

    def factory(spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack:
        return PairedStack(rollout(spec, dtype, max_model_len), trainer(spec, dtype, max_model_len), name)

    factory.__doc__ = f"{first_line(rollout.__doc__)} as rollout, {trainer_name}'s trainer"
    factory.unavailable = lambda: unavailable(rollout) or unavailable(trainer)
    return factory


def pair_name(rollout: str, trainer: str) -> str:
    """The stack name of `--rollout R --trainer T`."""
    return f"{rollout}+{trainer}"


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
    from logdiff.baselines.openai import openai_rollout
    from logdiff.baselines.verl import verl_trainer
    from logdiff.baselines.vllm import ascend_rollout, vllm_batch_invariant_rollout, vllm_rollout

    stacks = {}
    for name, (make, doc) in builtin_kernel_sets().items():
        def factory(spec: ModelSpec, dtype: torch.dtype, max_model_len: int, make=make) -> Stack:
            return KernelStack(spec, dtype, max_model_len, make(max_model_len))

        factory.__doc__ = doc
        stacks[name] = factory
    stacks["hf"] = hf_stack
    stacks["hf-eager"] = hf_eager_stack
    # Rollout engines in another process or a server (logdiff.remote), with the reference trainer; any other
    # trainer by `--trainer` (`vllm+hf`). `all` leaves them out, and verl's trainer, which runs only in a pair.
    for name, rollout in (("vllm", vllm_rollout), ("vllm-batch-invariant", vllm_batch_invariant_rollout),
                          ("ascend", ascend_rollout), ("openai", openai_rollout)):
        stacks[name] = paired(rollout, stacks["reference"], name, "reference")
    stacks["verl"] = verl_trainer
    return stacks


EXTERNAL_STACKS = ("vllm", "vllm-batch-invariant", "ascend", "openai", "verl")


def unavailable(factory: StackFactory) -> str | None:
    """Why a stack cannot run on this host (its factory's optional `unavailable()`), or None."""
    check = getattr(factory, "unavailable", None)
    return check() if check else None


def require(name: str) -> StackFactory:
    """`resolve`, and fail in one line before any work if the stack cannot run on this host (its engine is not
    installed, no server named)."""
    factory = resolve_whole(name)
    reason = unavailable(factory)
    if reason:
        raise UserError(f"stack {name!r} cannot run here: {reason}")
    return factory


def plugin_stacks() -> dict[str, str]:
    """Entry-point name -> `module:attr` of every installed plugin stack."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def resolve(name: str) -> StackFactory:
    """A built-in name, an entry point registered under `logdiff.stacks`, a pair `ROLLOUT+TRAINER` of any two
    names, or `module:attr`."""
    builtins = builtin_stacks()
    if name in builtins:
        return builtins[name]
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    if "+" in name:
        rollout, _, trainer = name.partition("+")
        return paired(resolve(rollout), resolve(trainer), name, trainer)
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
    known = ", ".join(sorted(builtins) + sorted(plugin_stacks()))
    raise UserError(f"unknown stack {name!r}; choose one of {known}, a pair ROLLOUT+TRAINER, or pass module:attr")


def resolve_whole(name: str) -> StackFactory:
    """`resolve`, refusing a trainer or rollout engine registered alone (`factory.side`): it runs only in a pair."""
    factory = resolve(name)
    side = getattr(factory, "side", None)
    if side:
        other = "rollout" if side == "trainer" else "trainer"
        raise UserError(f"stack {name!r} is a {side} only: pair it with a {other}, --{side} {name} --{other} NAME "
                        f"(e.g. --{other} reference)")
    return factory


def build(name: str, spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack:
    return resolve_whole(name)(spec, dtype, max_model_len)


def parallel_factory(name: str, layout: dict) -> StackFactory:
    """Stack `name` sharded as `layout` (trainer_tp, rollout_tp, ep; spawns its ranks, rank 0 gathers the
    log-probs); `name`'s own factory for one process."""
    if not layout:
        return resolve_whole(name)

    def factory(spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> Stack:
        return resolve_whole(name)(spec, dtype, max_model_len).parallel(**layout)

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
                factory = resolve_whole(name) if isinstance(name, str) else name
                self.built[key] = factory(spec, dtype, max_model_len)
            except Unsupported as e:
                self.built[key] = e
        if isinstance(self.built[key], Unsupported):
            raise self.built[key]
        return self.built[key]


def first_line(doc: str | None) -> str:
    return doc.strip().splitlines()[0] if doc and doc.strip() else ""
