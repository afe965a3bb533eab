"""KL of llamactl's CPU kernels from the float path, as decoding computes them (batch-1 steps).

For each folder: the parent is the same folder in float32 on torch's kernels (16-bit folders: the
weights as they are; GPTQ folders: dequantized exactly, GPTQLinear), the child the same folder on
llamactl's CPU kernels in bfloat16 (x rounded to bf16 for 16-bit layers, to int8 per 32 inputs for
low-bit ones). Usage:
  python scripts/cpu_kl.py OUT.json FOLDER [FOLDER...] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

from llamactl.folder.artifact import open_artifact, resolve_model_path
from llamactl.folder.checkpoint import load_tokenizer
from llamactl.layers.plan import prepare
from llamactl.runtime.load import load_model
from llamactl.options import RuntimeOptions
from llamactl.quality import compare, decode_logits, eval_windows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    a = ap.parse_args()
    cpu, rows = torch.device("cpu"), []
    for folder in a.folders:
        art = open_artifact(resolve_model_path(folder))
        off, on = RuntimeOptions(kernels=False), RuntimeOptions()
        parent = load_model(art, cpu, torch.float32, off)
        child = load_model(art, cpu, torch.bfloat16, on)
        plan = prepare(child, on)
        windows = eval_windows(load_tokenizer(art), None, a.window, a.tokens)
        q = compare(parent, child, windows, child_logits=decode_logits)
        rows.append({"folder": folder, "child": f"bfloat16, gemv {plan.label}", "parent": "float32, torch",
                     **asdict(q)})
        print(f"{folder}: KL {q.kl_mean:.6f} (p99 {q.kl_p99:.5f}), top-1 {q.top1_agreement:.4f}, {q.tokens} tokens")
    with open(a.out, "w") as f:
        json.dump({"command": "python scripts/cpu_kl.py " + " ".join(a.folders), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
