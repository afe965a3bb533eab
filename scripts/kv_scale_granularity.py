"""The KL an 8-bit KV cache adds at three granularities of its scales (issue 52's question), on a
real model and text: a scale per position and head (what llamactl's cache stores), per block of
16 positions and head, and per head over the whole window. The last two are given their best case:
each scale is the maximum over all the positions it covers, known in advance (a cache filling
one position a step would have to fix a block's scale before the block is full, or calibrate).
Prints and writes JSON. Usage: python scripts/kv_scale_granularity.py OUT.json [--model M] [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import sys
from unittest import mock

import torch

from llamactl.quality import cache_logits, compare, eval_windows
from llamactl.runtime import kv_cache, kv_format
from llamactl.runtime.load import load


def grouped(span: int | None):
    """A kv_format.quantize whose scales cover `span` positions of a head (None: all of them) of
    the [B, H, S, D] tensors a window's prefill writes, stored per position as the cache keeps them."""

    def quantize(x: torch.Tensor, fmt):
        if x.dim() != 4:
            raise RuntimeError("this measurement prefills whole windows through a static cache")
        b, h, s, d = x.shape
        amax = x.detach().abs().amax(-1).float()  # [B, H, S]
        if span is None:
            amax = amax.amax(-1, keepdim=True).expand(b, h, s)
        else:
            pad = -s % span
            blocks = torch.nn.functional.pad(amax, (0, pad)).view(b, h, -1, span).amax(-1, keepdim=True)
            amax = blocks.expand(-1, -1, -1, span).reshape(b, h, -1)[..., :s]
        scale = (amax / fmt.qmax).clamp(min=2.0**-24, max=65504.0).to(kv_format.SCALE_DTYPE)
        y = x.float() / scale.float()[..., None]
        if fmt.storage == torch.int8:
            return y.round().clamp(-127, 127).to(torch.int8), scale
        return y.clamp(-fmt.qmax, fmt.qmax).to(fmt.storage), scale

    return quantize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    art, model, tok, _ = load(args.model, "cpu", "float32")
    windows = eval_windows(tok, None, min(512, art.args.max_position_embeddings), args.tokens)
    rows = []
    for name in ("int8", "fp8"):
        fmt = kv_format.resolve(name, torch.float32)
        for label, span in (("position", 1), ("block of 16", 16), ("head (whole window)", None)):
            with mock.patch.object(kv_cache, "quantize", grouped(span)):
                q = compare(model, model, windows, child_logits=cache_logits(fmt))
            rows.append({"kv_dtype": name, "scale per": label, "kl_mean": q.kl_mean, "kl_p99": q.kl_p99,
                         "top1_agreement": q.top1_agreement, "tokens": q.tokens})
            print(f"{name:5} scale per {label:20} KL {q.kl_mean:.6f}  p99 {q.kl_p99:.5f}  top-1 {q.top1_agreement:.4f}"
                  f"  ({q.tokens} tokens)", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump({"model": str(art.path), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
