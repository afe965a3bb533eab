"""The CPU low-bit product (kernels/cpu_gemv.cpp's qgemv) per stored width at a model's decode
shapes: us a decoder layer and GB/s of weight bytes read, one row, every decoder layer's own
weights (q/k/v and gate/up fused as the model runs them; all of them, so that the weights stream
from memory as in a decode step, not from the caches), so that 5 and 6 bits can be set against
what their bytes predict from 4 and 8. Rounds interleave the widths (the machine may be shared:
take the ratios).
Usage: python scripts/cpu_bits_probe.py OUT.json [--shape llama-135m] [--bits 4,5,6,8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llamactl.layers import cpu as lcpu
from llamactl.layers.gptq import GPTQLinear, pack_gptq
from llamactl.quantize.rtn import rtn_quantize
from llamactl.runtime.synthetic import SHAPES


def layer_shapes(shape: str) -> list[tuple[str, int, int]]:
    """(name, out, in) of one decoder layer's products as the model fuses them."""
    s = SHAPES[shape]
    h, f = s["hidden_size"], s["intermediate_size"]
    heads, kv = s["num_attention_heads"], s.get("num_key_value_heads", s["num_attention_heads"])
    d = s.get("head_dim", h // heads)
    return [("qkv", (heads + 2 * kv) * d, h), ("o", h, heads * d), ("gate_up", 2 * f, h), ("down", h, f)]


def cpu_layer(n: int, k: int, bits: int) -> lcpu.CpuQuantLinear:
    w = torch.randn(n, k) * 0.02
    lin = GPTQLinear(k, n, bits, 32, bias=False)
    for name, t in pack_gptq(*rtn_quantize(w, bits, 32, True), bits).items():
        setattr(lin, name, t)
    return lcpu.CpuQuantLinear.from_gptq(lin)


def timed(fn, calls: int) -> float:
    for _ in range(max(3, calls // 10)):  # warm: the thread pool, the caches, the allocator
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama-135m")
    ap.add_argument("--bits", default="4,5,6,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="whole passes over the layers a round")
    args = ap.parse_args()
    problem = lcpu.kernels_load()
    if problem:
        raise SystemExit(f"the CPU kernels did not load: {problem}")
    bits = [int(b) for b in args.bits.split(",")]
    shapes = layer_shapes(args.shape)
    depth = SHAPES[args.shape]["num_hidden_layers"]
    layers = {b: [cpu_layer(n, k, b) for _ in range(depth) for _, n, k in shapes] for b in bits}
    xs = [torch.randn(1, k).bfloat16() for _, _, k in shapes] * depth

    def step(mods):
        for m, x in zip(mods, xs):
            m(x)

    times = {b: [] for b in bits}
    for _ in range(args.rounds):
        for b in bits:
            times[b].append(timed(lambda b=b: step(layers[b]), args.calls) / depth)
    rows = []
    for b in bits:
        nbytes = sum(m.weight_packed.numel() + m.scales.numel() * m.scales.element_size() + m.zeros.numel()
                     for m in layers[b]) / depth
        t = statistics.median(times[b])
        rows.append({"bits": b, "us_per_layer": t * 1e6, "spread_us": [min(times[b]) * 1e6, max(times[b]) * 1e6],
                     "weight_bytes": nbytes, "gb_s": nbytes / t / 1e9})
    base = next((r for r in rows if r["bits"] == 4), rows[0])
    for r in rows:
        r["of_its_bytes_vs_4"] = base["us_per_layer"] * r["weight_bytes"] / base["weight_bytes"] / r["us_per_layer"]
        print(f"{r['bits']} bits: {r['us_per_layer']:.1f} us a layer ({r['gb_s']:.1f} GB/s), "
              f"{r['of_its_bytes_vs_4']:.2f} of what its bytes predict from 4 bits")
    env = {"shape": args.shape, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "products": [s[0] for s in shapes], "decoder_layers": depth, "rounds": args.rounds,
           "passes": args.calls}
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
