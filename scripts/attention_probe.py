"""The decode attention of a batched step (issue 20), variant by variant, on the GPU: llama2-7b's
(32 KV heads, one query row each) and llama3-8b's (8 KV heads, 4 query rows each) at each batch,
every row at its own position near CTX in a MAX_SEQ cache, as the server steps. Each launch plan
of kernels.attention._attend (positions a tile, warps, pipelining stages) is timed in a CUDA graph
over enough cache copies that L2 cannot serve them, checked against float64, and put beside the
default plan: GB/s counts the K/V bytes read.

Usage: python scripts/attention_probe.py OUT.json [--batch 1,8,32] [--ctx 256] [--max-seq 320]
       [--variants tiles|splits]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from kernel_probe import graph_time, rel
from llamactl.kernels import attention

SHAPES = {"llama2-7b": (32, 1), "llama3-8b": (8, 4)}  # KV heads, query rows a KV head
D = 128


def inputs(b: int, hkv: int, rep: int, max_seq: int, ctx: int):
    """q [B, hkv, rep, D], cache copies ([B, hkv, S, D] K and V, >= 1.2 GB in all), positions [B]
    spread over ctx - 16 .. ctx (rows at their own lengths)."""
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    q = torch.randn(b, hkv, rep, D, device=dev, dtype=bf16)
    copies = max(2, int(1.2e9 // (2 * b * hkv * max_seq * D * 2)))
    caches = [(torch.randn(b, hkv, max_seq, D, device=dev, dtype=bf16),
               torch.randn(b, hkv, max_seq, D, device=dev, dtype=bf16)) for _ in range(copies)]
    pos = torch.randint(ctx - 16, ctx + 1, (b,), device=dev)
    return q, caches, pos


def reference(q, k, v, pos) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i, p in enumerate(pos.tolist()):
        s = q[i].double() @ k[i, :, : p + 1].double().transpose(-1, -2) / D**0.5
        out[i] = s.softmax(-1) @ v[i, :, : p + 1].double()
    return out


def variants(kind: str):
    """(name, _attend keyword arguments): the default first; kind "tiles": each tile, warps and
    pipelining depth; "splits": each smallest chunk of the cache (fewer, longer splits, down to one
    split and no merge kernel)."""
    yield "default", {}
    if kind == "splits":
        for chunk in (128, 256, 512, 1024):
            yield f"min chunk {chunk}", {"min_chunk": chunk}
        return
    for block_s, warps, stages in itertools.product((32, 64, 128), (4, 8), (1, 2, 3, 4)):
        yield f"tile {block_s} warps {warps} stages {stages}", {"block_s": block_s, "warps": warps, "stages": stages}


def probe(shape: str, b: int, ctx: int, max_seq: int, kind: str) -> dict:
    hkv, rep = SHAPES[shape]
    q, caches, pos = inputs(b, hkv, rep, max_seq, ctx)
    ref = reference(q, *caches[0], pos)
    gb = sum(2 * hkv * (p + 1) * D * 2 for p in pos.tolist()) / 1e9
    rows = []
    for name, kw in variants(kind):
        try:
            err = rel(attention._attend(q, *caches[0], pos, None, **kw), ref)
            t = graph_time([lambda k=k, v=v, kw=kw: attention._attend(q, k, v, pos, None, **kw) for k, v in caches])
        except Exception as e:  # a plan this GPU cannot run (shared memory, registers): say so, go on
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        rows.append({"variant": name, "us": t * 1e6, "gbs": gb / t, "rel_err": err,
                     "splits": attention.plan(max_seq, kw.get("min_chunk", attention.MIN_CHUNK), b * hkv,
                                                attention._fill(q.device))[0]})
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    base = rows[0]
    print(f"{shape} batch {b} ctx {ctx} cache {max_seq}: default {base.get('us', float('nan')):7.1f} us "
          f"({base.get('gbs', 0):5.0f} GB/s of K/V)", flush=True)
    for r in timed[:5]:
        print(f"  {r['us']:7.1f} us {r['gbs']:5.0f} GB/s err {r['rel_err']:.1e}  {r['variant']} ({r['splits']} splits)")
    return {"shape": shape, "batch": b, "ctx": ctx, "max_seq": max_seq, "kv_gb": gb, "variants": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--max-seq", type=int, default=320)
    ap.add_argument("--variants", choices=("tiles", "splits"), default="tiles")
    a = ap.parse_args()
    runs = []
    for shape in SHAPES:
        for b in a.batch.split(","):
            runs.append(probe(shape, int(b), a.ctx, a.max_seq, a.variants))
            with open(a.out, "w") as f:  # after each run: a time limit keeps what was measured
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
