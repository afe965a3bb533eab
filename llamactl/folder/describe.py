"""`inspect`: what a model folder holds, computed from config.json, safetensors headers and manifests."""

from __future__ import annotations

import math
from typing import Any

from llamactl.folder.artifact import Artifact, lineage
from llamactl.folder.schemes import EMBED, embedding_scheme_of, module_scheme, scheme_label

DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def logical_params(index: dict[str, dict[str, Any]], bits: int | None) -> int:
    """Parameters of the unquantized model: packed int32 weights count 32/bits values per element."""
    total = 0
    for name, meta in index.items():
        n = math.prod(meta["shape"])
        g_idx = index.get(name.removesuffix(".qweight") + ".g_idx")
        if name.endswith(".qweight") and g_idx:  # [in * bits / 32, out], whatever each module's bits
            total += g_idx["shape"][0] * meta["shape"][1]
        elif name.endswith(".qweight") and bits:
            total += n * (32 // bits)
        elif name.endswith((".qzeros", ".scales", ".g_idx", ".absmax", ".quant_map", ".SCB", ".weight_format",
                            ".quant_state.bitsandbytes__nf4", ".nested_absmax", ".nested_quant_map")):
            continue
        elif meta["dtype"] == "U8" and bits == 4:  # bitsandbytes packs two 4-bit values per byte
            total += 2 * n
        else:
            total += n
    return total


def describe(art: Artifact) -> dict[str, Any]:
    """A JSON-ready description of the model in `art`."""
    a = art.args
    quant = art.quantization
    bits = int(quant.get("bits", 4)) if quant and "bits" in quant else (4 if quant and quant.get("load_in_4bit") else None)
    info: dict[str, Any] = {
        "path": str(art.path),
        "architecture": (art.config.get("architectures") or ["LlamaForCausalLM"])[0],
        "model_type": art.config.get("model_type"),
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "attention": "MHA" if a.n_rep == 1 else f"GQA ({a.n_rep} query heads per KV head)",
        "head_dim": a.head_dim,
        "vocab_size": a.vocab_size,
        "context_length": a.max_position_embeddings,
        "rope_theta": a.rope_theta,
        "rope_type": a.rope_type,
        "tie_word_embeddings": a.tie_word_embeddings,
        "weight_format": art.weight_format,
        "weight_files": len(art.weight_files),
        "disk_bytes": art.disk_bytes,
        "kv_bytes_per_token": a.kv_bytes_per_token(2),
        "kv_bytes_at_4k": a.kv_bytes_per_token(2) * 4096,
        "kv_bytes_at_32k": a.kv_bytes_per_token(2) * 32768,
        "kv_bytes_at_context": a.kv_bytes_per_token(2) * a.max_position_embeddings,
        "quantization": quant,
        "lineage": lineage(art),
    }
    if art.weight_format == "safetensors":
        index = art.tensor_index()
        info["params"] = logical_params(index, bits)
        info["memory_bytes"] = sum(math.prod(m["shape"]) * DTYPE_BYTES.get(m["dtype"], 4) for m in index.values())
        if a.tie_word_embeddings and "lm_head.weight" not in index:
            info["params_note"] = "lm_head shares the embedding matrix"
        if quant and quant.get("quant_method") == "gptq":
            info["tensor_bits"] = tensor_bits(index, quant)
    else:
        info["params"] = params_from_config(a)
        info["memory_bytes"] = None
    return info


def tensor_bits(index: dict[str, dict[str, Any]], quant: dict) -> dict[str, int]:
    """How many tensors of a GPTQ-format folder take each scheme ("4-bit g128": 42, "16-bit": 3),
    read from its tensors and quantization_config (per-module `dynamic` entries included)."""
    bits, group = int(quant.get("bits", 4)), int(quant.get("group_size", 128))
    out: dict[str, int] = {}
    for name in index:
        module, _, kind = name.rpartition(".")
        if kind == "qweight" and module == EMBED:
            table = embedding_scheme_of(quant) or {}
            key = scheme_label({"bits": int(table.get("bits", 0)), "group_size": int(table.get("group_size", -1))})
        elif kind == "qweight":
            b, g = module_scheme(quant, module, bits, group)
            key = scheme_label({"bits": b, "group_size": g})
        elif kind == "weight" and (".layers." in f".{module}" and module.rsplit(".", 1)[-1].endswith("proj")
                                   or module in ("lm_head", EMBED)):
            key = scheme_label(None)
        else:
            continue
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def params_from_config(a) -> int:
    """Parameters of the model a config describes (weights, embeddings once when tied, norms)."""
    attn = a.hidden_size * a.head_dim * (2 * a.num_attention_heads + 2 * a.num_key_value_heads)
    mlp = 3 * a.hidden_size * a.intermediate_size
    per_layer = attn + mlp + 2 * a.hidden_size
    emb = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    return a.num_hidden_layers * per_layer + emb + a.hidden_size
