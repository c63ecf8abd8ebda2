"""Model weights: seeded random init (the embedded default: nothing is downloaded) or a local
transformers checkpoint directory (config.json + *.safetensors)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from logdiff.config import NAMED_CONFIGS, ModelConfig
from logdiff.errors import UserError
from logdiff.model import Qwen3ForCausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The names transformers and vLLM read in a config.json ("torch_dtype", "dtype"): torch's own.
TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


@dataclass(frozen=True)
class ModelSpec:
    """Which model a run uses: a named config with seeded random weights, or a checkpoint directory."""

    name: str  # a NAMED_CONFIGS key or a directory path
    seed: int = 0

    @property
    def is_checkpoint(self) -> bool:
        return self.name not in NAMED_CONFIGS

    def config(self) -> ModelConfig:
        if not self.is_checkpoint:
            return NAMED_CONFIGS[self.name]
        return _read_config(Path(self.name))

    def build(self, dtype: torch.dtype) -> Qwen3ForCausalLM:
        """The model in `dtype`, weights identical for every stack that builds the same spec."""
        config = self.config()
        model = Qwen3ForCausalLM(config)
        state = _load_checkpoint(Path(self.name), config) if self.is_checkpoint else random_state(config, self.seed)
        load_state(model, state)
        return model.to(dtype).requires_grad_(False)

    def checkpoint_dir(self, dtype: torch.dtype) -> Path:
        """A transformers checkpoint directory of exactly `build(dtype)`'s weights, for an engine in another
        process (vLLM loads it). A checkpoint spec is its own directory; a named config is saved once, in
        `dtype`, under `$LOGDIFF_CACHE` (default ~/.cache/logdiff), keyed by model, seed and dtype."""
        if self.is_checkpoint:
            self.config()  # a readable checkpoint, or one line saying why not
            return Path(self.name).resolve()
        root = Path(os.environ.get("LOGDIFF_CACHE") or Path.home() / ".cache" / "logdiff") / "checkpoints"
        path = root / f"{self.name}-seed{self.seed}-{dtype_name(dtype)}"
        if not (path / "config.json").is_file():
            tmp = root / f".{path.name}.{os.getpid()}.tmp"
            save_checkpoint(self.build(dtype), tmp)  # config.json last, so a complete directory has one
            try:
                tmp.rename(path)
            except OSError:  # another process finished first: its directory is identical
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        return path


def random_state(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights with unit-scale activations, so log-probs are far from uniform, and unit-scale logits:
    a tied embedding is also the lm_head, so it gets the 1/sqrt(hidden) scale of the other GEMM weights
    (at unit scale a token's logit would be |e|^2 = hidden, every greedy log-prob exactly 0)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {k: v.shape for k, v in Qwen3ForCausalLM(config).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            state[name] = torch.randn(shape, generator=gen)
        else:
            state[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    for i in range(config.num_hidden_layers):
        if config.layer_is_moe(i):
            router = state[f"model.layers.{i}.mlp.gate.weight"]
            for original, copy in config.tied_router_experts:
                router[copy] = router[original]
    return state


def load_state(model: Qwen3ForCausalLM, state: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UserError(f"checkpoint lacks {len(missing)} tensors (first: {missing[0]}); pass a complete Qwen3 checkpoint")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise UserError(
                f"checkpoint tensor {name} has shape {tuple(state[name].shape)}, config says {tuple(tensor.shape)}; "
                "the config.json does not match the weights"
            )
    model.load_state_dict({k: state[k] for k in expected})
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _read_config(path: Path) -> ModelConfig:
    if not path.is_dir():
        names = ", ".join(NAMED_CONFIGS)
        raise UserError(f"unknown model {str(path)!r}; use one of {names} or a checkpoint directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path} has no config.json; pass a transformers checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config_file} is not valid JSON ({e.__class__.__name__}); re-export the checkpoint") from None
    return ModelConfig.from_hf_dict(raw, name=path.name)


_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _load_checkpoint(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path} has no *.safetensors weights; pass a checkpoint saved with safe_serialization")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{f} is not a readable safetensors file ({e}); re-download or re-save it") from None
    return _fuse_experts(state, config)


def _fuse_experts(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoints on disk keep one tensor per expert; the model (like transformers 5) fuses them."""
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    fused = {}
    for name, tensor in state.items():
        match = _PER_EXPERT.fullmatch(name)
        if match:
            prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
            per_expert.setdefault(prefix, {}).setdefault(proj, {})[expert] = tensor
        else:
            fused[name] = tensor
    for prefix, projs in per_expert.items():
        try:
            stack = {p: torch.stack([projs[p][e] for e in range(config.num_experts)]) for p in projs}
            fused[prefix + ".gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
            fused[prefix + ".down_proj"] = stack["down_proj"]
        except KeyError as e:
            raise UserError(f"checkpoint lacks expert weights under {prefix} ({e}); pass a complete checkpoint") from None
    return fused


def save_checkpoint(model: Qwen3ForCausalLM, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors in the on-disk layout transformers reads."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.config
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            gate, up = tensor.chunk(2, dim=1)
            for e in range(c.num_experts):
                state[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                state[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(c.num_experts):
                state[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
        elif not (c.tie_word_embeddings and name == "lm_head.weight"):
            state[name] = tensor.contiguous()
    save_file(state, str(path / "model.safetensors"))
    # transformers 5 reads "dtype", older versions and vLLM "torch_dtype"; both take torch's names only.
    name = TORCH_DTYPE_NAMES[model.dtype]
    (path / "config.json").write_text(json.dumps({**c.to_hf_dict(), "dtype": name, "torch_dtype": name}, indent=2))
