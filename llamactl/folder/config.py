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
        """Read a config.json dict; raises CheckpointError naming the field at fault and what was
        expected (types and ranges are checked before anything is sized from them)."""
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{where} holds a {type(cfg).__name__}, not a JSON object", "restore the model's config.json")
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
        get = _Fields(cfg, where)
        vocab = get.int("vocab_size", hi=1 << 24)
        hidden = get.int("hidden_size", hi=1 << 17)
        heads = get.int("num_attention_heads", hi=1 << 12)
        kv_heads = get.int("num_key_value_heads", heads, hi=heads)
        if heads % kv_heads:
            raise CheckpointError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}",
                                  "restore the model's config.json")
        head_dim = get.int("head_dim", hidden // heads if hidden >= heads else 0, hi=1 << 12)
        if head_dim % 2:
            raise CheckpointError(f"{where}: head_dim {head_dim} is odd; RoPE needs an even head dimension")

        # Two forms: transformers <5 has rope_theta + rope_scaling; 5.x has rope_parameters.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise CheckpointError(f"{where}: rope_scaling/rope_parameters is {rope!r}; expected an object or null")
        rope = dict(rope)
        rope_theta = _Fields(rope, where).float("rope_theta", get.float("rope_theta", 10000.0, lo=0.0), lo=0.0)
        rope.pop("rope_theta", None)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"{where}: rope_type {rope['rope_type']!r} is not supported",
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
            )
        if rope["rope_type"] != "default":
            _Fields(rope, where + " rope_scaling").float("factor", lo=0.0)

        eos = cfg.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < vocab for e in eos_list):
            raise CheckpointError(f"{where}: eos_token_id is {eos!r}; expected token ids below vocab_size {vocab}",
                                  "restore the model's config.json")
        bos = cfg.get("bos_token_id")
        if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int) or not 0 <= bos < vocab):
            raise CheckpointError(f"{where}: bos_token_id is {bos!r}; expected a token id below vocab_size {vocab}")
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get.int("intermediate_size", hi=1 << 20),
            num_hidden_layers=get.int("num_hidden_layers", hi=1 << 10),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=get.int("max_position_embeddings", 2048, hi=1 << 24),
            rms_norm_eps=get.float("rms_norm_eps", 1e-6, lo=0.0, hi=1.0),
            rope_theta=rope_theta,
            rope_scaling=rope,
            tie_word_embeddings=get.bool("tie_word_embeddings", False),
            attention_bias=get.bool("attention_bias", False),
            mlp_bias=get.bool("mlp_bias", False),
            bos_token_id=bos,
            eos_token_ids=tuple(eos_list),
        )


class _Fields:
    """Typed reads of a config dict, each failure one CheckpointError naming the field."""

    def __init__(self, cfg: dict, where: str):
        self.cfg, self.where = cfg, where

    def _value(self, key: str, default):
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise CheckpointError(f"{self.where}: {key} is missing or null", "restore the model's config.json")
            return default
        return value

    def _bad(self, key: str, value, expected: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {key} is {value!r}; expected {expected}", "restore the model's config.json")

    def int(self, key: str, default=None, hi: int = 1 << 31) -> int:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
            raise self._bad(key, value, f"an integer from 1 to {hi}")
        return value

    def float(self, key: str, default=None, lo: float = float("-inf"), hi: float = float("inf")) -> float:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo < value < hi:
            raise self._bad(key, value, f"a number above {lo}" + (f" and below {hi}" if hi != float("inf") else ""))
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value
