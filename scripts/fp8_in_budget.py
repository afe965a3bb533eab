"""Would `--target-bpw` ever choose FP8 for a tensor? At the bytes of 8-bit RTN per row (one byte
a weight, one scale a row), compare the KL the allocator predicts for each tensor (quantize.budget:
0.5 * sum(fisher * (w_hat - w)^2), fisher from `llamactl calibrate`) under e4m3 per row (scale:
the row's largest magnitude over 448, as `quantize --method fp8`) and under int8 RTN per row.
Weights alone: FP8's activation rounding would only add to its side.

Usage: python scripts/fp8_in_budget.py MODEL STATS OUT.json
"""

import json
import sys

import torch

from llamactl.folder.artifact import open_artifact, resolve_model_path
from llamactl.folder.checkpoint import iter_checkpoint
from llamactl.layers.rtn import rtn_quantize
from llamactl.quantize.sensitivity import load_stats

E4M3_MAX = 448.0


def int8_row(w: torch.Tensor) -> torch.Tensor:
    codes, zeros, scales, g_idx = rtn_quantize(w, 8, -1, True, False, None)
    g = g_idx.long()
    return (codes - zeros.t()[:, g]) * scales.t()[:, g]


def fp8_row(w: torch.Tensor) -> torch.Tensor:
    scale = (w.abs().amax(1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def main(model: str, stats_path: str, out: str) -> None:
    art = open_artifact(resolve_model_path(model))
    stats = load_stats(stats_path, art)
    tensors = dict(iter_checkpoint(art))
    rows = []
    for name, fisher in sorted(stats.fisher.items()):
        w = tensors[f"{name}.weight"].float()
        kl = {k: 0.5 * float((fisher.float() * (f(w) - w) ** 2).sum()) for k, f in (("int8", int8_row), ("fp8", fp8_row))}
        rows.append({"tensor": name, "shape": list(w.shape), **kl, "fp8_over_int8": kl["fp8"] / kl["int8"]})
    ratios = sorted(r["fp8_over_int8"] for r in rows)
    summary = {"tensors": len(rows), "fp8_better": sum(r < 1 for r in ratios), "ratio_min": ratios[0],
               "ratio_median": ratios[len(ratios) // 2], "ratio_max": ratios[-1],
               "sum_fp8_over_sum_int8": sum(r["fp8"] for r in rows) / sum(r["int8"] for r in rows)}
    with open(out, "w") as f:
        json.dump({"model": str(art.path), "stats": stats_path, "summary": summary, "rows": rows}, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main(*sys.argv[1:4])
