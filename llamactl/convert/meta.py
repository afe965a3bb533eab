"""Meta's original LLaMA checkpoints (params.json + consolidated.NN.pth + tokenizer.model) -> a
Hugging Face folder.

A model-parallel release splits each tensor across its shards as Meta's reference code does:
column-parallel layers (wq, wk, wv, w1, w3, output) along the output dimension, row-parallel ones
(wo, w2) along the input dimension, the embedding along the model dimension (Llama 1/2) or the
vocabulary (Llama 3), norms replicated. Meta's q/k rows interleave each rotary pair (2i, 2i+1);
transformers' rotate_half pairs i with i + d/2, so q and k rows are permuted per head.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from llamactl.folder.headers import check_regular_file
from llamactl.errors import CheckpointError

SHARD = re.compile(r"consolidated\.(\d+)\.pth")
# tensor suffix -> (HF name pattern, concat dim across model-parallel shards; None: replicated)
LAYER_TENSORS = {
    "attention.wq.weight": ("self_attn.q_proj.weight", 0),
    "attention.wk.weight": ("self_attn.k_proj.weight", 0),
    "attention.wv.weight": ("self_attn.v_proj.weight", 0),
    "attention.wo.weight": ("self_attn.o_proj.weight", 1),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight", 0),
    "feed_forward.w3.weight": ("mlp.up_proj.weight", 0),
    "feed_forward.w2.weight": ("mlp.down_proj.weight", 1),
    "attention_norm.weight": ("input_layernorm.weight", None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None),
}
IGNORED = ("rope.freqs",)  # precomputed rotary frequencies of Llama 1; the config says them
LLAMA3_VOCAB = 128_000  # Llama 3's tiktoken vocabulary starts its special tokens here


@dataclass(frozen=True)
class MetaParams:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int  # -1: from the embedding
    norm_eps: float
    rope_theta: float
    use_scaled_rope: bool
    rope_scaling_factor: float
    max_seq_len: int | None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def is_meta_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "params.json").is_file() and any(SHARD.fullmatch(p.name) for p in path.iterdir())


def read_params(folder: Path) -> MetaParams:
    where = folder / "params.json"
    check_regular_file(where, folder)
    try:
        raw = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} could not be read ({e})", "restore params.json from the release")
    raw = raw.get("model", raw) if isinstance(raw, dict) else raw
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} is not a JSON object", "restore params.json from the release")

    def num(key: str, kind: type, default: Any = None, lo: float = 1):
        value = raw.get(key, default)
        if value is None:
            raise CheckpointError(f"{where}: {key} is missing", "restore params.json from the release")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise CheckpointError(f"{where}: {key} is {value!r}; expected {'an integer' if kind is int else 'a number'}")
        if key != "vocab_size" and value < lo:
            raise CheckpointError(f"{where}: {key} is {value}; expected at least {lo}")
        return kind(value)

    p = MetaParams(
        dim=num("dim", int), n_layers=num("n_layers", int), n_heads=num("n_heads", int),
        n_kv_heads=num("n_kv_heads", int, raw.get("n_heads")), vocab_size=num("vocab_size", int, -1),
        norm_eps=num("norm_eps", float, 1e-5, lo=0), rope_theta=num("rope_theta", float, 10000.0, lo=0),
        use_scaled_rope=bool(raw.get("use_scaled_rope", False)),
        rope_scaling_factor=num("rope_scaling_factor", float, 8.0, lo=1),
        max_seq_len=num("max_seq_len", int) if "max_seq_len" in raw else None,
    )
    if p.dim % p.n_heads or (p.dim // p.n_heads) % 2:
        raise CheckpointError(f"{where}: dim {p.dim} is not n_heads {p.n_heads} heads of an even size")
    if p.n_heads % p.n_kv_heads:
        raise CheckpointError(f"{where}: n_heads {p.n_heads} is not a multiple of n_kv_heads {p.n_kv_heads}")
    return p


def shard_files(folder: Path) -> list[Path]:
    """consolidated.00.pth ... consolidated.NN.pth, numbered without gaps, each a regular file in
    the folder (a FIFO would hang a reader, a folder crash it, a link read outside the folder)."""
    found = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := SHARD.fullmatch(p.name)))
    for _, p in found:
        check_regular_file(p, folder)
    if [i for i, _ in found] != list(range(len(found))):
        raise CheckpointError(f"{folder}: the shards are numbered {[i for i, _ in found]}",
                              "a model-parallel release has consolidated.00.pth to consolidated.N-1.pth; restore the missing ones")
    return [p for _, p in found]


def permute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta's interleaved q/k rows [heads * d, in] -> the half-split order of transformers."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def unpermute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of permute_rotary (transformers' order -> Meta's and GGUF's)."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def convert_meta(folder: Path, writer, dtype: torch.dtype | None, load: Callable[[Path], dict],
                 context: int | None, log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write every tensor of the checkpoint in `folder` to `writer` (artifact.ShardWriter) in HF
    names; returns (config.json, facts for the manifest). `load` reads one shard (mmap)."""
    p = read_params(folder)
    files = shard_files(folder)
    shards = [load(f) for f in files]  # memory-mapped: pages are read as tensors are merged
    n = len(shards)
    if p.n_kv_heads % n or p.n_heads % n:
        raise CheckpointError(f"{folder}: {n} shards do not split {p.n_heads} heads and {p.n_kv_heads} KV heads evenly",
                              "the release's shard count must divide its head counts")
    first = shards[0]
    present = {int(m.group(1)) for k in first if (m := re.match(r"layers\.(\d+)\.", k))}
    if len(present) != p.n_layers:  # checked before the count sizes anything
        raise CheckpointError(f"{folder / 'params.json'}: n_layers is {p.n_layers}, {files[0].name} holds {len(present)} layers",
                              "restore params.json from the release")
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"} | {
        f"layers.{i}.{k}" for i in range(p.n_layers) for k in LAYER_TENSORS}
    for f, sd in zip(files, shards):
        names = set(sd) - set(IGNORED)
        if names != expected:
            missing, extra = sorted(expected - names), sorted(names - expected)
            raise CheckpointError(f"{f}: {'missing ' + ', '.join(missing[:3]) if missing else ''}"
                                  f"{'; ' if missing and extra else ''}{'unexpected ' + ', '.join(extra[:3]) if extra else ''}",
                                  f"a LLaMA checkpoint of {p.n_layers} layers (params.json) has exactly these tensors")

    def merged(name: str, dim: int | None) -> torch.Tensor:
        parts = [sd[name] for sd in shards]
        if dim is None or n == 1:
            t = parts[0]
        else:
            if any(x.shape != parts[0].shape for x in parts):
                raise CheckpointError(f"{folder}: {name} has shapes {[tuple(x.shape) for x in parts]} across the shards",
                                      "the shards are from different releases")
            t = torch.cat(parts, dim=dim)
        return t if dtype is None else t.to(dtype)

    emb_parts = [sd["tok_embeddings.weight"] for sd in shards]
    emb_dim = 1 if n > 1 and emb_parts[0].shape[1] != p.dim else 0  # Llama 1/2 split the model dim, 3 the vocab
    emb = merged("tok_embeddings.weight", emb_dim)
    vocab = emb.shape[0]
    if emb.shape[1] != p.dim or (p.vocab_size > 0 and vocab != p.vocab_size):
        raise CheckpointError(f"{folder}: tok_embeddings is {tuple(emb.shape)}; params.json says vocab {p.vocab_size}, dim {p.dim}")
    kv_dim = p.n_kv_heads * p.head_dim
    shapes = {"wq": (p.dim, p.dim), "wk": (kv_dim, p.dim), "wv": (kv_dim, p.dim), "wo": (p.dim, p.dim)}
    writer.add("model.embed_tokens.weight", emb)
    ffn = None
    for i in range(p.n_layers):
        for key, (hf, dim) in LAYER_TENSORS.items():
            t = merged(f"layers.{i}.{key}", dim)
            short = key.split(".")[1]
            if short in shapes and tuple(t.shape) != shapes[short]:
                raise CheckpointError(f"{folder}: layers.{i}.{key} is {tuple(t.shape)}, expected {shapes[short]} "
                                      f"for dim {p.dim}, {p.n_heads} heads, {p.n_kv_heads} KV heads")
            if short == "wq":
                t = permute_rotary(t, p.n_heads)
            elif short == "wk":
                t = permute_rotary(t, p.n_kv_heads)
            elif short in ("w1", "w3"):
                ffn = ffn or t.shape[0]
                if t.shape != (ffn, p.dim):
                    raise CheckpointError(f"{folder}: layers.{i}.{key} is {tuple(t.shape)}, expected ({ffn}, {p.dim})")
            writer.add(f"model.layers.{i}.{hf}", t)
    writer.add("model.norm.weight", merged("norm.weight", None))
    head = merged("output.weight", 0)
    if head.shape != (vocab, p.dim):
        raise CheckpointError(f"{folder}: output.weight is {tuple(head.shape)}, expected ({vocab}, {p.dim})")
    writer.add("lm_head.weight", head)

    llama3 = vocab >= LLAMA3_VOCAB
    ctx = context or p.max_seq_len or (131072 if p.use_scaled_rope else 8192 if llama3 else 4096)
    if not (context or p.max_seq_len):
        log(f"context length {ctx} (params.json does not say; {'Llama 3.1' if p.use_scaled_rope else 'Llama 3' if llama3 else 'Llama 2'}'s): "
            "set another with --context")
    rope: dict[str, Any] = {"rope_theta": p.rope_theta, "rope_type": "default"}
    if p.use_scaled_rope:  # Llama 3.1's frequency scaling, with Meta's reference constants
        rope = {"rope_theta": p.rope_theta, "rope_type": "llama3", "factor": p.rope_scaling_factor,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    out_dtype = dtype or emb.dtype
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": p.dim, "intermediate_size": ffn, "num_hidden_layers": p.n_layers,
        "num_attention_heads": p.n_heads, "num_key_value_heads": p.n_kv_heads, "head_dim": p.head_dim,
        "rms_norm_eps": p.norm_eps, "vocab_size": vocab, "max_position_embeddings": ctx,
        "rope_theta": p.rope_theta, "rope_parameters": rope, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000 if llama3 else 1, "eos_token_id": 128001 if llama3 else 2,
        "dtype": str(out_dtype).removeprefix("torch."), "torch_dtype": str(out_dtype).removeprefix("torch."),
    }
    facts = {"kind": "meta", "shards": len(files), "embedding_split": "vocab" if emb_dim == 0 and n > 1 else
             "model dim" if n > 1 else None, "llama3_vocab": llama3, "context": ctx}
    return config, facts
