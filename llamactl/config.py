"""The runtime's view of a Hugging Face LLaMA config.json, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llamactl.errors import CheckpointError

# model_type values whose checkpoints use LLaMA's module layout and math.
LLAMA_MODEL_TYPES = ("llama",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type + its parameters
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @property
    def n_rep(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json") -> "LlamaArgs":
        """Read a config.json dict; raises CheckpointError naming the field at fault."""
        model_type = cfg.get("model_type")
        if model_type not in LLAMA_MODEL_TYPES:
            raise CheckpointError(
                f"{where}: model_type is {model_type!r}, not a LLaMA model",
                f"llamactl runs model_type {', '.join(LLAMA_MODEL_TYPES)}",
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise CheckpointError(f"{where} is missing the fields {missing}", "is this a complete LLaMA config?")
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise CheckpointError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        if head_dim % 2:
            raise CheckpointError(f"{where}: head_dim {head_dim} is odd; RoPE needs an even head dimension")

        # Two forms: transformers <5 has rope_theta + rope_scaling; 5.x has rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"{where}: rope_type {rope['rope_type']!r} is not supported",
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
            )

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
