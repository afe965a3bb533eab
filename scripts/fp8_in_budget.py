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
from llamactl.layers.fp8 import quantize_fp8
from llamactl.quantize.budget import options_for
from llamactl.quantize.sensitivity import load_stats

INT8_ROW = {"bits": 8, "group_size": -1, "sym": True}


def predicted_kl(name: str, w: torch.Tensor, fisher: torch.Tensor) -> dict[str, float]:
    """The allocator's KL for int8 RTN per row (budget.options_for, as --target-bpw computes it)
    and the same sum for e4m3 per row (quantize --method fp8's rounding, float32 scales)."""
    int8 = next(o.kl for o in options_for(name, w, fisher, None, True, False, 2, widths=(8,)) if o.scheme == INT8_ROW)
    codes, scale = quantize_fp8(w, torch.float32)
    return {"int8": int8, "fp8": 0.5 * float((fisher * (codes.float() * scale - w) ** 2).sum())}


def main(model: str, stats_path: str, out: str) -> None:
    art = open_artifact(resolve_model_path(model))
    stats = load_stats(stats_path, art)
    tensors = dict(iter_checkpoint(art))
    rows = []
    for name, fisher in sorted(stats.fisher.items()):
        w = tensors[f"{name}.weight"].float()
        kl = predicted_kl(name, w, fisher.float())
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
