"""Time the multi-row products against what runs today, per llama2-7b layer shape and batch (GPU).

Usage: python scripts/multirow_probe.py OUT.json. For each shape (N, K) and rows M: cuBLAS (bf16),
llamactl's multirow kernel for bf16, int8 and int4 g128, M batch-1 GEMVs (int8, int4; what
B > 1 ran before), in microseconds of device time (calls in a CUDA graph). It decides which
product each layer kind takes at which batch (docs/bench/README.md).
"""

import json
import sys

import torch
import torch.nn.functional as F

from llamactl.kernels import multirow
from llamactl.kernels.gemv import gemv
from llamactl.kernels.gemv_int4 import gemv_int4, pack_int4

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
ROWS = [2, 4, 8, 16, 32, 64]


def timed(fn, n=20):
    """Device time of one call, in us: n calls captured in a CUDA graph (as a decode step runs
    them: host launch cost out), the graph replayed 10 times."""
    for _ in range(3):  # autotuning, compilation
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000 / (10 * n)


def main(out):
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w8 = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
        s8 = torch.rand(n, device="cuda", dtype=torch.bfloat16) * 0.01
        q = pack_int4(torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32))
        s4 = torch.rand(n, k // 128, device="cuda", dtype=torch.float16) * 0.01
        z4 = torch.full((n, k // 128), 8, device="cuda", dtype=torch.uint8)
        from llamactl.kernels.int4_layout import dequantize_int4

        x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
        for got, ref in ((multirow.multirow_mm(x, w), x.double() @ w.double().t()),
                         (multirow.multirow_mm(x, w8, s8), (x.double() @ w8.double().t()) * s8.double()),
                         (multirow.multirow_int4(x, q, s4, z4, 128),
                          x.double() @ dequantize_int4(q, s4, z4, 128, torch.float32).double().t())):
            err = ((got.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, err)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = {"layer": name, "N": n, "K": k, "M": m,
                 "cublas_bf16": timed(lambda: F.linear(x, w)),
                 "multirow_bf16": timed(lambda: multirow.multirow_mm(x, w)),
                 "multirow_int8": timed(lambda: multirow.multirow_mm(x, w8, s8)),
                 "multirow_int4": timed(lambda: multirow.multirow_int4(x, q, s4, z4, 128))}
            if m <= 8:
                r["gemv_rows_int8"] = timed(lambda: [gemv(x[i], w8, s8) for i in range(m)], 4)
                r["gemv_rows_int4"] = timed(lambda: [gemv_int4(x[i], q, s4, z4, 128) for i in range(m)], 4)
            rows.append(r)
            print(json.dumps({k_: (round(v, 1) if isinstance(v, float) else v) for k_, v in r.items()}), flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
