"""The lent GPU's copy bandwidth (bytes/s) and bf16 GEMM rate (FLOP/s), as JSON on stdout: the
ceilings a serving workload's bound is computed from (scripts/gpu_paged.sh)."""

import json

import torch


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / reps


def rates() -> dict:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy = 2 * a.numel() / timed(lambda: b.copy_(a), 20)  # read + write
    del a, b
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm = 2 * 8192**3 / timed(lambda: x @ x, 20)
    return {"gpu": torch.cuda.get_device_name(), "copy_bytes_s": copy, "bf16_flop_s": gemm}


if __name__ == "__main__":
    print(json.dumps(rates()))
