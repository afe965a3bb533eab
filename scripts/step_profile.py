"""Where a batched decode step's device time goes (issue 20): the llama2-7b-shape step (random
bf16 weights) in a CUDA graph at each batch, every row at its own position (as the server steps),
profiled with torch.profiler over REPLAYS replays; kernels grouped by name, device us a step, and
the step's wall time from CUDA events beside their sum (the gap: device idle or overlap); in
graphs mode also the step with one position for every row (bench's), timed alike.

Usage: python scripts/step_profile.py OUT.json [--batch 1,8,32] [--ctx 256] [--mode graphs|compile] [--max-seq 320,640]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from llamactl.bench.targets import load_targets
from llamactl.runtime.step import Decoder
from llamactl.options import RuntimeOptions

REPLAYS = 20


def profile_batch(model, batch: int, ctx: int, mode: str, max_seq: int | None = None) -> dict:
    dec = Decoder(model, batch, max_seq or ctx + 64, mode, options=RuntimeOptions())
    tok = torch.randint(0, model.args.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), ctx, dtype=torch.long, device="cuda")
    for _ in range(3):  # capture, warm
        dec.step(tok, pos)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        dec.step(tok, pos)
    end.record()
    torch.cuda.synchronize()
    step_us = start.elapsed_time(end) * 1e3 / REPLAYS
    shared_us = None
    if mode == "graphs":  # the same step with one position for every row (bench's), timed alike
        for _ in range(3):
            dec.step(tok, ctx)
        torch.cuda.synchronize()
        start.record()
        for _ in range(REPLAYS):
            dec.step(tok, ctx)
        end.record()
        torch.cuda.synchronize()
        shared_us = round(start.elapsed_time(end) * 1e3 / REPLAYS, 1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            dec.step(tok, pos)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            k = kernels[ev.name[:90]]
            k[0] += ev.device_time / REPLAYS
            k[1] += 1 / REPLAYS
    table = sorted(({"kernel": n, "us": round(t, 1), "calls": round(c, 1)} for n, (t, c) in kernels.items()),
                   key=lambda r: -r["us"])
    return {"batch": batch, "ctx": ctx, "max_seq": dec.max_seq, "mode": mode, "step_us": round(step_us, 1), "shared_position_step_us": shared_us,
            "kernels_us": round(sum(r["us"] for r in table), 1), "kernels": table}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--mode", default="graphs")
    ap.add_argument("--max-seq", default="", help="cache lengths to profile each batch at (default ctx + 64)")
    a = ap.parse_args()
    model = load_targets([], "llama2-7b", torch.device("cuda"), "bfloat16")[0].model
    runs = []
    for b, max_seq in ((int(x), int(m) if m else None) for x in a.batch.split(",") for m in a.max_seq.split(",")):
        r = profile_batch(model, b, a.ctx, a.mode, max_seq)
        runs.append(r)
        print(f"batch {b} ({a.mode}, cache {r['max_seq']}): step {r['step_us']} us (one position for all rows: "
              f"{r['shared_position_step_us']}), kernels {r['kernels_us']} us")
        for k in r["kernels"][:14]:
            print(f"  {k['us']:9.1f} us  {k['calls']:6.1f}x  {k['kernel']}")
    with open(a.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
