"""The serving engine with no HTTP (issue 21), llama2-7b shape (random bf16 weights):
- steps: one request at a time (then 8 together), the engine's decode seconds a step
  (`EngineTimes`) with the step launched ahead (overlap) and one at a time, against the same
  graph replayed back to back (decoder.step in a loop, no host read);
- burst: 32 requests of 128 tokens submitted SPACING ms apart (0: at once), each one's time to
  its first token from its submit, and the engine's prefill forwards;
- prefill: the kernels of one forward of 32 prompts of 128 tokens (prefill_slots), by name.

Usage: python scripts/engine_probe.py OUT.json [--max-seq 640] [--spacing 0,1] [--parts steps,burst,prefill]
       [--rope-tokens N,...]   (prefill: once per value of model.ROPE_KERNEL_TOKENS, same process)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from llamactl.bench.targets import load_targets
from llamactl.serve.engine import Engine, Params


def run(model, overlap: bool, rows: int, max_seq: int) -> dict:
    eng = Engine(model, set(), max_batch=32, max_queue=64, max_seq=max_seq, overlap=overlap)
    eng.warm_up()
    eng.start()
    prompt = list(range(100, 228))
    reqs = [eng.submit(prompt, Params(max_tokens=256, temperature=0, ignore_eos=True), lambda ev: None)
            for _ in range(rows)]
    while not all(r.finished for r in reqs):
        time.sleep(0.01)
    t = eng.times
    eng.stop()
    # the same bucket's graph replayed back to back, no host read
    b = next(b for b in eng.scheduler.buckets if b >= rows)
    tok = torch.zeros(b, dtype=torch.long, device="cuda")
    pos = torch.full((b,), 300, dtype=torch.long, device="cuda")
    eng.runner.rows.greedy = True
    for _ in range(3):
        eng.decoder.step(tok, pos)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        eng.decoder.step(tok, pos)
    torch.cuda.synchronize()
    replay = (time.perf_counter() - t0) / 100
    return {"overlap": overlap, "rows": rows, "max_seq": max_seq, "engine_step_ms": 1e3 * t.decode_s / t.decode_steps,
            "steps": t.decode_steps, "replay_ms": 1e3 * replay}


def burst(model, n: int, spacing_ms: float, max_seq: int) -> dict:
    eng = Engine(model, set(), max_batch=32, max_queue=64, max_seq=max_seq)
    eng.warm_up()
    eng.start()
    reqs = []
    for i in range(n):
        prompt = [1 + (7 * i + j) % (model.args.vocab_size - 1) for j in range(128)]
        box = {}

        def on_event(ev, box=box):
            if ev.kind == "token" and "t" not in box:
                box["t"] = ev.time
        reqs.append((eng.submit(prompt, Params(max_tokens=8, temperature=0, ignore_eos=True), on_event), box))
        if spacing_ms:
            time.sleep(spacing_ms / 1e3)
    while not all(r.finished for r, _ in reqs):
        time.sleep(0.005)
    t = eng.times
    eng.stop()
    ttft = sorted(1e3 * (box["t"] - r.arrived) for r, box in reqs)
    return {"requests": n, "spacing_ms": spacing_ms, "ttft_ms": [round(x, 1) for x in ttft],
            "ttft_p50_ms": round(statistics.median(ttft), 1), "ttft_max_ms": round(ttft[-1], 1),
            "prefill_forwards": t.prefill_forwards, "prefill_s": round(t.prefill_s, 4),
            "prefill_max_s": round(t.prefill_max_s, 4), "prefill_tokens": t.prefill_tokens}


def prefill_kernels(model, rows: int, max_seq: int) -> dict:
    eng = Engine(model, set(), max_batch=32, max_queue=64, max_seq=max_seq)
    ids = torch.randint(1, model.args.vocab_size, (rows, 128), device="cuda")
    slots, lens = list(range(rows)), [128] * rows
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.decoder.prefill_slots(ids, slots, lens)  # this shape's first forward
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(2):
        eng.decoder.prefill_slots(ids, slots, lens)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        eng.decoder.prefill_slots(ids, slots, lens)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.decoder.prefill_slots(ids, slots, lens)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            kernels[ev.name[:90]][0] += ev.device_time
            kernels[ev.name[:90]][1] += 1
    table = sorted(({"kernel": k, "us": round(v[0], 1), "calls": v[1]} for k, v in kernels.items()), key=lambda r: -r["us"])
    flops = 2 * rows * 128 * sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    return {"rows": rows, "tokens": rows * 128, "first_ms": round(1e3 * first, 2), "wall_ms": round(1e3 * wall, 2),
            "kernels_ms": round(sum(r["us"] for r in table) / 1e3, 2), "tflops": round(flops / wall / 1e12, 1),
            "kernels": table[:25]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-seq", type=int, default=640)
    ap.add_argument("--spacing", default="0,1")
    ap.add_argument("--parts", default="steps,burst,prefill")
    ap.add_argument("--rope-tokens", default="", help="model.ROPE_KERNEL_TOKENS values to run the prefill part at")
    a = ap.parse_args()
    model = load_targets([], "llama2-7b", torch.device("cuda"), "bfloat16")[0].model
    parts = a.parts.split(",")
    out: dict = {"gpu": torch.cuda.get_device_name(), "runs": [], "bursts": [], "prefill": []}
    for overlap in (True, False) if "steps" in parts else ():
        for rows in (1, 8):
            out["runs"].append(run(model, overlap, rows, a.max_seq))
            print(out["runs"][-1], flush=True)
    for spacing in (float(x) for x in a.spacing.split(",")) if "burst" in parts else ():
        out["bursts"].append(burst(model, 32, spacing, a.max_seq))
        print({k: v for k, v in out["bursts"][-1].items() if k != "ttft_ms"}, flush=True)
    from llamactl.runtime import model as model_mod

    for rope_tokens in [int(x) for x in a.rope_tokens.split(",") if x] or [model_mod.ROPE_KERNEL_TOKENS]:
        model_mod.ROPE_KERNEL_TOKENS = rope_tokens
        for rows in (1, 8, 32) if "prefill" in parts else ():
            p = {"rope_kernel_tokens": rope_tokens, **prefill_kernels(model, rows, a.max_seq)}
            out["prefill"].append(p)
            print(f"prefill {rows} x 128 (rope kernel from {rope_tokens}): {p['wall_ms']} ms wall (first "
                  f"{p['first_ms']}), kernels {p['kernels_ms']} ms, {p['tflops']} TFLOP/s", flush=True)
            for k in p["kernels"][:12]:
                print(f"  {k['us']:9.1f} us {k['calls']:4d}x  {k['kernel']}", flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
