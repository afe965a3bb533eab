"""Which int4 product a decode batch of 1-64 rows should take: llama2-7b layer shapes on the GPU.

Usage: python scripts/int4_batch_probe.py OUT.json [--check] [--rows 8,16,32] [--swap] [--layers qkv,o].
For each shape (N, K) and rows M,
device time in us (calls in a CUDA graph) of:
  cublas_bf16     the 16-bit product (the bandwidth reference: 2 bytes a weight)
  multirow        what llamactl's multirow_int4 runs at the probed commit (before 2026-12-03: 8 nibble
                  planes, K=16 dots, one group a block; since: the split-K kernel, as splitk_*; in
                  commit 212ad57 alone, scale and zero point applied per block: slower)
  splitk_planes   the plane decode split over K (SPLIT programs a column block, float32 atomics):
                  kernels.multirow.splitk_int4 (written here first, 6438a5c, then moved there)
  splitk_unpack   the same with nibbles unpacked to contiguous columns in registers, one 128-column
                  dot a block (the torchao / gpt-fast Triton int4 layout of the loop)
  splitk_swap     the plane decode with the operands swapped (weights first, as tinygemm; --swap
                  times it against cuBLAS and tinygemm alone)
  tinygemm        torch's _weight_int4pack_mm (its own packed layout, bf16 scales and zeros)
  dequant_cublas  dequantize to bf16 (Triton) + cuBLAS (what llamactl runs above 16 rows)
--check runs the split-K decodes and the swapped kernel against float64 (under TRITON_INTERPRET=1).
"""

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from multirow_probe import timed  # scripts/ is this script's import path

from llamactl.kernels.device import interpreted
from llamactl.kernels.int4_layout import dequantize_int4, pack_int4 as pack
from llamactl.kernels.multirow import multirow_int4, splitk_int4

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
ROWS = [1, 2, 4, 8, 16, 32]
G = 128


def splitk(x, q, s, z, unpack: bool):
    """llamactl's split-K kernel (kernels/multirow.py) with the decode chosen: planes or unpacked."""
    return splitk_int4(x, q, s, z, G, unpack)


@triton.jit
def _splitk_swap(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, G: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr):
    # splitk's plane decode with the operands swapped (as tinygemm arranges them): the weights are
    # the dot's first operand, y^T [BN, BM] += w [BN, 16] x^T [16, BM]
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok, n_ok = rm < M, rn < N
    dt: tl.constexpr = tl.float32 if F32 else tl.bfloat16
    prec: tl.constexpr = "ieee" if F32 else "tf32"
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    groups = K // G
    per = tl.cdiv(groups, SPLIT)
    for g in range(pid_k * per, tl.minimum(groups, (pid_k + 1) * per)):
        for h in tl.static_range(G // 128):
            words = g * (G // 8) + h * 16 + tl.arange(0, 16)  # [16]
            p = tl.load(w_ptr + rn.to(tl.int64)[:, None] * (K // 8) + words[None, :], mask=n_ok[:, None], other=0)
            s = tl.load(s_ptr + rn.to(tl.int64) * groups + g, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rn.to(tl.int64) * groups + g, mask=n_ok, other=0).to(tl.float32)
            for j in tl.static_range(8):
                w = ((((p >> (4 * j)) & 0xF).to(tl.float32) - z[:, None]) * s[:, None]).to(dt)  # [BN, 16]
                xt = tl.load(x_ptr + rm.to(tl.int64)[None, :] * K + (words * 8 + j)[:, None], mask=m_ok[None, :],
                             other=0.0).to(dt)  # [16, BM]
                acc += tl.dot(w, xt, input_precision=prec)  # [BN, BM]
    tl.atomic_add(y_ptr + rm.to(tl.int64)[None, :] * N + rn[:, None], acc, mask=n_ok[:, None] & m_ok[None, :])


_swap_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "SPLIT": sp}, num_warps=4, num_stages=st)
             for bn in (64, 128) for sp in (1, 2, 4) for st in (3, 4)],
    key=["M", "N", "K", "BLOCK_M"], reset_to_zero=["y_ptr"])(_splitk_swap)


def splitk_swap(x, q, s, z):
    m, k = x.shape
    n = q.shape[0]
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    bm = max(16, triton.next_power_of_2(m))
    if interpreted():
        _splitk_swap[(triton.cdiv(n, 32), 2)](x, q, s, z, y, m, n, k, G=G, SPLIT=2, BLOCK_M=bm, BLOCK_N=32, F32=True)
    else:
        _swap_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])](x, q, s, z, y, m, n, k, G=G,
                                                                                   BLOCK_M=bm, F32=False)
    return y.to(x.dtype)


def reference(x, codes, s, z):
    w = (codes.double() - z.double().repeat_interleave(G, 1)) * s.double().repeat_interleave(G, 1)  # [N, K]
    return x.double() @ w.t()


def check():
    torch.manual_seed(0)
    n, k, m = 64, 512, 3
    codes = torch.randint(0, 16, (n, k))
    s, z = torch.rand(n, k // G) * 0.01, torch.randint(0, 16, (n, k // G)).to(torch.uint8)
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = reference(x, codes, s.half().float(), z)
    for unpack in (False, True):
        got = splitk(x.float(), pack(codes), s.half(), z, unpack).double()
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"unpack={unpack}: relative error {err:.2e}")
        assert err < 1e-3
    got = splitk_swap(x.float(), pack(codes), s.half(), z).double()
    err = ((got - ref).norm() / ref.norm()).item()
    print(f"swapped: relative error {err:.2e}")
    assert err < 1e-3


def main(out, rows_probed, swap_only=False, layers=None):
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        if layers and name not in layers:
            continue
        codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
        q = pack(codes)
        s = (torch.rand(n, k // G, device="cuda") * 0.01).half()
        z = torch.randint(0, 16, (n, k // G), device="cuda").to(torch.uint8)
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        tg = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
        # tinygemm: w = (q - 8) scale + zero, so zero = (8 - z) s; [K / G, N, 2] bf16
        sz = torch.stack([s.float().t(), ((8 - z.float()) * s.float()).t()], dim=-1).to(torch.bfloat16).contiguous()
        x = torch.randn(5, k, device="cuda", dtype=torch.bfloat16)
        ref = reference(x, codes, s.float(), z)
        errs = {"splitk_swap": splitk_swap(x, q, s, z)} if swap_only else {
            "splitk_planes": splitk(x, q, s, z, False), "splitk_unpack": splitk(x, q, s, z, True),
            "splitk_swap": splitk_swap(x, q, s, z), "tinygemm": torch.ops.aten._weight_int4pack_mm(x, tg, G, sz),
            "multirow": multirow_int4(x, q, s, z, G)}
        errs = {key: ((v.double() - ref).norm() / ref.norm()).item() for key, v in errs.items()}
        print(name, {key: f"{v:.1e}" for key, v in errs.items()}, flush=True)
        if swap_only:
            for m in rows_probed:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                r = {"layer": name, "M": m, "cublas_bf16": timed(lambda: F.linear(x, w16)),
                     "splitk_swap": timed(lambda: splitk_swap(x, q, s, z)),
                     "tinygemm": timed(lambda: torch.ops.aten._weight_int4pack_mm(x, tg, G, sz))}
                rows.append(r)
                print(json.dumps({k_: (round(v, 1) if isinstance(v, float) else v) for k_, v in r.items()}), flush=True)
            continue
        for m in rows_probed:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = {"layer": name, "N": n, "K": k, "M": m, "errors": errs,
                 "cublas_bf16": timed(lambda: F.linear(x, w16)),
                 "splitk_planes": timed(lambda: splitk(x, q, s, z, False)),
                 "splitk_unpack": timed(lambda: splitk(x, q, s, z, True)),
                 "tinygemm": timed(lambda: torch.ops.aten._weight_int4pack_mm(x, tg, G, sz)),
                 "dequant_cublas": timed(lambda: F.linear(x, dequantize_int4(q, s, z, G, torch.bfloat16)))}
            if m >= 2:
                r["multirow"] = timed(lambda: multirow_int4(x, q, s, z, G))
            rows.append(r)
            print(json.dumps({k_: (round(v, 1) if isinstance(v, float) else v) for k_, v in r.items() if k_ != "errors"}),
                  flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    if "--check" in sys.argv:
        check()
    else:
        rows_arg = sys.argv[sys.argv.index("--rows") + 1] if "--rows" in sys.argv else None
        layers_arg = sys.argv[sys.argv.index("--layers") + 1].split(",") if "--layers" in sys.argv else None
        main(sys.argv[1], [int(r) for r in rows_arg.split(",")] if rows_arg else ROWS, "--swap" in sys.argv, layers_arg)
