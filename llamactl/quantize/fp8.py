"""FP8 (e4m3) weights with a scale per output channel, written in compressed-tensors' float-quantized
format (the writer; the runtime's reading is layers.formats and layers.fp8).

The folder is what llm-compressor's FP8_DYNAMIC scheme writes and vLLM and transformers load as
it is: each quantized linear's `weight` in float8_e4m3fn [out, in] and `weight_scale` [out, 1] in
the checkpoint's dtype (w ~ weight * weight_scale), activations quantized per token at run time
(`input_activations`: dynamic, strategy token), lm_head and the embeddings kept. No calibration:
a channel's scale is its largest magnitude over 448 (e4m3's largest), round to nearest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llamactl import __version__
from llamactl.folder.artifact import save_weights
from llamactl.folder.checkpoint import iter_checkpoint
from llamactl.layers.fp8 import quantize_fp8
from llamactl.quantize.options import target_linears

CT_VERSION = "0.20.1"  # the compressed-tensors release whose config fields this writes (checked against its loader)


def quantization_config(modules: list[str], ignore: list[str]) -> dict[str, Any]:
    """config.json's quantization_config for FP8 W8A8 (dynamic per-token activations) of `modules`."""
    def args(strategy: str, dynamic: bool) -> dict:
        return {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": None if dynamic else "minmax",
                "observer_kwargs": {}}

    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args("channel", False),
                                      "input_activations": args("token", True), "output_activations": None,
                                      "format": "float-quantized"}},
        "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None,
        "version": CT_VERSION,
    }


def write_fp8(art, opts, folder: Path, progress) -> dict[str, Any]:
    """Quantize every linear of the decoder layers (and lm_head with --quantize-lm-head) to FP8 and
    write the compressed-tensors folder; the rest of the checkpoint as it is."""
    targets = set(target_linears(art, opts.lm_head))
    tensors = dict(iter_checkpoint(art))
    if art.args.tie_word_embeddings and "lm_head" in targets and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    state: dict[str, torch.Tensor] = {}
    with progress("fp8", len(targets)) as advance:
        for name, t in tensors.items():
            module = name.rsplit(".", 1)[0]
            if module in targets and name.endswith(".weight"):
                state[name], state[f"{module}.weight_scale"] = quantize_fp8(t, t.dtype if t.is_floating_point() else
                                                                             torch.bfloat16)
                advance(1)
            else:
                state[name] = t
    save_weights(state, folder)
    config = dict(art.config)
    config["quantization_config"] = quantization_config(sorted(targets), [] if opts.lm_head else ["lm_head"])
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"name": "llamactl-fp8", "version": __version__, "checkpoint_format": "compressed-tensors float-quantized",
            "scheme": "fp8 e4m3 weights per channel, activations per token (dynamic)",
            "quantized_modules": sorted(targets)}
