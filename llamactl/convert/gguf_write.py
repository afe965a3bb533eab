"""A Hugging Face folder (16-bit or llamactl-quantized) -> one GGUF file that llama.cpp reads.

Names, metadata and layout follow llama.cpp's own converter (convert_hf_to_gguf.py, LlamaModel):
q/k rows in Meta's interleaved rotary order, norms in F32, the tokenizer as `gpt2` (byte-level
BPE with merges) or `llama` (SentencePiece pieces with scores). GPTQ groups that fit llama.cpp's
32-weight blocks are copied code for code (gguf_blocks); the rest are requantized and named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from llamactl.convert import gguf_blocks
from llamactl.convert.meta import unpermute_rotary
from llamactl.errors import CheckpointError, InputError
from llamactl.folder.describe import params_from_config
from llamactl.layers.gptq import GPTQLinear, layer_codes
from llamactl.options import RuntimeOptions
from llamactl.runtime.load import load_model
from llamactl.runtime.model import rope_inv_freq

LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TYPES = ("auto", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")


def gguf_names(n_layers: int) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, for every tensor of a LLaMA."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(n_layers):
        for hf, gg in (LINEARS | NORMS).items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    return names


def _qtype(name: str):
    from gguf import GGMLQuantizationType as T

    return {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1}[name]


def _float_array(t: torch.Tensor, kind: str) -> tuple[np.ndarray, Any]:
    """A float tensor as the numpy array and raw type GGUFWriter takes."""
    from gguf import GGMLQuantizationType as T

    if kind == "bf16":
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy(), T.BF16
    if kind == "f16":
        return t.to(torch.float16).numpy(), T.F16
    return t.to(torch.float32).numpy(), T.F32


def _rows(heads: int, rows: int) -> torch.Tensor:
    """The row order that takes q/k from transformers' layout to Meta's/GGUF's: [rows]."""
    return unpermute_rotary(torch.arange(rows)[:, None], heads)[:, 0]


def _linear_tensor(mod, heads: int | None, kind: str, float_kind: str, notes: dict[str, list]):
    """One linear layer -> (array, raw type), exactly where the GPTQ groups fit a GGUF block type."""
    from gguf import quants

    if isinstance(mod, GPTQLinear):
        codes, zeros = layer_codes(mod.qweight, mod.qzeros, mod.in_features, mod.out_features, mod.bits, mod.v1,
                                   mod.planar)  # [out, in], [groups, out]
        scales = mod.scales  # [groups, out] fp16
        width, groups = mod.in_features, scales.shape[0]
        g = width // groups if width % groups == 0 else 0
        in_order = g and torch.equal(mod.g_idx.long(), torch.arange(width) // g)
        if heads:
            order = _rows(heads, codes.shape[0])
            codes, zeros, scales = codes[order], zeros[:, order], scales[:, order]
        want = kind if kind != "auto" else ("q8_0" if mod.bits == 8 else "q4_0" if bool((zeros == 8).all()) else "q4_1")
        if in_order and g % 32 == 0 and mod.bits in (4, 8):
            if want == "q4_0" and mod.bits == 4 and bool((zeros == 8).all()):
                return gguf_blocks.encode_q4_0(codes, scales, g), _qtype("q4_0")
            if want == "q4_1" and mod.bits == 4:
                notes["offsets_rounded"].append(1)
                return gguf_blocks.encode_q4_1(codes, zeros, scales, g), _qtype("q4_1")
            if want == "q8_0" and mod.bits == 8 and bool((zeros == 128).all()):
                return gguf_blocks.encode_q8_0(codes, scales, g), _qtype("q8_0")
        weight = mod.dequantized(torch.float32)
        if heads:
            weight = weight[_rows(heads, weight.shape[0])]
        notes["requantized"].append(want)
        return quants.quantize(weight.numpy(), _qtype(want)), _qtype(want)
    weight = mod.dequantized(torch.float32) if hasattr(mod, "dequantized") else mod.weight.detach()
    if heads:
        weight = weight[_rows(heads, weight.shape[0])]
    if kind in ("q8_0", "q4_0", "q4_1"):
        if weight.shape[1] % 32:
            notes["kept_16bit"].append(weight.shape[1])
            return _float_array(weight, float_kind)
        if hasattr(mod, "dequantized"):
            notes["requantized"].append(kind)
        return quants.quantize(weight.float().numpy(), _qtype(kind)), _qtype(kind)
    if hasattr(mod, "dequantized"):
        notes["requantized"].append(kind if kind != "auto" else float_kind)
    return _float_array(weight, float_kind if kind == "auto" else kind)


def _rope_freqs(args) -> torch.Tensor | None:
    """Llama 3.1's per-frequency RoPE factors [head_dim / 2] (llama.cpp's rope_freqs tensor)."""
    if args.rope_type != "llama3":
        return None
    plain = type(args)(**{**args.__dict__, "rope_scaling": {"rope_type": "default"}})
    return (rope_inv_freq(plain) / rope_inv_freq(args)).float()


def tokenizer_metadata(folder: Path, vocab_size: int) -> dict[str, Any]:
    """The tokenizer.ggml.* values for a folder's tokenizer.json (byte-level BPE or SentencePiece
    BPE), its list padded to the model's vocab_size rows with unused `[PADn]` tokens, as
    llama.cpp's converter pads it (llama.cpp wants a token per embedding row)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no tokenizer.json", "GGUF needs the tokenizer's vocabulary; add tokenizer.json")
    try:
        tj = json.loads(path.read_text())
        model = tj["model"]
        vocab: dict[str, int] = dict(model["vocab"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} could not be read ({e})", "restore tokenizer.json")
    if model.get("type") != "BPE":
        raise CheckpointError(f"{path}: a {model.get('type')} tokenizer cannot be written to GGUF by llamactl",
                              "llamactl writes byte-level BPE (gpt2) and SentencePiece BPE (llama) vocabularies")
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    for tok, a in added.items():
        vocab[tok] = a["id"]
    size = max(vocab.values()) + 1
    if size > vocab_size:
        raise CheckpointError(f"{path} has {size} tokens, more than the model's {vocab_size} embedding rows",
                              "use the tokenizer that came with this checkpoint")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for tok, i in vocab.items():
        tokens[i] = tok
    types = [1] * size + [5] * (vocab_size - size)  # NORMAL, then UNUSED padding
    for tok, a in added.items():
        types[a["id"]] = 3 if a.get("special") else 4  # CONTROL or USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    byte_level = "ByteLevel" in json.dumps(tj.get("pre_tokenizer"))
    meta: dict[str, Any] = {"tokens": tokens, "token_type": types}
    if byte_level:
        split = json.dumps(tj.get("pre_tokenizer"))
        meta |= {"model": "gpt2", "merges": merges, "pre": "llama-bpe" if "p{N}{1,3}" in split else "gpt-2"}
    else:  # SentencePiece-style: byte-fallback pieces, the merge rank as the score
        for i, tok in enumerate(tokens):
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                types[i] = 6  # BYTE
        if model.get("unk_token") in vocab:
            types[vocab[model["unk_token"]]] = 2  # UNKNOWN
        meta |= {"model": "llama", "pre": "default", "scores": [-float(i) for i in range(vocab_size)]}
    cfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    meta["add_bos"] = bool(tcfg.get("add_bos_token", True))
    meta["add_eos"] = bool(tcfg.get("add_eos_token", False))
    template = tcfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    meta["chat_template"] = template if isinstance(template, str) else None
    for role in ("bos", "eos", "unk", "pad"):
        tok = tcfg.get(f"{role}_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        meta[f"{role}_id"] = vocab.get(tok) if isinstance(tok, str) else None
    return meta


def write_gguf(art, path: Path, kind: str, log: Callable[[str], None], extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Write `art` as the GGUF file `path` (a staging name; the caller renames it), with `extra`
    string metadata (the source's lineage); returns the types written, what was copied exactly
    and what was requantized."""
    import gguf

    if kind not in TYPES:
        raise InputError(f"--type {kind!r} is not known", f"use one of {', '.join(TYPES)}")
    a = art.args
    if a.rope_type not in ("default", "llama3"):
        raise InputError(f"{art.path}: rope_type {a.rope_type!r} has no GGUF form in llamactl", "use a model with default or llama3 RoPE")
    src_dtype = getattr(torch, str(art.config.get("torch_dtype") or art.config.get("dtype") or "bfloat16"), torch.bfloat16)
    float_kind = {torch.float32: "f32", torch.float16: "f16"}.get(src_dtype, "bf16")
    if kind in ("f32", "f16", "bf16"):
        float_kind = kind
    # the format's own modules (GPTQLinear), not the CPU kernels' repacked layers
    model = load_model(art, torch.device("cpu"), src_dtype if not art.quantization else torch.float32,
                       RuntimeOptions(kernels=False))
    meta = tokenizer_metadata(art.path, a.vocab_size)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(art.path.name)
    w.add_context_length(a.max_position_embeddings)
    w.add_embedding_length(a.hidden_size)
    w.add_block_count(a.num_hidden_layers)
    w.add_feed_forward_length(a.intermediate_size)
    w.add_head_count(a.num_attention_heads)
    w.add_head_count_kv(a.num_key_value_heads)
    w.add_rope_dimension_count(a.head_dim)
    if a.head_dim * a.num_attention_heads != a.hidden_size:
        w.add_key_length(a.head_dim)
        w.add_value_length(a.head_dim)
    w.add_layer_norm_rms_eps(a.rms_norm_eps)
    w.add_rope_freq_base(a.rope_theta)
    w.add_vocab_size(a.vocab_size)
    w.add_tokenizer_model(meta["model"])
    w.add_tokenizer_pre(meta["pre"])
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["token_type"])
    if "merges" in meta:
        w.add_token_merges(meta["merges"])
    if "scores" in meta:
        w.add_token_scores(meta["scores"])
    for role in ("bos", "eos", "unk", "pad"):
        if meta[f"{role}_id"] is not None:
            getattr(w, f"add_{role}_token_id")(meta[f"{role}_id"])
    w.add_add_bos_token(meta["add_bos"])
    w.add_add_eos_token(meta["add_eos"])
    if meta["chat_template"]:
        w.add_chat_template(meta["chat_template"])
    for key, value in (extra or {}).items():
        w.add_string(key, value)

    notes: dict[str, list] = {"requantized": [], "offsets_rounded": [], "kept_16bit": []}
    written: dict[str, int] = {}

    def add(name: str, arr: np.ndarray, raw) -> None:
        w.add_tensor(name, arr, raw_dtype=raw)
        written[raw.name] = written.get(raw.name, 0) + 1

    emb = model.model.embed_tokens
    if isinstance(emb, torch.nn.Embedding):
        add("token_embd.weight", *_float_array(emb.weight.detach(), float_kind))
    else:  # a low-bit table: [V, D] as a GPTQ layer of D inputs, which llama.cpp's blocks take as they are
        add("token_embd.weight", *_linear_tensor(emb.head(), None, "auto", float_kind, notes))
    freqs = _rope_freqs(a)
    if freqs is not None:
        add("rope_freqs.weight", *_float_array(freqs, "f32"))
    for i, layer in enumerate(model.model.layers):
        for hf, gg in LINEARS.items():
            heads = {"self_attn.q_proj": a.num_attention_heads, "self_attn.k_proj": a.num_key_value_heads}.get(hf)
            add(f"blk.{i}.{gg}.weight", *_linear_tensor(layer.get_submodule(hf), heads, kind, float_kind, notes))
        for hf, gg in NORMS.items():
            add(f"blk.{i}.{gg}.weight", *_float_array(getattr(layer, hf).weight.detach(), "f32"))
    add("output_norm.weight", *_float_array(model.model.norm.weight.detach(), "f32"))
    if not a.tie_word_embeddings:
        head = model.lm_head
        add("output.weight", *(_linear_tensor(head, None, "auto", float_kind, notes) if hasattr(head, "qweight")
                              else _float_array(head.weight.detach(), float_kind)))
    main = max((t for t in written if t not in ("F32",)), key=lambda t: written[t], default="F32")
    w.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if main == "F32" else f"MOSTLY_{main}"))
    if main not in ("F32", "F16", "BF16"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if notes["requantized"]:
        log(f"{len(notes['requantized'])} layers requantized to {', '.join(sorted(set(notes['requantized'])))} "
            "(their groups do not fit llama.cpp's 32-weight blocks exactly, or the layer was not GPTQ)")
    if notes["kept_16bit"]:
        log(f"{len(notes['kept_16bit'])} layers kept in {float_kind}: widths {sorted(set(notes['kept_16bit']))} are not whole 32-weight blocks")
    return {"kind": "gguf", "tensor_types": written, "tokenizer": meta["model"], "pre_tokenizer": meta["pre"],
            "requantized_layers": len(notes["requantized"]), "exact_layers": sum(
                n for t, n in written.items() if t.startswith("Q")) - len(notes["requantized"]),
            "q4_1_offsets_rounded_to_fp16": bool(notes["offsets_rounded"]), "kept_16bit_layers": len(notes["kept_16bit"]),
            "bytes": path.stat().st_size, "bits_per_weight": round(8 * path.stat().st_size / params_from_config(a), 3)}

