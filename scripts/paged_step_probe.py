"""Decode steps over the paged KV cache at many rows (issue 49's goal: 64, 128 and 256 running rows
at ~700-token contexts, >= 0.75 of the ceiling counting the weights and the KV the rows hold):
the llama3-8b-shape step (random bf16 weights) in a CUDA graph, every row at its own position
(uniform 200..1200, blocks of 16 shuffled through the pool, a table as wide as a server's
--max-seq), timed over replays and profiled by kernel; the ceiling from the same call's copy
bandwidth (scripts/gpu_rates.py).

Usage: python scripts/paged_step_probe.py OUT.json [--rows 32,64,128,256] [--max-seq 8192] [--variants new,old]
       [--kv-dtypes bf16,int8,fp8]   (the pool's format: runtime.kv_format; the ceiling counts its bytes)
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_rates import rates, timed
from llamactl.bench.targets import load_targets
from llamactl.runtime.kv_cache import PagedCache
from llamactl.runtime.sampling import RowSampling
from llamactl.runtime.settings import Sampling
from llamactl.runtime.step import Decoder

REPLAYS = 20
BLOCK = 16


def family(name: str) -> str:
    """A kernel's group in the breakdown."""
    for key, group in (("_split_kernel", "attention"), ("_merge_kernel", "attention merge"), ("gemm", "gemm"),
                       ("gemv", "gemv"), ("nvjet", "gemm"), ("cutlass", "gemm"), ("rms", "norm"), ("silu", "swiglu")):
        if key in name.lower():
            return group
    return "other"


# the attention's plans over the paged cache (kernels.attention): the default, and the ones before it
VARIANTS = {"new": (True, 2), "chunks": (True, 4), "old": (False, 4)}  # (PAGED_ROW_CHUNKS, PAGED_FILL_PER_SM)


def probe(model, rows: int, max_seq: int, bandwidth: float, variant: str = "new", kv_dtype: str = "bf16") -> dict:
    from llamactl.kernels import attention
    from llamactl.runtime.kv_format import resolve

    attention.PAGED_ROW_CHUNKS, attention.PAGED_FILL_PER_SM = VARIANTS[variant]
    rng = random.Random(rows)
    ctx = [rng.randint(200, 1200) for _ in range(rows)]
    need = [-(-(c + 2) // BLOCK) for c in ctx]
    fmt = resolve(kv_dtype, torch.bfloat16, "cuda")
    cache = PagedCache.for_model(model, rows, sum(need) + 1, BLOCK, max_seq, fmt=fmt)
    ids = list(range(1, sum(need) + 1))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    cache.set_rows(list(range(rows)), tables)
    sampling = RowSampling.make([Sampling(temperature=0)] * rows, model.device)
    sampling.greedy = True
    dec = Decoder(model, rows, max_seq, "graphs", options=None, rows=sampling, cache=cache)
    tok = torch.randint(0, model.args.vocab_size, (rows,), device="cuda")
    pos = torch.tensor(ctx, device="cuda")
    step_s = timed(lambda: dec.step(tok, pos), REPLAYS)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            dec.step(tok, pos)
        torch.cuda.synchronize()
    groups: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            groups[family(ev.name)] += ev.device_time / REPLAYS
    a = model.args
    kv_bytes = sum(c + 1 for c in ctx) * 2 * a.num_hidden_layers * a.num_key_value_heads * fmt.bytes_per_head(a.head_dim)
    emb = model.model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - emb.numel() * emb.element_size()
    if model.lm_head.weight is emb:
        weight_bytes += emb.numel() * emb.element_size()
    ceiling = (kv_bytes + weight_bytes) / bandwidth
    attn_us = groups.get("attention", 0) + groups.get("attention merge", 0)
    out = {"rows": rows, "variant": variant, "kv_dtype": fmt.name, "ctx_mean": sum(ctx) / rows, "max_seq": max_seq, "step_ms": round(step_s * 1e3, 3),
           "ceiling_ms": round(ceiling * 1e3, 3), "of_ceiling": round(ceiling / step_s, 3),
           "weight_gb": round(weight_bytes / 1e9, 2), "kv_gb": round(kv_bytes / 1e9, 2),
           "attention_us": round(attn_us, 1),
           "attention_of_its_bytes": round(kv_bytes / bandwidth * 1e6 / attn_us, 3) if attn_us else None,
           "kernels_us": {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}
    del dec, cache
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", default="32,64,128,256")
    ap.add_argument("--max-seq", type=int, default=8192)
    ap.add_argument("--variants", default="new", help=f"attention plans, a comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--kv-dtypes", default="bf16", help="the pool's formats, a comma list of bf16, int8, fp8")
    a = ap.parse_args()
    r = rates()
    model = load_targets([], "llama3-8b", torch.device("cuda"), "bfloat16")[0].model
    runs = []
    for rows, variant, kv in ((int(x), v, k) for x in a.rows.split(",") for v in a.variants.split(",")
                              for k in a.kv_dtypes.split(",")):
        runs.append(probe(model, rows, a.max_seq, r["copy_bytes_s"], variant, kv))
        print(json.dumps(runs[-1]), flush=True)
        with open(a.out, "w") as f:
            json.dump({"rates": r, "torch": torch.__version__, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
