"""NF4 and LLM.int8 through bitsandbytes and transformers (the writer).

bitsandbytes 0.50.2 on the CPU re-lays an NF4 layer's `weight.absmax` (one float per 64-weight
block) out in place, as a transposed [blocks per row, rows] tensor, at the layer's first forward
(seen on a bf16 model); a model saved after that reloads with wrong weights (logits off by 7.6 on
the trained model). llamactl saves before any forward, rewrites any 2-D absmax flat and in block
order, then reloads the folder with transformers and refuses to write it unless the logits match
the in-memory model.

The runtime reads both formats without bitsandbytes (llamactl.layers.bnb).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llamactl.errors import CheckpointError
from llamactl.folder.checkpoint import checkpoint_dtype

ROUND_TRIP_ATOL = 1e-3


def write_bnb(art, opts, folder: Path, progress, log) -> dict[str, Any]:
    import bitsandbytes
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    compute = checkpoint_dtype(art)
    if opts.method == "nf4":
        cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute,
                                 bnb_4bit_use_double_quant=False, llm_int8_skip_modules=["lm_head"])
    else:
        cfg = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])
    import contextlib

    with progress(f"bitsandbytes {opts.method}", 3) as advance, open(folder / "quantize.log", "w") as engine_log, \
            contextlib.redirect_stdout(engine_log), contextlib.redirect_stderr(engine_log):
        # transformers' and bitsandbytes' own bars and warnings go to OUT/quantize.log; llamactl's
        # bar was bound to the terminal before the redirect
        model = AutoModelForCausalLM.from_pretrained(str(art.path), quantization_config=cfg, device_map="cpu",
                                                     dtype=compute)
        advance(1)
        # Save before any forward: on the CPU, bitsandbytes' first NF4 forward re-lays absmax out in place.
        model.save_pretrained(str(folder))
        if opts.method == "nf4":
            _fix_absmax(folder)
        probe = torch.arange(1, 65).view(1, 64) % art.args.vocab_size
        with torch.no_grad():
            before = model(probe).logits.float()
        advance(1)
        reloaded = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu", dtype=compute)
        with torch.no_grad():
            diff = (reloaded(probe).logits.float() - before).abs().max().item()
        advance(1)
    if diff > ROUND_TRIP_ATOL:
        raise CheckpointError(
            f"the saved {opts.method} checkpoint reloads with different logits (max |diff| {diff:.3g}); nothing was written",
            "this bitsandbytes version saves a format llamactl cannot repair: try --method gptq or rtn",
        )
    names = sorted(n for n, m in model.named_modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt"))
    return {"name": "bitsandbytes", "version": bitsandbytes.__version__, "via": "transformers BitsAndBytesConfig",
            "quant_type": opts.method, "blocksize": 64 if opts.method == "nf4" else None,
            "double_quant": False, "compute_dtype": str(compute).replace("torch.", ""),
            "llm_int8_threshold": cfg.llm_int8_threshold if opts.method == "int8" else None,
            "absmax_rewritten_in_block_order": opts.method == "nf4",
            "round_trip_max_logit_diff": diff, "quantized_modules": names}


def _fix_absmax(folder: Path) -> None:
    """Rewrite every NF4 absmax flat and in block order (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    for f in sorted(folder.glob("*.safetensors")):
        sd = load_file(str(f))
        changed = False
        for k, v in sd.items():
            if k.endswith(".weight.absmax") and v.dim() == 2:
                sd[k] = v.t().reshape(-1).float().contiguous()
                changed = True
        if changed:
            save_file(sd, str(f), metadata={"format": "pt"})
