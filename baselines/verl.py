"""`verl`: verl's actor as a logdiff trainer (a trainer only: pair it with a rollout engine, `--rollout R`).

The log-probs come from verl's own old-log-prob recompute, the path `RayPPOTrainer._compute_old_log_prob` takes in
verl 0.9: a `DataProto` of left-padded prompts and right-padded responses (`prompts`, `responses`, `input_ids`,
`attention_mask`, `position_ids`, `response_mask`, the rollout temperature), `to_tensordict`, verl's
`left_right_2_no_padding`, the meta-data `ActorRolloutRefWorker.compute_log_prob` -> `TrainingWorker.infer_batch`
adds (`use_remove_padding`, `use_dynamic_bsz`, `max_token_len_per_gpu`, `micro_batch_size_per_gpu`,
`calculate_entropy`, `compute_loss=False`), then `FSDPEngineWithLMHead.infer_batch` in its `eval_mode` and
`no_padding_2_padding` back to [batch, response]. The engine is verl's FSDP2 engine (world size 1, gloo, process
group made in this process when none exists) around the transformers Qwen3 / Qwen3-MoE model verl itself loads
with `from_pretrained`, from a temporary checkpoint of exactly the weights every other stack of the spec uses.

verl 0.9 removed the legacy `verl.workers.actor.dp_actor.DataParallelPPOActor`: its engine workers are the actor.
verl 0.9 ships no CPU platform (it falls back to CUDA); on the CPU this adapter registers one through verl's own
platform plugin API (`verl.plugin.platform.PlatformRegistry`, `set_platform`), which only answers device queries
("cpu", gloo). verl's engine registry lists the FSDP engine for cuda and npu only, so the engine class is used
directly, with the defaults `TrainingWorker.infer_batch` would add.

Knobs (`trainer_layouts`, conformance C13): micro-batch size (`micro_batch_size_per_gpu`; a batch it does not
divide runs as two `infer_batch` calls, the second with the remainder as its micro-batch, since verl asserts
divisibility), packed vs padded (`use_remove_padding`: "packed" varlen, "right": verl's padded path, each
micro-batch right-padded to its longest sequence; verl has no left padding nor extra padding there), dynamic batch
size (`use_dynamic_bsz` with `max_token_len_per_gpu` = the token budget; verl balances Σ seqlen² and does not keep
every micro-batch under the budget, it sets their number). Temperature is verl's: logits / T in the logits' dtype,
a per-batch scalar when every sequence has the same one (what verl's trainer passes), else verl's per-sample
temperature tensor; T = 0 (greedy) scores at 1. No truncation or log-prob modes: verl's recompute has none.

In bf16 and fp16 the engine keeps verl's actor defaults: fp32 master weights (`model_dtype="fp32"`, an exact copy of
the spec's bf16/fp16 weights) and FSDP2 mixed precision with `param_dtype` = the run's dtype under autocast; without
flash-attn (this CPU) verl scores with `logprobs_from_logits_v2`, a log_softmax in the logits' dtype, so its bf16
log-probs are bf16 numbers. Eager only: verl's `use_torch_compile` (the entropy kernel) is off.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
import tempfile
import warnings
from typing import Sequence

import torch

from logdiff.api import PADDINGS, Capture, TrainerLayout, TrainerOnly, Unsupported, locate
from logdiff.bisect.capture import capture_logprobs
from logdiff.bisect.hooks import attached

VERL_PIN = "verl==0.9.1"
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def verl_unavailable() -> str | None:
    """Why the verl trainer cannot run here, or None."""
    if importlib.util.find_spec("verl") is None:
        return (f"verl is not installed: pip install {VERL_PIN} -c tests/verl_compat/constraints.txt (pins torch), "
                "or run `nox -s verl`")
    return None


def _cpu_platform():
    """verl's platform interface answered for the CPU: device "cpu", collectives over gloo, no device memory."""
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"  # verl moves batches with `.to(get_device_id())`

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    PlatformRegistry.register(platform="cpu")(PlatformCPU)
    return PlatformCPU()


def _use_cpu_platform() -> str:
    """Makes verl's platform the CPU unless it already is; returns how verl's platform was chosen. Must run before
    verl's engine modules are imported: they read the device name at import."""
    from verl.plugin.platform import platform_manager

    current = platform_manager._current_platform
    if current is not None and current.device_name == "cpu":
        return "cpu"
    if current is not None and current.is_available():
        raise Unsupported(f"verl already runs on {current.device_name} in this process; the verl trainer adapter "
                          "computes on the CPU only")
    platform_manager.set_platform(_cpu_platform())
    engine = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    if engine is not None and engine.device_name != "cpu":
        raise Unsupported(f"verl's FSDP engine was imported for {engine.device_name} before logdiff could make verl's "
                          "platform the CPU: build the verl trainer before anything else uses verl's engines")
    return "cpu (logdiff's PlatformCPU, registered through verl's platform plugin API)"


def _init_process_group() -> None:
    """verl's engine needs torch.distributed: world size 1 over gloo, made here when the process has none."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise Unsupported(f"torch.distributed already runs with world size {dist.get_world_size()}; the verl "
                              "trainer adapter runs verl's FSDP engine on one rank")
        return
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="logdiff-verl-pg-"), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


class VerlTrainer(TrainerOnly):
    """verl's FSDP2 actor engine recomputing old log-probs (see the module docstring)."""

    name = "verl"
    device = "cpu"
    supports_capture = True
    trainer_layouts = {
        "micro_batch": (None, 1, 2, 4),  # any positive size is honoured
        "padding": ("packed", "right"),  # verl pads to the longest in the micro-batch: no left or extra padding
        # any budget at least the longest sequence is honoured (verl asserts it); None: use_dynamic_bsz off
        "token_budget": (None, 512, 1024, 4096),
    }

    def __init__(self, spec, dtype: torch.dtype, max_model_len: int, entropy: bool = True, attention: str = "sdpa",
                 model_dtype: str = "fp32"):
        reason = verl_unavailable()
        if reason:
            raise Unsupported(reason)
        if dtype not in DTYPE_NAMES:
            raise Unsupported(f"verl's FSDP engine runs in fp32, bf16 or fp16, not {dtype}")
        if torch.get_default_device().type != "cpu":
            raise Unsupported("the verl trainer adapter runs verl's FSDP engine on the CPU only (gloo, world size 1), "
                              f"not on {torch.get_default_device()}")
        self.spec, self.dtype, self.max_model_len = spec, dtype, max_model_len
        self.entropy, self.attention, self.model_dtype = entropy, attention, model_dtype
        self.param_dtype = DTYPE_NAMES[dtype]
        self.platform = _use_cpu_platform()
        _init_process_group()
        self.engine = self._build_engine()
        self.last_entropy: list[torch.Tensor] | None = None  # verl's entropies of the last call, when computed

    def _build_engine(self):
        from logdiff.baselines.hf import build_hf_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # verl's optional engines (megatron, veomni, ...) warn when absent
            from verl.trainer.config import CheckpointConfig
            from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
            from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        quiet = contextlib.ExitStack()  # verl prints its monkey patches, transformers its progress bars
        quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
        quiet.enter_context(contextlib.redirect_stderr(io.StringIO()))
        with tempfile.TemporaryDirectory(prefix="logdiff-verl-ckpt-") as path, quiet:
            # The spec's weights in `dtype`, bit for bit: verl loads them with from_pretrained (in model_dtype; fp32
            # holds bf16 and fp16 exactly) and FSDP2 casts them back to `dtype` for the forward.
            build_hf_model(self.spec, self.dtype, self.attention).save_pretrained(path)
            model_config = HFModelConfig(path=path, load_tokenizer=False,
                                         override_config={"attn_implementation": self.attention}, use_remove_padding=True)
            engine_config = FSDPEngineConfig(
                strategy="fsdp2", model_dtype=self.model_dtype,
                mixed_precision={"param_dtype": self.param_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
                use_torch_compile=False, forward_only=False, use_dynamic_bsz=False,
            )
            engine = FSDPEngineWithLMHead(model_config=model_config, engine_config=engine_config,
                                          optimizer_config=FSDPOptimizerConfig(lr=0.0, total_training_steps=1),
                                          checkpoint_config=CheckpointConfig())
            engine.initialize()  # reads the checkpoint; the directory goes when this block ends
        self.hf_config = model_config.hf_config
        return engine

    def describe(self) -> dict:
        import tensordict
        import transformers
        import verl

        info = super().describe()
        info["versions"].update({"verl": verl.__version__, "transformers": transformers.__version__,
                                 "tensordict": tensordict.__version__})
        info["verl"] = {
            "path": "FSDPEngineWithLMHead.infer_batch (ActorRolloutRefWorker.compute_log_prob's engine path)",
            "strategy": "fsdp2", "world_size": 1, "platform": self.platform,
            "attn_implementation": self.attention, "model_dtype": self.model_dtype,
            "mixed_precision": {"param_dtype": self.param_dtype, "reduce_dtype": "fp32"},
            "calculate_entropy": self.entropy, "use_torch_compile": False, "use_fused_kernels": False,
            "knobs": {"micro_batch_size_per_gpu": "TrainerLayout.micro_batch (None: the whole batch)",
                      "use_remove_padding": "TrainerLayout.padding == 'packed'",
                      "use_dynamic_bsz / max_token_len_per_gpu": "TrainerLayout.token_budget"},
            "trainer_layouts": {k: list(v) for k, v in self.trainer_layouts.items()},
        }
        return info

    def trainer_logprobs(self, sequences: Sequence[Sequence[int]], score_from: Sequence[int],
                         temperatures: Sequence[float], grad: bool = False,
                         layout: TrainerLayout | None = None, capture: Capture = None) -> list[torch.Tensor]:
        if grad:
            raise Unsupported("verl's compute_log_prob gives no gradients: BaseEngine.infer_batch runs under "
                              "torch.no_grad() and detaches its outputs (verl differentiates only in update_actor)")
        layout = layout or TrainerLayout()
        if capture is not None:
            if layout != TrainerLayout():
                raise Unsupported("a capture follows verl's one packed forward; score with the default layout to bisect")
            with self._capture_hooks(capture, [len(s) for s in sequences]):
                out = self.trainer_logprobs(sequences, score_from, temperatures)
            capture_logprobs(capture, list(range(len(sequences))), [first - 1 for first in score_from], out)
            return out
        self._check(layout, sequences, score_from)
        n = len(sequences)
        if n == 0:
            return []
        sequences = [list(s) for s in sequences]
        if all(len(s) == first for s, first in zip(sequences, score_from)):  # no response token to score
            self.last_entropy = [torch.zeros(0)] * n if self.entropy else None
            return [torch.zeros(0) for _ in sequences]
        if layout.token_budget is not None or layout.micro_batch is None:
            calls = [range(n)]
        else:  # verl asserts that the micro-batch size divides the batch: the remainder is a call of its own
            whole = n - n % layout.micro_batch
            calls = [r for r in (range(whole), range(whole, n)) if len(r)]
        out: list[torch.Tensor] = [None] * n
        entropies: list[torch.Tensor] = [None] * n
        for rows in calls:
            lp, ent = self._compute_log_prob([sequences[i] for i in rows], [score_from[i] for i in rows],
                                             [temperatures[i] for i in rows], layout, len(rows))
            for j, i in enumerate(rows):
                out[i], entropies[i] = lp[j], None if ent is None else ent[j]
        self.last_entropy = entropies if self.entropy else None
        return out

    def _capture_hooks(self, capture: Capture, lengths: list[int]):
        """logdiff.bisect.hooks on the transformers model inside verl's FSDP2 engine, and the rows of its one packed
        forward (use_remove_padding: input_ids and position_ids [1, total], the sequences one after another, any
        rows after them padding)."""
        model = self.engine.module
        request = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        expected = torch.cat([torch.arange(n) for n in lengths])

        def on_forward(module, args, kwargs):
            ids, positions = kwargs["input_ids"].flatten().cpu(), kwargs["position_ids"].flatten().cpu()
            if len(ids) < len(expected) or not torch.equal(positions[: len(expected)], expected):
                raise RuntimeError("verl laid the batch out otherwise than the sequences packed one after another")
            locate(capture, torch.cat([request, torch.full((len(ids) - len(expected),), -1)]), positions)
            capture("tokens", ids), capture("positions", positions)

        return attached(model, "transformers", capture, on_forward)

    def _check(self, layout: TrainerLayout, sequences, score_from) -> None:
        if layout.padding not in PADDINGS:
            raise ValueError(f"padding {layout.padding!r}: one of {PADDINGS}")
        if layout.padding == "left":
            raise Unsupported("verl pads each micro-batch on the right (use_remove_padding=False); it has no left padding")
        if layout.extra_padding:
            raise Unsupported("verl pads a micro-batch to its longest sequence: no extra padding columns")
        if layout.micro_batch is not None and layout.micro_batch < 1:
            raise ValueError(f"micro_batch {layout.micro_batch}: at least 1, or None")
        if layout.token_budget is not None:
            if layout.micro_batch is not None:
                raise Unsupported("verl's use_dynamic_bsz replaces the micro-batch size: give a token budget or a "
                                  "micro-batch size, not both")
            longest = max((len(s) for s in sequences), default=0)
            if layout.token_budget < longest:
                raise Unsupported(f"verl's dynamic batch size needs max_token_len_per_gpu ({layout.token_budget}) at "
                                  f"least the longest sequence ({longest} tokens)")
        for s, first in zip(sequences, score_from):
            if not 1 <= first <= len(s):
                raise ValueError(f"score_from {first} outside 1..{len(s)}: verl scores responses after a non-empty prompt")

    def _batch(self, sequences, score_from, temperatures):
        """verl's rollout output layout: prompts left-padded to the longest prompt, responses right-padded to
        the longest response, position ids from the attention mask (verl's compute_position_id_with_mask)."""
        from verl import DataProto
        from verl.utils.model import compute_position_id_with_mask

        b = len(sequences)
        width_p = max(score_from)
        width_r = max(len(s) - f for s, f in zip(sequences, score_from))
        prompts, prompt_mask = torch.zeros(b, width_p, dtype=torch.long), torch.zeros(b, width_p, dtype=torch.long)
        responses, response_mask = torch.zeros(b, width_r, dtype=torch.long), torch.zeros(b, width_r, dtype=torch.long)
        for i, (s, first) in enumerate(zip(sequences, score_from)):
            prompts[i, width_p - first:] = torch.tensor(s[:first])
            prompt_mask[i, width_p - first:] = 1
            responses[i, : len(s) - first] = torch.tensor(s[first:], dtype=torch.long)
            response_mask[i, : len(s) - first] = 1
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        tensors = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
                   "attention_mask": attention_mask, "position_ids": compute_position_id_with_mask(attention_mask),
                   "response_mask": response_mask}
        scale = [float(t) if t > 0 else 1.0 for t in temperatures]  # greedy: scored at temperature 1
        meta = {}
        if len(set(scale)) == 1:
            meta["temperature"] = scale[0]  # what verl's trainer passes: one rollout temperature per batch
        else:
            tensors["temperature"] = torch.tensor(scale, dtype=torch.float32)  # verl's per-sample temperature
        return DataProto.from_dict(tensors=tensors, meta_info=meta)

    def _compute_log_prob(self, sequences, score_from, temperatures, layout: TrainerLayout, rows: int):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

        data = left_right_2_no_padding(self._batch(sequences, score_from, temperatures).to_tensordict())
        dynamic = layout.token_budget is not None
        tu.assign_non_tensor(
            data, calculate_entropy=self.entropy, compute_loss=False,  # RayPPOTrainer._compute_old_log_prob
            # TrainingWorker.infer_batch's keys, from the layout instead of the worker's config
            use_remove_padding=layout.padding == "packed", use_dynamic_bsz=dynamic,
            max_token_len_per_gpu=layout.token_budget if dynamic else None,
            micro_batch_size_per_gpu=None if dynamic else min(layout.micro_batch or rows, rows),
            use_fused_kernels=False,
        )
        with self.engine.eval_mode():
            output = self.engine.infer_batch(data, loss_function=None)
        model_output = output["model_output"]
        log_probs = no_padding_2_padding(model_output["log_probs"], data)
        entropy = no_padding_2_padding(model_output["entropy"], data) if self.entropy else None
        lengths = [len(s) - first for s, first in zip(sequences, score_from)]
        lp = [log_probs[i, :n].float().cpu().clone() for i, n in enumerate(lengths)]
        ent = None if entropy is None else [entropy[i, :n].float().cpu().clone() for i, n in enumerate(lengths)]
        return lp, ent


def verl_trainer(spec, dtype, max_model_len, entropy: bool = True):
    """verl 0.9's actor (FSDP2 engine, transformers model) recomputing old log-probs: a trainer only"""
    return VerlTrainer(spec, dtype, max_model_len, entropy=entropy)


verl_trainer.side = "trainer"
verl_trainer.unavailable = verl_unavailable
