"""Model shapes: the named configs and the mapping to and from a transformers config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from logdiff.errors import UserError


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense model, or `mlp_only_layers` of a MoE model)
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    num_experts: int = 0  # 0 = dense Qwen3
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    # Seeded weights only: (original, copy) expert pairs whose router rows are copies, so each pair gets bitwise
    # equal router logits on every token (conformance C9). A checkpoint carries its ties in its weights.
    tied_router_experts: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def hf_architecture(self) -> str:
        return "Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"

    def to_hf_dict(self) -> dict:
        """Keys of a transformers config.json for this architecture."""
        d = {
            "architectures": [self.hf_architecture],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
        }
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict, name: str) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise UserError(
                f"model {name!r} has model_type {model_type!r}; logdiff supports qwen3 and qwen3_moe checkpoints"
            )
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise UserError(f"model {name!r} uses RoPE scaling {rope!r}; only default RoPE is supported")
        try:
            num_experts = d.get("num_experts", d.get("num_local_experts", 0)) if model_type == "qwen3_moe" else 0
            heads = d["num_attention_heads"]
            return cls(
                name=name,
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                intermediate_size=d.get("intermediate_size", 0),
                max_position_embeddings=d["max_position_embeddings"],
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", d.get("rope_theta", 10_000.0)),
                tie_word_embeddings=d.get("tie_word_embeddings", False),
                num_experts=num_experts,
                num_experts_per_tok=d.get("num_experts_per_tok", 0) if num_experts else 0,
                moe_intermediate_size=d.get("moe_intermediate_size", 0) if num_experts else 0,
                norm_topk_prob=d.get("norm_topk_prob", True),
                decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            )
        except KeyError as e:
            raise UserError(f"config.json of model {name!r} lacks {e.args[0]!r}; pass a Qwen3 checkpoint directory") from None

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


NAMED_CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        # Seconds on 2 CPU cores; head_dim 32 so vLLM's CPU backend can run it too.
        ModelConfig(
            name="qwen3-moe-tiny", vocab_size=1024, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
            max_position_embeddings=8192, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        ),
        ModelConfig(
            name="qwen3-dense-tiny", vocab_size=1024, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
            max_position_embeddings=8192,
        ),
        # C9's MoE routing ties: qwen3-moe-tiny with top-4 of 8 experts and the router rows of experts 1 and 3
        # copies of 0 and 2, so a tie decides both which experts a token uses and their combine order. A named
        # config (not a saved checkpoint) so that a failure's reproduce line runs anywhere.
        ModelConfig(
            name="qwen3-moe-tiny-tied", vocab_size=1024, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
            max_position_embeddings=8192, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=64,
            tied_router_experts=((0, 1), (2, 3)),
        ),
        # For throughput: the 30B-A3B ratios (GQA 4:1, top-k/experts 1:16 with 8 active) at a CPU-sized scale.
        ModelConfig(
            name="qwen3-moe-small", vocab_size=16384, hidden_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1536,
            max_position_embeddings=8192, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=192,
        ),
        # Published shapes (config.json of each release; weights are never downloaded): every GEMM, norm and
        # vocabulary shape of the release. `--layers N` cuts them to the peers' quick gate (`qwen3-0.6b --layers 2`).
        # Qwen/Qwen3-0.6B: tied embeddings, 16/8 heads of 128.
        ModelConfig(
            name="qwen3-0.6b", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
            max_position_embeddings=40960, tie_word_embeddings=True,
        ),
        # Qwen/Qwen3-30B-A3B.
        ModelConfig(
            name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
            max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        ),
    )
}
