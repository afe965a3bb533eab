"""Where the server's time goes on the GPU, outside the server (llama2-7b shape, bf16, a 32-slot
cache): each prefill shape's first forward against its second (Decoder.prefill / prefill_slots,
as the engine runs them; one new shape profiled), then decode steps at 1, 8 and 32 rows with one
shared position against a position per row, each step read back as the engine reads it.

Usage: python scripts/serve_probe.py OUT.txt
"""

import sys
import time

import torch

from llamactl.runtime.step import Decoder
from llamactl.runtime.sampling import RowSampling
from llamactl.runtime.synthetic import build_synthetic


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main(out: str) -> None:
    dev = torch.device("cuda")
    model = build_synthetic("llama2-7b", dev, torch.bfloat16)
    rows = RowSampling.make([{}] * 32, dev)
    dec = Decoder(model, 32, 640, "graphs", rows=rows)
    lines = []
    shapes = [(1, 128), (1, 192), (8, 192), (32, 128), (1, 128)]
    for b, s in shapes:
        ids = torch.randint(0, 32000, (b, s), device=dev)
        if b == 1:
            def run():
                return dec.prefill(ids, slot=0, start=0, valid=s - 3)
        else:
            def run():
                return dec.prefill_slots(ids, list(range(b)), [s - 3] * b)
        first = timed(run)
        if (b, s) == (8, 192):
            from torch.profiler import ProfilerActivity, profile

            ids = torch.randint(0, 32000, (8, 256), device=dev)  # a shape not seen yet, profiled
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                timed(lambda: dec.prefill_slots(ids, list(range(8)), [250] * 8))
            lines.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        second = timed(run)
        lines.append(f"prefill rows {b} len {s}: first {first * 1000:.1f} ms, again {second * 1000:.1f} ms")
        print(lines[-1], flush=True)
    for b in (1, 8, 32):
        tok = torch.zeros(b, dtype=torch.long, device=dev)
        for kind in ("shared", "rows"):
            pos = 200 if kind == "shared" else torch.full((b,), 200, device=dev) + torch.arange(b, device=dev)
            for _ in range(3):  # capture
                dec.step(tok, pos)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(100):
                dec.step(tok, pos).tolist()
            lines.append(f"decode rows {b} {kind} positions: {(time.perf_counter() - t) * 10:.3f} ms a step")
            print(lines[-1], flush=True)
    open(out, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
