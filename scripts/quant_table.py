"""Measure the quantization quality table of docs/quantize-quality.md.

Usage: python scripts/quant_table.py MODEL OUT_DIR [--eval-tokens N]
Runs `llamactl quantize` (through its core function) for each configuration, 4-bit g128 unless
named otherwise, GPTQ calibrated on 128 docs samples of 512 tokens, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

from llamactl.quantize.stage import QuantOptions, quantize

CALIB = dict(calib="docs", n_samples=128, seq_len=512)
CONFIGS = [
    ("RTN sym", QuantOptions(method="rtn")),
    ("RTN asym", QuantOptions(method="rtn", sym=False)),
    ("RTN sym + clip search", QuantOptions(method="rtn", clip_search=True)),
    ("GPTQ sym", QuantOptions(method="gptq", **CALIB)),
    ("GPTQ sym, act-order", QuantOptions(method="gptq", desc_act=True, **CALIB)),
    ("GPTQ asym", QuantOptions(method="gptq", sym=False, **CALIB)),
    ("GPTQ sym + clip search (mse)", QuantOptions(method="gptq", clip_search=True, **CALIB)),
    ("GPTAQ sym", QuantOptions(method="gptq", gptq_variant="gptaq", **CALIB)),
    ("GPTAQ sym + clip search", QuantOptions(method="gptq", gptq_variant="gptaq", clip_search=True, **CALIB)),
    ("GPTAQ asym + clip search", QuantOptions(method="gptq", gptq_variant="gptaq", clip_search=True, sym=False, **CALIB)),
    ("NF4 (bitsandbytes)", QuantOptions(method="nf4")),
    ("RTN int8 g128", QuantOptions(method="rtn", bits=8)),
    ("LLM.int8 (bitsandbytes)", QuantOptions(method="int8", bits=8)),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--only", default=None, help="comma list of row indices")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (label, opts) in enumerate(CONFIGS):
        if a.only and str(i) not in a.only.split(","):
            continue
        m = quantize(a.model, out / f"q{i}", opts, force=True, eval_tokens=a.eval_tokens, device="cpu")
        rows.append({"label": label, "options": m["params"], "metrics": m["metrics"]})
        (out / "results.json").write_text(json.dumps(rows, indent=2, default=str))
        print(label, json.dumps(m["metrics"]["quality"]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rtn_kl = next((r["metrics"]["quality"]["kl_mean"] for r in rows if r["label"] == "RTN sym"), None)
    q0 = rows[0]["metrics"]["quality"]
    print(f"\nmodel {a.model}, eval {q0['tokens']} tokens of docs-eval.txt in windows of {q0['window_len']}, "
          f"CPU float32, commit {commit}, {platform.machine()} {platform.processor() or ''}\n")
    print("| config | weight bytes | ppl | ppl vs 16-bit | KL mean | KL / RTN sym | top-1 agree | time s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| 16-bit parent (bf16) | {rows[0]['metrics']['parent_weight_bytes']:,} | {q0['ppl_parent']:.2f} | - | 0 | - | 100% | - |")
    for r in rows:
        q, m = r["metrics"]["quality"], r["metrics"]
        ratio = f"{q['kl_mean'] / rtn_kl:.3f}" if rtn_kl else "-"
        print(f"| {r['label']} | {m['weight_bytes']:,} | {q['ppl']:.2f} | {(q['ppl'] / q['ppl_parent'] - 1) * 100:+.2f}% "
              f"| {q['kl_mean']:.4f} | {ratio} | {q['top1_agreement'] * 100:.1f}% | {m['quantize_seconds']:.0f} |")


if __name__ == "__main__":
    main()
