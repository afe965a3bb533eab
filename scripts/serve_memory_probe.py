"""Where a GPU server's memory goes (issue 49: a llama3-8b server ran an H100 out of memory in a
mixed forward): the synthetic model served with a small fixed pool, its device memory after
loading, after the engine, after each part of the warm-up, then the peak of an eager packed
forward of 8,192 prompt tokens carrying 0, 64, 128 and 256 decode rows, and the largest live
tensors at the end. Usage: python scripts/serve_memory_probe.py OUT.json [--shape llama3-8b]"""

import argparse
import json

import torch

from llamactl.bench.targets import load_targets
from llamactl.options import RuntimeOptions
from llamactl.serve.engine import Engine, KvOptions

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama3-8b")
    args = ap.parse_args()
    rows: list = []

    def note(what: str) -> None:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        row = {"what": what, "allocated_gib": torch.cuda.memory_allocated() / GIB,
               "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
               "reserved_gib": torch.cuda.memory_reserved() / GIB, "used_gib": (total - free) / GIB}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        torch.cuda.reset_peak_memory_stats()

    model = load_targets([], args.shape, torch.device("cuda"), "bfloat16")[0].model
    note("model loaded")
    eng = Engine(model, set(), 256, 64, 4096, None, RuntimeOptions(), kv=KvOptions(memory_gib=2))
    note("engine built (2 GiB pool)")
    run, sched = eng.runner, eng.scheduler
    with torch.inference_mode():
        for greedy in (True, False):
            run.rows.greedy = greedy
            for b in sched.buckets:
                run.decoder.step(run._tok[:b], torch.zeros(b, dtype=torch.long, device=run.device), 64)
            note(f"decode graphs captured ({'greedy' if greedy else 'sampled'})")
        run.decoder.prefill_graphs.capture_all()
        note("prefill graphs captured")
        for d in (0, 64, 128, 256):
            mixed = (run._tok[:d], list(range(d)), [16] * d) if d else None
            run.decoder.prefill_packed([[0] * 1024] * 8, [0] * 8, [0] * 8, mixed)
            note(f"packed forward of 8192 prompt tokens and {d} decode rows")
    live = sorted(((s["total_size"], s["segment_type"], s.get("segment_pool_id")) for s in torch.cuda.memory_snapshot()),
                  reverse=True)[:12]
    rows.append({"largest_segments": [(n / GIB, t, str(p)) for n, t, p in live]})
    print(rows[-1])
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
