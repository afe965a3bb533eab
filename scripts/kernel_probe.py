"""llamactl's Triton kernels against the library paths on this GPU: error and speed per shape.

For each decode-step shape of llama2-7b and llama3-8b: the bf16 GEMV against cuBLAS (F.linear),
the int4 GEMV against tinygemm, the int8 GEMV against torch's _weight_int8pack_mm, and split-KV
decode attention against SDPA over the whole cache. Every timing replays a CUDA graph that runs the
product over enough copies of the weights (>= 1 GB) that the 50 MB L2 cannot serve them, and divides
by the number of copies; GB/s counts the weight (or K/V) bytes read.
"folded": the same GEMV with what the model folds into it at that layer (the RMSNorm before qkv,
gate_up and lm_head; SwiGLU before and the residual after down; the residual after o), so the
cost of the folds shows per shape. The attention sweep times launch plans of the split kernel
(min chunk, positions a tile, warps) against the default.
--step: only llama2-7b's decode-step GEMVs as the model runs them (its folds, the pinned picks)
for bf16, int8 and int4 weights with float and int8 inputs, their sum over a step, and the
attention kernel at the standard case's contexts: where a step's time goes, kernel by kernel,
without a profiler (under PDL a profile's kernel times include each one's wait for the one before).
--sweep KINDS: every GEMV candidate for each kind ("int8 x int8", "int4 fp16", ...: see KINDS) at
llama2-7b's step shapes, and the fastest per shape written as a pins file (LLAMACTL_PINS_FILE) to
bench them with.
Usage: python scripts/kernel_probe.py [OUT.json]  |  python scripts/kernel_probe.py --step [OUT.json]
       python scripts/kernel_probe.py --sweep "int8,int4 fp16" [PINS.json]   (timings beside it: PINS-sweep.json)
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from llamactl.kernels.device import pdl_supported
from llamactl.kernels import attention, gemv, gemv_int4
from llamactl.kernels.arith import switches
from llamactl.layers import int4 as tg

dev, bf16 = torch.device("cuda"), torch.bfloat16
torch.manual_seed(0)
SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32000, 4096), "l3 qkv": (6144, 4096), "l3 gate_up": (28672, 4096),
          "l3 down": (4096, 14336), "l3 lm_head": (128256, 4096)}
FOLDS = {"qkv": "norm", "gate_up": "norm", "lm_head": "norm", "o": "residual", "down": "glu+residual"}


def folds(name: str, x: torch.Tensor, n: int, swiglu_after_gate_up: bool = False) -> tuple[torch.Tensor, dict]:
    """_folds' input and arguments, launched as the decode step launches them (PDL where it runs)."""
    x, kw = _folds(name, x, n, swiglu_after_gate_up)
    return x, {**kw, "pdl": pdl_supported(dev)}


def _folds(name: str, x: torch.Tensor, n: int, swiglu_after_gate_up: bool = False) -> tuple[torch.Tensor, dict]:
    """The input and the fold arguments (norm_weight/eps, residual, glu) the model uses for `name`;
    swiglu_after_gate_up: the alternative where gate_up applies SwiGLU to its own
    outputs (glu_out) and down takes the result plainly."""
    kind = FOLDS[name.removeprefix("l3 ")]
    if swiglu_after_gate_up and kind == "norm" and name.endswith("gate_up"):
        return x, {"norm_weight": torch.rand_like(x) + 0.5, "eps": 1e-5, "glu_out": True}
    if swiglu_after_gate_up and kind == "glu+residual":
        return x, {"residual": torch.randn(n, device=dev, dtype=bf16)}
    if kind == "norm":
        return x, {"norm_weight": torch.rand_like(x) + 0.5, "eps": 1e-5}
    residual = torch.randn(n, device=dev, dtype=bf16)
    if kind == "residual":
        return x, {"residual": residual}
    return torch.randn(2 * x.numel(), device=dev, dtype=bf16), {"residual": residual, "glu": True}


def graph_time(fns) -> float:
    """Median time (s) of one call, replaying a graph of all `fns` (one per weight copy)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000 / len(fns))
    return sorted(times[2:])[len(times[2:]) // 2]


def rel(y, ref) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def probe_linear(name, n, k, out):
    copies = max(2, int(1.2e9 // (n * k * 2)))
    x = torch.randn(k, device=dev, dtype=bf16)
    ws = [torch.randn(n, k, device=dev, dtype=bf16) * 0.02 for _ in range(copies)]
    err = rel(gemv.gemv_bf16(x, ws[0]), ws[0].double() @ x.double())
    t_cublas = graph_time([lambda w=w: F.linear(x[None], w) for w in ws])
    t_triton = graph_time([lambda w=w: gemv.gemv_bf16(x, w) for w in ws])
    xf, kw = folds(name, x, n)
    t_folded = graph_time([lambda w=w: gemv.gemv(xf, w, **kw) for w in ws])
    xa, kwa = folds(name, x, n, swiglu_after_gate_up=True)
    t_alt = graph_time([lambda w=w: gemv.gemv(xa, w, **kwa) for w in ws])
    gb = n * k * 2 / 1e9
    row = {"shape": name, "n": n, "k": k, "bf16_rel_err": err, "cublas_us": t_cublas * 1e6, "triton_us": t_triton * 1e6,
           "cublas_gbs": gb / t_cublas, "triton_gbs": gb / t_triton, "triton_folded_us": t_folded * 1e6, "triton_alt_us": t_alt * 1e6,
           "folds": FOLDS[name.removeprefix("l3 ")]}
    del ws
    # int4, group 128: llamactl's GEMV against tinygemm on the same codes
    g = 128
    copies4 = max(2, int(1.2e9 // (n * k // 2)))
    codes = torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32)
    zeros = torch.randint(0, 16, (k // g, n), device=dev)
    scales = torch.rand(k // g, n, device=dev) * 0.01 + 0.001
    qw, s16, z8 = gemv_int4.pack_int4(codes), scales.t().contiguous().half(), zeros.t().contiguous().to(torch.uint8)
    ref = gemv_int4.dequantize_int4(qw, s16, z8, g, torch.float32).double() @ x.double()
    row["int4_rel_err"] = rel(gemv_int4.gemv_int4(x, qw, s16, z8, g), ref)
    q_t, sz, _ = tg.tinygemm_params(codes, zeros, scales, torch.arange(k, device=dev) // g, g)
    tiny = tg.pack(q_t, dev)
    sz = sz.to(bf16)
    row["tinygemm_rel_err"] = rel(torch.ops.aten._weight_int4pack_mm(x[None], tiny, g, sz)[0], ref)
    qws = [qw.clone() for _ in range(copies4)]
    tinys = [tiny.clone() for _ in range(copies4)]
    t4 = graph_time([lambda q=q: gemv_int4.gemv_int4(x, q, s16, z8, g) for q in qws])
    xf, kw = folds(name, x, n)
    t4f = graph_time([lambda q=q: gemv_int4.gemv_int4(xf, q, s16, z8, g, **kw) for q in qws])
    t4a = graph_time([lambda q=q: gemv_int4.gemv_int4(xa, q, s16, z8, g, **kwa) for q in qws])
    tt = graph_time([lambda q=q: torch.ops.aten._weight_int4pack_mm(x[None], q, g, sz) for q in tinys])
    del qws, tinys
    gb4 = n * k / 2 / 1e9
    row.update(int4_triton_us=t4 * 1e6, tinygemm_us=tt * 1e6, int4_triton_gbs=gb4 / t4, tinygemm_gbs=gb4 / tt,
               int4_folded_us=t4f * 1e6, int4_alt_us=t4a * 1e6)
    # int8 per channel
    copies8 = max(2, int(1.2e9 // (n * k)))
    w8 = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
    s8 = (torch.rand(n, device=dev) * 0.01).to(bf16)
    ref8 = (w8.double() @ x.double()) * s8.double()
    row["int8_rel_err"] = rel(gemv.gemv_int8(x, w8, s8), ref8)
    w8s = [w8.clone() for _ in range(copies8)]
    t8 = graph_time([lambda w=w: gemv.gemv_int8(x, w, s8) for w in w8s])
    xf, kw = folds(name, x, n)
    t8f = graph_time([lambda w=w: gemv.gemv(xf, w, s8, **kw) for w in w8s])
    t8a = graph_time([lambda w=w: gemv.gemv(xa, w, s8, **kwa) for w in w8s])
    try:
        t8t = graph_time([lambda w=w: torch.ops.aten._weight_int8pack_mm(x[None], w, s8) for w in w8s])
    except Exception as e:  # noqa: BLE001
        print(f"_weight_int8pack_mm: {type(e).__name__}: {str(e)[:120]}")
        t8t = float("nan")
    del w8s
    row.update(int8_triton_us=t8 * 1e6, int8_torch_us=t8t * 1e6, int8_triton_gbs=n * k / 1e9 / t8, int8_folded_us=t8f * 1e6,
               int8_alt_us=t8a * 1e6)
    out.append(row)
    print(f"{name:11s} {n}x{k}: bf16 cublas {t_cublas*1e6:7.1f} us {gb/t_cublas:5.0f} GB/s | triton {t_triton*1e6:7.1f} us "
          f"{gb/t_triton:5.0f} GB/s ({t_cublas/t_triton:.2f}x) | int4 triton {t4*1e6:6.1f} us {gb4/t4:5.0f} GB/s, "
          f"tinygemm {tt*1e6:6.1f} us ({tt/t4:.2f}x) | int8 triton {t8*1e6:6.1f} us, torch {t8t*1e6:6.1f} us | "
          f"err bf16 {err:.1e} int4 {row['int4_rel_err']:.1e} int8 {row['int8_rel_err']:.1e}\n"
          f"{'':11s} folded ({row['folds']}): bf16 {t_folded*1e6:7.1f} us | int4 {t4f*1e6:6.1f} us | int8 {t8f*1e6:6.1f} us",
          flush=True)


def attention_inputs(hkv, rep, s_max, ctx, d=128):
    """q: [1, hkv, rep, d], enough K/V cache copies ([1, hkv, s_max, d] each) to exceed L2, pos: [1] = ctx - 1."""
    q = torch.randn(1, hkv, rep, d, device=dev, dtype=bf16)
    copies = max(2, int(1.2e9 // (2 * hkv * s_max * d * 2)))
    caches = [(torch.randn(1, hkv, s_max, d, device=dev, dtype=bf16), torch.randn(1, hkv, s_max, d, device=dev, dtype=bf16))
              for _ in range(copies)]
    return q, caches, torch.tensor([ctx - 1], device=dev)


def probe_attention(hkv, rep, s_max, ctx, out):
    d = 128
    q, caches, pos = attention_inputs(hkv, rep, s_max, ctx, d)
    k, v = caches[0]
    ref = F.scaled_dot_product_attention(q.double(), k[:, :, :ctx].double(), v[:, :, :ctx].double())
    err = rel(attention.decode_attention(q, k, v, pos), ref)
    mask = torch.arange(s_max, device=dev)[None, None, None, :] < ctx  # [1, 1, 1, S] as the model builds it
    mask = mask.expand(1, 1, rep, s_max)
    t_sdpa = graph_time([lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask) for k, v in caches])
    t_tri = graph_time([lambda k=k, v=v: attention.decode_attention(q, k, v, pos) for k, v in caches])
    gb = 2 * hkv * ctx * d * 2 / 1e9
    out.append({"kv_heads": hkv, "rep": rep, "cache": s_max, "ctx": ctx, "rel_err": err, "sdpa_us": t_sdpa * 1e6,
                "triton_us": t_tri * 1e6, "triton_gbs": gb / t_tri})
    print(f"attention kv_heads {hkv} rep {rep} cache {s_max} ctx {ctx}: sdpa {t_sdpa*1e6:7.1f} us | triton {t_tri*1e6:7.1f} us "
          f"({gb/t_tri:5.0f} GB/s of K/V, {t_sdpa/t_tri:.2f}x) | err {err:.1e}", flush=True)


def sweep_attention(hkv, rep, s_max, ctx, out):
    """The split kernel's launch plans for one shape, against the default plan."""
    q, caches, pos = attention_inputs(hkv, rep, s_max, ctx)
    base = graph_time([lambda k=k, v=v: attention._attend(q, k, v, pos, None) for k, v in caches])
    rows = []
    for min_chunk in (32, 64, 128, 256, 512):
        for block_s in (32, 64):
            for warps in (2, 4):
                if block_s > min_chunk:
                    continue
                t = graph_time([lambda k=k, v=v: attention._attend(q, k, v, pos, None, min_chunk, block_s, warps)
                                for k, v in caches])
                rows.append({"min_chunk": min_chunk, "block_s": block_s, "warps": warps, "us": t * 1e6,
                             "splits": attention.plan(s_max, min_chunk)[0]})
    best = sorted(rows, key=lambda r: r["us"])[:4]
    out.append({"kv_heads": hkv, "rep": rep, "cache": s_max, "ctx": ctx, "default_us": base * 1e6, "plans": rows})
    print(f"attention plans kv_heads {hkv} rep {rep} cache {s_max} ctx {ctx}: default {base*1e6:6.1f} us; best "
          + ", ".join(f"chunk>={r['min_chunk']} tile {r['block_s']} warps {r['warps']} ({r['splits']} splits) "
                      f"{r['us']:6.1f} us" for r in best), flush=True)


STEP = ("qkv", "o", "gate_up", "down")  # a llama2-7b layer's GEMVs, then lm_head once a step
# weights, and "x int8": int8 inputs (A8); "fp16": packed fp16 arithmetic (H16); "x int16": int16
# inputs (I16)
KINDS = ("bf16", "int8", "int8 x int8", "int8 fp16", "int8 x int16", "int4", "int4 x int8", "int4 fp16", "int4 x int16")


def kind_inputs(kind: str) -> str:
    """What a KINDS entry's GEMV multiplies with (env.QUANT_INPUTS)."""
    return "int8" if kind.endswith("x int8") else "fp16" if kind.endswith("fp16") else "int16" if kind.endswith(
        "x int16") else "float"


def step_weights(kind: str, n: int, k: int):
    """(bytes, a function (x, folds) -> y) for one random weight of `kind`, on `dev`."""
    if kind == "bf16":
        w = torch.randn(n, k, device=dev, dtype=bf16) * 0.02
        return n * k * 2, lambda x, kw: gemv.gemv(x, w, **kw)
    inputs = kind_inputs(kind)
    if kind.startswith("int8"):
        w8 = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
        s8 = (torch.rand(n, device=dev) * 0.01).to(bf16)
        return n * k + 2 * n, lambda x, kw, inputs=inputs: gemv.gemv(x, w8, s8, **kw, inputs=inputs)
    g = 128
    q = gemv_int4.pack_int4(torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32))
    s16 = (torch.rand(n, k // g, device=dev) * 0.01 + 0.001).half()
    z8 = torch.randint(0, 16, (n, k // g), device=dev).to(torch.uint8)
    return n * k // 2 + 3 * n * (k // g), lambda x, kw, inputs=inputs: gemv_int4.gemv_int4(x, q, s16, z8, g, **kw,
                                                                                     inputs=inputs)


def step_copies(kind: str, n: int, k: int) -> tuple[int, list]:
    """(bytes of one weight, step_weights' functions over enough copies of it (>= 1.2 GB) that L2
    cannot serve them)."""
    nbytes, first = step_weights(kind, n, k)
    return nbytes, [first] + [step_weights(kind, n, k)[1] for _ in range(max(1, int(1.2e9 // nbytes)) - 1)]


def probe_step(out: list, shapes: dict = SHAPES, layers: int = 32, timer=None) -> None:
    """The decode step's GEMVs as the model runs them (llama2-7b: the folds of the default SwiGLU
    site, kernels.pinned's picks on an H200) per weight kind, timed alone (graph replays over
    weight copies), and their sum over a step: layers x (qkv, o, gate_up, down) + lm_head (16-bit
    in every kind). Against a bench's ms/token, the rest is the step's other work (attention,
    RoPE, launch gaps). timer: graph_time, or a stand-in off the GPU."""
    timer = timer or graph_time
    for kind in KINDS:
        row, step_us, step_bytes = {"kind": kind}, 0.0, 0
        for name in STEP + ("lm_head",):
            n, k = shapes[name]
            wkind = "bf16" if name == "lm_head" else kind
            nbytes, copies = step_copies(wkind, n, k)
            x, kw = folds(name, torch.randn(k, device=dev, dtype=bf16), n, swiglu_after_gate_up=True)
            t = timer([lambda f=f: f(x, kw) for f in copies])
            times = layers if name != "lm_head" else 1
            step_us += t * 1e6 * times
            step_bytes += nbytes * times
            row[name] = {"us": t * 1e6, "gbs": nbytes / 1e9 / t}
            del copies
        row.update(step_gemv_us=step_us, step_gb=step_bytes / 1e9)
        out.append(row)
        print(f"{kind:12s} " + " | ".join(f"{name} {row[name]['us']:6.1f} us {row[name]['gbs']:5.0f} GB/s"
                                           for name in STEP + ("lm_head",))
              + f" | step's GEMVs {step_us / 1000:.3f} ms for {step_bytes / 1e9:.2f} GB", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def sweep(kind: str, out: list, pins: list, shapes: dict = SHAPES, timer=None) -> None:
    """Every GEMV candidate for `kind` (one of KINDS but bf16; with int8 inputs the REDUCE_EACH
    twins once) at each of llama2-7b's step shapes, with its folds, timed as probe_step times
    them, each checked against float inputs; the fastest per shape go to `pins` as
    LLAMACTL_PINS_FILE rows. timer: graph_time, or a stand-in off the GPU."""
    timer = timer or graph_time
    inputs, int4 = kind_inputs(kind), kind.startswith("int4")
    arith = switches(inputs)
    cpu = {"x_ptr": torch.empty(1), "N": 0, "K": 0, "NORM": False, "GLU": False, "RESIDUAL": False}  # no pins
    if int4:
        candidates = gemv_int4._prune_int4(gemv_int4._int4_configs(), {**cpu, "G": 128}, **arith)
    else:
        candidates = gemv._prune_gemv(gemv._bf16_configs(), {**cpu, "HAS_SCALE": True}, **arith)
    fixed = gemv.FIXED_BLOCKS, gemv.GEMV_FIXED, gemv_int4.INT4_FIXED
    try:
        for name in STEP:
            n, k = shapes[name]
            nbytes, copies = step_copies(kind, n, k)
            first = copies[0]
            x, kw = folds(name, torch.randn(k, device=dev, dtype=bf16), n, swiglu_after_gate_up=True)
            rows = []
            gemv.FIXED_BLOCKS = True
            gemv.GEMV_FIXED, gemv_int4.INT4_FIXED = fixed[1:]
            ref = first(x, kw, inputs="float")  # float inputs and arithmetic, the fixed blocks
            for c in candidates:
                config = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                if int4:
                    gemv_int4.INT4_FIXED = config
                else:
                    gemv.GEMV_FIXED = config
                # float inputs: int8 rounding of x adds ~0.5%, fp16 arithmetic ~0.05%, a wrong layout far more
                err = rel(first(x, kw), ref)
                t = timer([lambda f=f: f(x, kw) for f in copies])
                rows.append({"config": config, "us": t * 1e6, "gbs": nbytes / 1e9 / t, "rel_err": err})
            rows.sort(key=lambda r: r["us"])
            out.append({"kind": kind, "shape": name, "n": n, "k": k, "configs": rows})
            key = [n, k, 128 if int4 else True, "norm_weight" in kw, kw.get("glu", False), "residual" in kw,
                   kw.get("glu_out", False), pdl_supported(dev), inputs, "bfloat16"]
            pins.append(["int4" if int4 else "gemv", key, rows[0]["config"]])
            print(f"{kind} {name} (largest error against float inputs {max(r['rel_err'] for r in rows):.1e}): "
                  + ", ".join(
                f"{r['config']['BLOCK_N']}x{r['config']['BLOCK_K']}/{r['config']['num_warps']}"
                f"{' prefetch' * r['config']['PREFETCH']}{' xc' * r['config'].get('X_CONTIG', False)} "
                f"{r['us']:.1f} us {r['gbs']:.0f} GB/s" for r in rows[:6]),
                flush=True)
            del copies
    finally:
        gemv.FIXED_BLOCKS, gemv.GEMV_FIXED, gemv_int4.INT4_FIXED = fixed


def main():
    if sys.argv[1:2] == ["--sweep"]:  # --sweep KIND[,KIND...] [PINS.json]
        rows, pins = [], []
        for kind in sys.argv[2].split(","):
            sweep(kind, rows, pins)
        if len(sys.argv) > 3:
            json.dump(pins, open(sys.argv[3], "w"))
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sweep": rows},
                      open(sys.argv[3].removesuffix(".json") + "-sweep.json", "w"), indent=1)
        return
    if sys.argv[1:2] == ["--step"]:
        steps, att, plans = [], [], []
        probe_step(steps)
        for ctx in (128, 256, 384):  # the standard case's contexts (128-token prompt, 256 new tokens)
            probe_attention(32, 1, 384, ctx, att)
        sweep_attention(32, 1, 384, 256, plans)  # min chunk 512: one split, one kernel (no merge)
        if len(sys.argv) > 2:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "step": steps,
                       "attention": att, "attention_plans": plans}, open(sys.argv[2], "w"), indent=1)
        return
    lin, att = [], []
    for name, (n, k) in SHAPES.items():
        probe_linear(name, n, k, lin)
        torch.cuda.empty_cache()
    by_name = {r["shape"]: r for r in lin}
    for prefix in ("", "l3 "):  # the MLP's two GEMVs: SwiGLU folded into down (now) or after gate_up (alt)
        gu, dn = by_name[prefix + "gate_up"], by_name[prefix + "down"]
        print(f"{prefix}MLP, SwiGLU before down vs after gate_up: " + " | ".join(
            f"{kind} {gu[f'{kind}_folded_us'] + dn[f'{kind}_folded_us']:6.1f} vs {gu[f'{kind}_alt_us'] + dn[f'{kind}_alt_us']:6.1f} us"
            for kind in ("triton", "int4", "int8")), flush=True)
    for hkv, rep, s_max, ctx in [(32, 1, 384, 256), (32, 1, 2048, 300), (8, 4, 384, 256), (8, 4, 16640, 16512),
                                 (8, 4, 16640, 8000)]:
        probe_attention(hkv, rep, s_max, ctx, att)
    plans = []
    for hkv, rep, s_max, ctx in [(32, 1, 384, 256), (8, 4, 384, 256), (8, 4, 16640, 16512)]:
        sweep_attention(hkv, rep, s_max, ctx, plans)
    if len(sys.argv) > 1:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "linear": lin, "attention": att,
                   "attention_plans": plans},
                  open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
