"""Model weights: seeded random init (the embedded default: nothing is downloaded) or a local
transformers checkpoint directory (config.json + *.safetensors)."""

from __future__ import annotations

import json
import math
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from logdiff.config import NAMED_CONFIGS, ModelConfig
from logdiff.errors import UserError
from logdiff.model import Qwen3ForCausalLM
from logdiff.report import progress

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
    """Which model a run uses: a named config with seeded random weights, or a checkpoint directory; `layers`
    keeps the first N decoder layers (embeddings, final norm and lm_head kept), the peers' quick gate on a
    real checkpoint. A named config's random layers are the full model's; its final norm and lm_head are drawn
    after the last kept layer (never generating the layers cut away)."""

    name: str  # a NAMED_CONFIGS key or a directory path
    seed: int = 0
    layers: int | None = None

    @property
    def is_checkpoint(self) -> bool:
        return self.name not in NAMED_CONFIGS

    def config(self) -> ModelConfig:
        full = _read_config(Path(self.name)) if self.is_checkpoint else NAMED_CONFIGS[self.name]
        if self.layers is None:
            return full
        if not 1 <= self.layers <= full.num_hidden_layers:
            raise UserError(f"--layers {self.layers} is outside 1..{full.num_hidden_layers}, the decoder layers of "
                            f"{full.name}; pass a depth in that range")
        return full.replace(name=f"{full.name}-{self.layers}l", num_hidden_layers=self.layers)

    def build(self, dtype: torch.dtype, gemm_layout: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Qwen3ForCausalLM:
        """The model in `dtype`, weights identical for every stack that builds the same spec. Parameters are
        made in `dtype` one tensor at a time (never a whole-model copy in another dtype), on torch's default
        device (`--device`); a checkpoint's tensors stored in `dtype` stay memory-mapped on the CPU (copy-on-write:
        nothing reaches the file), unless `gemm_layout` asks for another layout or dtype (below).

        Builds of one spec, dtype and `gemm_layout` in a process share the weight tensors while any of them lives:
        a run's rollout and trainer instances and the oracle hold one copy, not three. `gemm_layout` (a kernel set's
        `inference_weight`), given, makes that copy of every GEMM weight on the CPU once, in the dtype and layout the
        kernel set's GEMMs read (the reference's: K-major on the FMA tiers, as stored on amx-bf16; same values), so
        that neither path makes another; the oracle asks for the reference's, whose copy it then shares.
        Isolation between instances is of state, not of weight bytes: the weights are read-only to whoever did
        not make them their own, and a trainer that updates them in place first does (`own_weights`)."""
        device = torch.get_default_device()  # logdiff.devices: --device
        key = (self, dtype, device, gemm_layout)
        shared = {name: ref() for name, ref in _built.get(key, {}).items()}
        if not shared or any(t is None for t in shared.values()):
            config = self.config()
            with torch.device("meta"):
                expected = {k: v.shape for k, v in Qwen3ForCausalLM(config).state_dict().items()}
            if self.is_checkpoint:
                tensors = _checkpoint_tensors(Path(self.name), config, expected)
            else:
                tensors = random_tensors(config, self.seed)
            shared = {name: _laid_out(name, tensor.to(device=device, dtype=dtype), gemm_layout) for name, tensor in tensors}
        with torch.device("meta"):
            model = Qwen3ForCausalLM(self.config())
        load_state(model, {name: tensor.detach() for name, tensor in shared.items()})  # own Parameters, shared bytes
        _built[key] = {name: weakref.ref(param) for name, param in model.named_parameters()}
        return model.requires_grad_(False)

    def checkpoint_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the weights `build(dtype)` holds, a tied lm_head once: what `logdiff run` reads as the
        checkpoint's size (peak RSS is reported against it)."""
        config = self.config()
        with torch.device("meta"):
            model = Qwen3ForCausalLM(config)
        tied = config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0
        return (sum(p.numel() for p in model.parameters()) - tied) * dtype.itemsize

    def checkpoint_dir(self, dtype: torch.dtype) -> Path:
        """A transformers checkpoint directory of exactly `build(dtype)`'s weights, for an engine in another
        process (vLLM loads it). A checkpoint spec is its own directory; a named config is saved once, in
        `dtype`, under `$LOGDIFF_CACHE` (default ~/.cache/logdiff), keyed by model, seed and dtype; a checkpoint
        cut to `layers` is saved there too, keyed by the source's path and modification times."""
        if self.is_checkpoint and self.layers is None:
            self.config()  # a readable checkpoint, or one line saying why not
            return Path(self.name).resolve()
        root = Path(os.environ.get("LOGDIFF_CACHE") or Path.home() / ".cache" / "logdiff") / "checkpoints"
        if self.is_checkpoint:
            source = f"{Path(self.name).resolve().name}-{_content_key(Path(self.name))}"
        else:
            source = f"{self.name}-seed{self.seed}"
        depth = f"-{self.layers}l" if self.layers is not None else ""
        path = root / f"{source}{depth}-{dtype_name(dtype)}"
        if not (path / "config.json").is_file():
            tmp = root / f".{path.name}.{os.getpid()}.tmp"
            save_checkpoint(self.build(dtype), tmp)  # config.json last, so a complete directory has one
            try:
                tmp.rename(path)
            except OSError:  # another process finished first: its directory is identical
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        return path


def _laid_out(name: str, tensor: torch.Tensor, gemm_layout) -> torch.Tensor:
    """A GEMM weight (every matrix but the embedding table) on the CPU through `gemm_layout`; anything else as it is."""
    if gemm_layout is None or tensor.ndim < 2 or name == "model.embed_tokens.weight" or tensor.device.type != "cpu":
        return tensor
    return gemm_layout(tensor)


def check_model_option(model: str | None, layers: int | None) -> None:
    """`--model` and `--layers` as `logdiff check` and `pytest conformance` take them (a model for every
    workload, cut or not): one UserError for a depth without a model, an unknown or unreadable model, a depth
    outside it."""
    if layers is not None and not model:
        raise UserError("--layers cuts the model --model names; pass --model NAME|DIR with it")
    if model:
        ModelSpec(model, layers=layers).config()


# (spec, dtype, device, gemm_layout) -> weakly held weight tensors of the last build (ModelSpec.build shares them).
_built: dict[tuple, dict[str, weakref.ref]] = {}


def own_weights(*models: torch.nn.Module) -> None:
    """Gives each of `models` its own copy of every weight tensor it may share (with other builds of its spec,
    or with one another), before it updates them in place: a trainer's optimizer step, a weight sync."""
    for model in models:
        for param in model.parameters():
            param.data = param.data.clone()


def random_tensors(config: ModelConfig, seed: int):
    """(name, fp32 tensor) of seeded weights, one at a time, with unit-scale activations, so log-probs are far
    from uniform, and unit-scale logits: a tied embedding is also the lm_head, so it gets the 1/sqrt(hidden)
    scale of the other GEMM weights (at unit scale a token's logit would be |e|^2 = hidden, every greedy
    log-prob exactly 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3ForCausalLM(config).state_dict().items()}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen, device="cpu")
        elif name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            tensor = torch.randn(shape, generator=gen, device="cpu")
        else:
            tensor = torch.randn(shape, generator=gen, device="cpu").div_(math.sqrt(shape[-1]))
        if name.endswith("mlp.gate.weight"):
            for original, copy in config.tied_router_experts:
                tensor[copy] = tensor[original]
        yield name, tensor


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
    model.load_state_dict({k: state[k] for k in expected}, assign=True)
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
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _content_key(path: Path) -> str:
    """Changes when any weight file of checkpoint `path` does: its files' sizes and modification times."""
    import hashlib

    stamps = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.glob("*.safetensors"))
    return hashlib.sha256(repr(stamps).encode()).hexdigest()[:12]


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names (published, sharded checkpoints), else all."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError) as e:
            raise UserError(f"{index} is not a safetensors index ({e.__class__.__name__}); re-download the checkpoint") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise UserError(f"{path} lacks shard {missing[0]} that its index names ({len(missing)} missing); "
                            "download the whole checkpoint")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path} has no *.safetensors weights; pass a checkpoint saved with safe_serialization")
    return files


def _mapped_tensors(file: Path):
    """(name, tensor) of one safetensors file, each a view of a private (copy-on-write) memory map: nothing is
    read until used, and writing to a tensor never reaches the file."""
    import mmap

    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
            mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{file} is not a readable safetensors file ({e.__class__.__name__}: {e}); "
                        "re-download or re-save it") from None
    base = 8 + header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            begin, end = entry["data_offsets"]
            count = math.prod(entry["shape"])
            if end - begin != count * dtype.itemsize or base + end > size:
                raise ValueError("data offsets do not match the shape")
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{file}: tensor {name} has a bad header entry ({e}); re-download or re-save it") from None
        flat = (torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + begin) if count
                else torch.empty(0, dtype=dtype, device="cpu"))
        yield name, flat.view(entry["shape"])


def _checkpoint_tensors(path: Path, config: ModelConfig, expected: dict[str, torch.Size]):
    """(name, tensor) of the model's weights from checkpoint `path`, memory-mapped as stored; layers past
    `config.num_hidden_layers` (a `--layers` cut) are never read; per-expert tensors fused as the model
    keeps them (transformers 5)."""
    files = _weight_files(path)
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for i, file in enumerate(files, 1):
        if len(files) > 1:
            progress(f"loading {path.name}: shard {i}/{len(files)} ({file.name})")
        for name, tensor in _mapped_tensors(file):
            layer = _LAYER.match(name)
            if layer and int(layer.group(1)) >= config.num_hidden_layers:
                continue
            match = _PER_EXPERT.fullmatch(name)
            if match:
                prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
                per_expert.setdefault(prefix, {}).setdefault(proj, {})[expert] = tensor
            elif name in expected:
                yield name, tensor
    for prefix, projs in per_expert.items():
        try:
            stack = {p: torch.stack([projs[p][e] for e in range(config.num_experts)]) for p in projs}
            yield prefix + ".gate_up_proj", torch.cat([stack.pop("gate_proj"), stack.pop("up_proj")], dim=1)
            yield prefix + ".down_proj", stack["down_proj"]
        except KeyError as e:
            raise UserError(f"checkpoint lacks expert weights under {prefix} ({e}); pass a complete checkpoint") from None


def save_checkpoint(model: Qwen3ForCausalLM, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors in the on-disk layout transformers reads."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.config
    save_file(checkpoint_state(model.state_dict(), c), str(path / "model.safetensors"))
    # transformers 5 reads "dtype", older versions and vLLM "torch_dtype"; both take torch's names only.
    name = TORCH_DTYPE_NAMES[model.dtype]
    (path / "config.json").write_text(json.dumps({**c.to_hf_dict(), "dtype": name, "torch_dtype": name}, indent=2))


def checkpoint_state(weights: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's weights (its parameter names, fused experts) as a checkpoint stores them: one tensor per expert
    and projection, no tied lm_head."""
    state = {}
    for name, tensor in weights.items():
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
    return state
