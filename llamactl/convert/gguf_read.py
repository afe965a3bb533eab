"""A LLaMA-architecture GGUF file -> a Hugging Face folder.

Tensors are dequantized with the `gguf` package (every type it implements: F32/F16/BF16, Q8_0,
Q4_0, Q4_1, k-quants, i-quants) into a 16-bit folder, q/k rows moved back from Meta's interleaved
rotary order. When every decoder linear is Q4_0, or every one Q8_0, they stay quantized: each
32-weight block is a GPTQ group of 32 with the same codes and scale (gguf_blocks), written in
llamactl's GPTQ format. The tokenizer comes from transformers' own GGUF tokenizer builder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from llamactl.convert import gguf_blocks
from llamactl.convert.gguf_write import gguf_names, _rope_freqs
from llamactl.convert.meta import permute_rotary
from llamactl.errors import CheckpointError
from llamactl.folder.config import LlamaArgs
from llamactl.layers.gptq import pack_gptq

GGUF_MAGIC = b"GGUF"
KEPT = {"Q4_0": 4, "Q8_0": 8}  # block types llamactl keeps quantized (bits)


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def open_gguf(path: Path):
    """gguf's reader over a memory map; a truncated or malformed file is one CheckpointError."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors ... on bad bytes
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})",
                              "the file may be truncated; download or convert it again")
    _check_layout(reader, path)
    return reader


def _check_layout(reader, path: Path) -> None:
    """Each tensor's data at a multiple of the file's alignment from the data section's start, and
    no two overlapping (a damaged offset otherwise reads another tensor's bytes, silently)."""
    align = getattr(reader, "alignment", 32)
    end = 0
    for t in sorted(reader.tensors, key=lambda t: t.data_offset):
        rel = t.data_offset - reader.data_offset
        if rel % align:
            raise CheckpointError(f"{path}: tensor {t.name}'s data is at offset {rel}, not a multiple of the file's "
                                  f"alignment {align}", "the file is damaged; download or convert it again")
        if rel < end:
            raise CheckpointError(f"{path}: tensor {t.name}'s data (offset {rel}) overlaps the tensor before it",
                                  "the file is damaged; download or convert it again")
        end = rel + int(t.n_bytes)


def _field(reader, key: str, default: Any = None, where: str = "") -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise CheckpointError(f"{where}: metadata {key} is missing", "a LLaMA GGUF file carries it; convert it again")
        return default
    return f.contents()


def read_config(reader, path: Path) -> dict[str, Any]:
    """config.json for the file's metadata (llama.* keys)."""
    where = str(path)
    arch = _field(reader, "general.architecture", where=where)
    if arch != "llama":
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported", "llamactl converts LLaMA-architecture GGUF files")
    k = lambda name, default=None: _field(reader, f"llama.{name}", default, where)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{path}: tensor token_embd.weight is missing", "the file is not a complete LLaMA")
    hidden, vocab = (int(x) for x in tensors["token_embd.weight"].shape[:2])  # GGUF shapes list columns first
    heads = _count(k("attention.head_count"), "attention.head_count", where)
    kv_heads = _count(k("attention.head_count_kv", heads), "attention.head_count_kv", where)
    if hidden % heads or heads % kv_heads:
        raise CheckpointError(f"{path}: {heads} heads of {kv_heads} KV heads do not split its {hidden} columns",
                              "the header's head counts are wrong: convert the model again")
    layers = _count(k("block_count"), "block_count", where)
    present = {int(m.group(1)) for name in tensors if (m := re.match(r"blk\.(\d+)\.", name))}
    if len(present) != layers:  # the header's count is checked against the tensors before it sizes anything
        raise CheckpointError(f"{path}: block_count is {layers}, the file holds {len(present)} blocks",
                              "the header is damaged: download or convert the file again")
    head_dim = int(k("attention.key_length", hidden // heads))
    rope: dict[str, Any] = {"rope_theta": _f32(k("rope.freq_base", 10000.0)), "rope_type": "default"}
    if "rope_freqs.weight" in tensors:
        rope = _llama3_rope(tensors["rope_freqs.weight"], rope["rope_theta"], head_dim, path)
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id", 1), _field(reader, "tokenizer.ggml.eos_token_id", 2)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": int(k("feed_forward_length")),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": _f32(k("attention.layer_norm_rms_epsilon", 1e-5)), "vocab_size": vocab,
        "max_position_embeddings": int(k("context_length", 2048)), "rope_theta": rope["rope_theta"],
        "rope_parameters": rope, "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": int(bos), "eos_token_id": int(eos),
    }


def _count(value, key: str, where: str) -> int:
    """A header count: a positive whole number, or one clear error."""
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        n = 0
    if n < 1 or n != value:
        raise CheckpointError(f"{where}: metadata llama.{key} is {value!r}, not a positive count",
                              "the header is damaged: download or convert the file again")
    return n


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(f"{float(x):.7g}")


def _llama3_rope(t, theta: float, head_dim: int, path: Path) -> dict[str, Any]:
    """Llama 3.1's scaling from llama.cpp's rope_freqs factors, checked by recomputing them."""
    factors = torch.from_numpy(np.asarray(t.data, dtype=np.float32).reshape(-1).copy())
    rope = {"rope_theta": theta, "rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    args = LlamaArgs.from_hf({"model_type": "llama", "hidden_size": head_dim, "num_attention_heads": 1, "num_hidden_layers": 1,
                              "intermediate_size": 1, "vocab_size": 1, "head_dim": head_dim, "rope_parameters": rope})
    if not torch.allclose(_rope_freqs(args), factors, rtol=1e-3):
        raise CheckpointError(f"{path}: rope_freqs is not Llama 3.1's RoPE scaling", "llamactl reads default and llama3 RoPE")
    return rope


def _array(t) -> np.ndarray:
    """A tensor's values as float32 [rows, cols] in numpy order, dequantized where needed."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    shape = tuple(int(x) for x in reversed(t.shape))
    if t.tensor_type == T.F32:
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    if t.tensor_type == T.F16:
        return np.asarray(t.data).view(np.float16).astype(np.float32).reshape(shape)
    if t.tensor_type == T.BF16:
        raw = torch.from_numpy(np.asarray(t.data).copy().view(np.int16))
        return raw.view(torch.bfloat16).float().numpy().reshape(shape)
    try:
        return quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
    except NotImplementedError:
        raise CheckpointError(f"tensor {t.name} has type {t.tensor_type.name}, which the gguf package cannot dequantize",
                              "requantize the file with llama.cpp to a supported type (Q8_0, Q4_K_M, ...)")


def convert_gguf(path: Path, folder: Path, writer, dtype: torch.dtype | None, keep_quantized: bool,
                 log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the file's tensors to `writer` (artifact.ShardWriter) and its tokenizer into
    `folder`; returns (config.json, facts for the manifest). dtype None: the file's own float type
    of its embedding (F32, F16 or BF16), bf16 where that is quantized."""
    reader = open_gguf(path)
    config = read_config(reader, path)
    layers, heads, kv = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    by_gguf = {gg: hf for hf, gg in gguf_names(layers).items()}
    tensors = {t.name: t for t in reader.tensors}
    unknown = sorted(set(tensors) - set(by_gguf) - {"rope_freqs.weight"})
    if unknown:
        raise CheckpointError(f"{path}: tensors {', '.join(unknown[:3])} are not part of a LLaMA", "convert a LLaMA-architecture file")
    missing = sorted(n for n in by_gguf if n not in tensors and n != "output.weight")
    if missing:
        raise CheckpointError(f"{path}: tensors {', '.join(missing[:3])} are missing", "the file is incomplete; convert it again")
    if dtype is None:
        dtype = {"F32": torch.float32, "F16": torch.float16}.get(tensors["token_embd.weight"].tensor_type.name, torch.bfloat16)
    linear_types = {tensors[n].tensor_type.name for n in tensors if n.startswith("blk.") and not n.endswith("norm.weight")}
    kept = next(iter(linear_types)) if keep_quantized and len(linear_types) == 1 and linear_types <= set(KEPT) else None
    types: dict[str, int] = {}
    for gg, t in tensors.items():
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        if gg == "rope_freqs.weight":
            continue
        hf = by_gguf[gg]
        n_heads = heads if gg.endswith("attn_q.weight") else kv if gg.endswith("attn_k.weight") else None
        is_linear = gg.startswith("blk.") and not gg.endswith("norm.weight")
        if kept and is_linear:
            cols = int(t.shape[0])
            decode = gguf_blocks.decode_q4_0 if kept == "Q4_0" else gguf_blocks.decode_q8_0
            codes, scales = decode(np.asarray(t.data), cols)  # [out, in], [in / 32, out]
            if n_heads:
                order = permute_rotary(torch.arange(codes.shape[0])[:, None], n_heads)[:, 0]
                codes, scales = codes[order], scales[:, order]
            bits = KEPT[kept]
            zeros = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
            g_idx = torch.arange(cols, dtype=torch.int32) // 32
            module = hf.removesuffix(".weight")
            for k2, v in pack_gptq(codes, zeros, scales, g_idx, bits).items():
                writer.add(f"{module}.{k2}", v)
            continue
        w = torch.from_numpy(_array(t).copy())
        if n_heads:
            w = permute_rotary(w, n_heads)
        writer.add(hf, w.to(dtype))
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if kept:
        bits = KEPT[kept]
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": False, "sym": True, "lm_head": False,
            "checkpoint_format": "gptq", "format": "gptq", "pack_dtype": "int32", "true_sequential": True,
            "static_groups": False, "meta": {"quantizer": ["llamactl:convert"], "method": f"gguf {kept}"}}
        log(f"decoder linears kept in {bits} bits: {kept} blocks are GPTQ groups of 32 (same codes and scales)")
    elif keep_quantized and linear_types - {"F32", "F16", "BF16"}:
        log(f"decoder linears dequantized to {config['dtype']}: their types ({', '.join(sorted(linear_types))}) "
            f"are not all one of {', '.join(KEPT)}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise CheckpointError(f"{path}: metadata tokenizer.ggml.tokens is missing", "a LLaMA GGUF file carries its vocabulary")
    tok = _tokenizer(path, folder, len(tokens.data))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return config, {"kind": "gguf", "tensor_types": types, "kept_quantized": kept, "tokenizer": tok}


def _tokenizer(path: Path, folder: Path, n: int) -> dict[str, Any]:
    """tokenizer.json and its config through transformers' GGUF tokenizer builder (the file lists n tokens)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise CheckpointError(f"{path}: its tokenizer could not be rebuilt ({type(e).__name__}: {e})",
                              "the file's tokenizer.ggml.* metadata is incomplete")
    tok.save_pretrained(str(folder))
    _drop_tokens_beyond(folder, n)
    return {"class": type(tok).__name__, "tokens": n, "chat_template": bool(getattr(tok, "chat_template", None))}


def _drop_tokens_beyond(folder: Path, n: int) -> None:
    """Remove the added tokens transformers' builder appends past the file's n tokens (a GPT-2
    style `<|endoftext|>` default), which would not fit the model's embedding."""
    tj_path, cfg_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
    tj = json.loads(tj_path.read_text())
    kept = [a for a in tj.get("added_tokens", []) if a["id"] < n]
    if len(kept) == len(tj.get("added_tokens", [])):
        return
    gone = {a["content"] for a in tj["added_tokens"]} - {a["content"] for a in kept}
    tj["added_tokens"] = kept
    tj_path.write_text(json.dumps(tj, ensure_ascii=False, indent=2))
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        cfg["added_tokens_decoder"] = {k: v for k, v in cfg.get("added_tokens_decoder", {}).items() if int(k) < n}
        for key, value in list(cfg.items()):
            if isinstance(value, str) and value in gone:
                cfg.pop(key)
        cfg_path.write_text(json.dumps(cfg, ensure_ascii=False, indent=2))
