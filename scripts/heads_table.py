"""Measure the convert-heads table of docs/convert-heads.md.

Usage: python scripts/heads_table.py MODEL OUT_DIR [--eval-tokens N] [--distill-steps N]
Each grouping x merge at each KV-head count without distillation, then fit and mean with distillation
at the first count; 64 docs calibration samples of 512 tokens; quality on docs-eval.txt.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from llamactl.gqa.stage import HeadsOptions, convert_heads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--kv-heads", default="3,2")
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--distill-steps", type=int, default=200)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = [int(x) for x in a.kv_heads.split(",")]
    runs = [(g, grouping, merge, 0) for g in counts for grouping in ("contiguous", "similarity") for merge in ("mean", "fit")]
    runs += [(counts[0], "contiguous", merge, a.distill_steps) for merge in ("mean", "fit")]
    rows = []
    for g, grouping, merge, steps in runs:
        opts = HeadsOptions(kv_heads=g, grouping=grouping, merge=merge, distill_steps=steps)
        m = convert_heads(a.model, out / f"{g}-{grouping}-{merge}-{steps}", opts, force=True,
                          eval_tokens=a.eval_tokens, device="cpu")
        rows.append({"kv_heads": g, "grouping": grouping, "merge": merge, "distill_steps": steps, "metrics": m["metrics"]})
        (out / "results.json").write_text(json.dumps(rows, indent=2))
        print(g, grouping, merge, steps, json.dumps(m["metrics"]["quality"]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    q0 = rows[0]["metrics"]["quality"]
    print(f"\nmodel {a.model}, eval {q0['tokens']} tokens of docs-eval.txt, CPU float32, commit {commit}\n")
    print("| KV heads | grouping | merge | distill steps | KV bytes/token | KV at 32K | ppl | ppl vs parent | KL mean | KL / contiguous mean | top-1 | time s |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    m0 = rows[0]["metrics"]
    print(f"| {6} (parent) | - | - | - | {m0['kv_bytes_per_token_before']:,} | {m0['kv_bytes_at_32k_before'] / 2**20:.0f} MiB "
          f"| {q0['ppl_parent']:.2f} | - | 0 | - | 100% | - |")
    base = {r["kv_heads"]: r["metrics"]["quality"]["kl_mean"] for r in rows
            if r["grouping"] == "contiguous" and r["merge"] == "mean" and r["distill_steps"] == 0}
    for r in rows:
        m, q = r["metrics"], r["metrics"]["quality"]
        print(f"| {r['kv_heads']} | {r['grouping']} | {r['merge']} | {r['distill_steps']} | {m['kv_bytes_per_token_after']:,} "
              f"| {m['kv_bytes_at_32k_after'] / 2**20:.0f} MiB | {q['ppl']:.2f} | {(q['ppl'] / q['ppl_parent'] - 1) * 100:+.1f}% "
              f"| {q['kl_mean']:.4f} | {q['kl_mean'] / base[r['kv_heads']]:.3f} | {q['top1_agreement'] * 100:.1f}% | {m['seconds']:.0f} |")


if __name__ == "__main__":
    main()
