"""The decode attention of a batched step (issue 20), variant by variant, on the GPU: llama2-7b's
(32 KV heads, one query row each) and llama3-8b's (8 KV heads, 4 query rows each) at each batch,
every row at its own position near CTX in a MAX_SEQ cache, as the server steps. Each launch plan
of kernels.attention._attend (positions a tile, warps, pipelining stages) is timed in a CUDA graph
over enough cache copies that L2 cannot serve them, checked against float64, and put beside the
default plan: GB/s counts the K/V bytes read (an 8-bit cache's scales included).

Usage: python scripts/attention_probe.py OUT.json [--batch 1,8,32] [--ctx 256] [--max-seq 320]
       [--variants tiles|wide|splits|kv8] [--kv-dtype bf16|int8|fp8] [--shapes llama2-7b,llama3-8b]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json

import torch

from llamactl.kernels import attention, kv_tile
from llamactl.runtime import kv_format
from llamactl.runtime.graphs import replay_seconds

SHAPES = {"llama2-7b": (32, 1), "llama3-8b": (8, 4)}  # KV heads, query rows a KV head
D = 128


def rel(y, ref) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def inputs(b: int, hkv: int, rep: int, max_seq: int, ctx: int, fmt: kv_format.KVFormat):
    """q [B, hkv, rep, D], cache copies (each (K, V, {scales}): [B, hkv, S, D] in fmt's storage,
    >= 1.2 GB in all; scales: _attend's keyword for an 8-bit cache), positions [B] spread over
    ctx - 16 .. ctx (rows at their own lengths)."""
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    q = torch.randn(b, hkv, rep, D, device=dev, dtype=bf16)
    copies = max(2, int(1.2e9 // (2 * b * hkv * max_seq * fmt.bytes_per_head(D))))
    caches = []
    for _ in range(copies):
        k, v = (torch.randn(b, hkv, max_seq, D, device=dev, dtype=bf16) for _ in range(2))
        if fmt.quantized:
            (k, ks), (v, vs) = kv_format.quantize(k, fmt), kv_format.quantize(v, fmt)
            caches.append((k, v, {"scales": (ks, vs)}))
        else:
            caches.append((k, v, {}))
    pos = torch.randint(ctx - 16, ctx + 1, (b,), device=dev)
    return q, caches, pos


def reference(q, k, v, pos, scales=None) -> torch.Tensor:
    """float64 attention of q over each row's positions 0..pos (an 8-bit cache dequantized)."""
    if scales is not None:
        k, v = (kv_format.dequantize(x, s, torch.float64) for x, s in zip((k, v), scales))
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i, p in enumerate(pos.tolist()):
        s = q[i].double() @ k[i, :, : p + 1].double().transpose(-1, -2) / D**0.5
        out[i] = s.softmax(-1) @ v[i, :, : p + 1].double()
    return out


def variants(kind: str):
    """(name, _attend keyword arguments, kernels.attention settings for the call): the default
    first; kind "tiles": each tile, warps and pipelining depth; "wide": the longer tiles an 8-bit
    cache may want (64-256 positions, 4 or 8 warps, 2 or 3 stages); "splits": each smallest chunk of
    the cache (fewer, longer splits, down to one split and no merge kernel); "kv8": an 8-bit cache's
    choices (Triton's own conversions instead of KV8_ASM's, 2-4 stages, 32- and 128-position tiles,
    twice and half the programs an SM, longer chunks)."""
    yield "default", {}, {}
    if kind == "kv8":
        yield "triton's conversions", {}, {"KV8_ASM": False}
        for stages in (2, 4):
            yield f"stages {stages}", {"stages": stages}, {}
        for block_s, warps in ((128, 4), (128, 8), (32, 4)):
            yield f"tile {block_s} warps {warps}", {"block_s": block_s, "warps": warps}, {}
        for fill in (2, 8):
            yield f"{fill} programs an SM", {}, {"FILL_PER_SM": fill}
        for chunk in (256, 1024):
            yield f"min chunk {chunk}", {"min_chunk": chunk}, {}
        return
    if kind == "splits":
        for chunk in (128, 256, 512, 1024):
            yield f"min chunk {chunk}", {"min_chunk": chunk}, {}
        return
    sizes = ((64, 128, 256), (4, 8), (2, 3)) if kind == "wide" else ((32, 64, 128), (4, 8), (1, 2, 3, 4))
    for block_s, warps, stages in itertools.product(*sizes):
        yield f"tile {block_s} warps {warps} stages {stages}", {"block_s": block_s, "warps": warps, "stages": stages}, {}


@contextlib.contextmanager
def settings(values: dict):
    """Module settings of kernels.attention and kernels.kv_tile (whichever has each) set to values
    for the block, restored after."""
    mods = {k: attention if hasattr(attention, k) else kv_tile for k in values}
    old = {k: getattr(mods[k], k) for k in values}
    for k, v in values.items():
        setattr(mods[k], k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(mods[k], k, v)


def probe(shape: str, b: int, ctx: int, max_seq: int, kind: str, fmt: kv_format.KVFormat) -> dict:
    hkv, rep = SHAPES[shape]
    q, caches, pos = inputs(b, hkv, rep, max_seq, ctx, fmt)
    k0, v0, sc0 = caches[0]
    ref = reference(q, k0, v0, pos, sc0.get("scales"))
    gb = sum(2 * hkv * (p + 1) * fmt.bytes_per_head(D) for p in pos.tolist()) / 1e9
    rows = []
    for name, kw, values in variants(kind):
        try:
            with settings(values):
                err = rel(attention._attend(q, k0, v0, pos, None, **kw, **sc0), ref)
                t = replay_seconds([lambda k=k, v=v, sc=sc, kw=kw: attention._attend(q, k, v, pos, None, **kw, **sc)
                                for k, v, sc in caches])
                splits = attention.plan(max_seq, kw.get("min_chunk", attention.MIN_CHUNK), b * hkv,
                                        attention._fill(q.device))[0]
        except Exception as e:  # a plan this GPU cannot run (shared memory, registers): say so, go on
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        rows.append({"variant": name, "us": t * 1e6, "gbs": gb / t, "rel_err": err, "splits": splits})
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    base = rows[0]
    print(f"{shape} {fmt.name} batch {b} ctx {ctx} cache {max_seq}: default {base.get('us', float('nan')):7.1f} us "
          f"({base.get('gbs', 0):5.0f} GB/s of K/V)", flush=True)
    for r in timed[:5]:
        print(f"  {r['us']:7.1f} us {r['gbs']:5.0f} GB/s err {r['rel_err']:.1e}  {r['variant']} ({r['splits']} splits)")
    return {"shape": shape, "kv_dtype": fmt.name, "batch": b, "ctx": ctx, "max_seq": max_seq, "kv_gb": gb,
            "variants": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--max-seq", type=int, default=320)
    ap.add_argument("--variants", choices=("tiles", "wide", "splits", "kv8"), default="tiles")
    ap.add_argument("--kv-dtype", default="bf16", help="the cache's values: bf16, int8 or fp8 (scaled, runtime.kv_format)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    fmt = kv_format.resolve(a.kv_dtype, torch.bfloat16, "cuda")
    runs = []
    for shape in a.shapes.split(","):
        for b in a.batch.split(","):
            runs.append(probe(shape, int(b), a.ctx, a.max_seq, a.variants, fmt))
            with open(a.out, "w") as f:  # after each run: a time limit keeps what was measured
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
