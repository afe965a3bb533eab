"""The serving engine's step interval with no HTTP (issue 21): one request at a time (then 8
together) on the llama2-7b shape (random bf16 weights), the engine's decode seconds a step
(`EngineTimes`) with the step launched ahead (overlap) and one at a time, against the same
graph replayed back to back (decoder.step in a loop, no host read).

Usage: python scripts/engine_probe.py OUT.json [--max-seq 640]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from llamactl.bench_targets import load_targets
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
    b = next(b for b in eng.buckets if b >= rows)
    tok = torch.zeros(b, dtype=torch.long, device="cuda")
    pos = torch.full((b,), 300, dtype=torch.long, device="cuda")
    eng.rows.greedy = True
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-seq", type=int, default=640)
    a = ap.parse_args()
    model = load_targets([], "llama2-7b", torch.device("cuda"), "bfloat16")[0].model
    out = []
    for overlap in (True, False):
        for rows in (1, 8):
            r = run(model, overlap, rows, a.max_seq)
            out.append(r)
            print(r, flush=True)
    with open(a.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
