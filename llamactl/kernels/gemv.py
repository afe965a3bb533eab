"""Batch-1 matrix-vector products y = W x in Triton, for 16-bit and int8 weights (4-bit ones:
kernels.gemv_int4, launched through this module's _launch).

A decode step at batch 1 reads every weight once per token, so its speed is the speed of these
products, which cuBLAS and PyTorch's tinygemm run well short of the memory bandwidth (measured
in docs/bench/README.md). These kernels give each program a few whole
rows (BLOCK_N) and stream them along K in BLOCK_K slices with 16-byte loads; many small programs
per multiprocessor keep enough loads in flight to approach memory bandwidth. Block sizes are tuned
per (N, K) shape on first use (triton.autotune), which happens in the warm-up before a CUDA graph
is captured.

The int4 and int8 products multiply in one of four ways (RuntimeOptions.quant_inputs): float32
(x as it is), int8 inputs with DP4A (A8, kernels.int8_inputs: x rounded to 2^-7 of its block's
largest), packed fp16 (H16, kernels.half_math: x exact, sums rounded to fp16 within 16-32 columns)
or 16-bit fixed-point inputs with DP2A (I16, kernels.int16_inputs: x rounded to 2^-15 of its
block's largest, sums exact; a model's default).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llamactl.kernels import pinned
from llamactl.kernels.arith import switches
from llamactl.kernels.device import interpreted, pdl_launch
from llamactl.kernels.gdc import wait_for_previous
from llamactl.kernels.half_math import _int8_h16_dot
from llamactl.kernels.int8_inputs import _int8_a8_dot
from llamactl.kernels.int16_inputs import _int8_i16_dot


def _bf16_configs():
    plain = [(4, 512, 4, 1), (8, 256, 4, 1), (8, 512, 4, 1), (8, 512, 4, 3), (16, 256, 4, 1), (16, 512, 8, 1),
             (4, 1024, 4, 1), (8, 1024, 8, 1), (2, 1024, 4, 1), (2, 2048, 8, 1), (4, 2048, 8, 1), (4, 256, 2, 1),
             (8, 2048, 8, 1), (4, 4096, 8, 1), (16, 2048, 8, 1)]  # the last: int8
    # for int8 (1 byte a weight); 222-231 registers a thread on sm_90, and 16 x 2048 would spill
    prefetch = [(8, 1024, 4, 1), (16, 1024, 8, 1), (8, 2048, 8, 1)]
    # REDUCE_EACH: a third to a half of the registers (int8 16 x 2048: 234 -> 96), so more programs
    # a multiprocessor hide more latency, for ~1 more instruction a weight (sm_90 SASS; 32 rows of
    # 2048 would take 255 registers with the folded norm)
    reduce_each = [(16, 2048, 8, 1), (16, 1024, 4, 1), (8, 2048, 8, 1)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "PREFETCH": pf, "REDUCE_EACH": red}, num_warps=w, num_stages=st)
            for configs, pf, red in [(plain, False, False), (prefetch, True, False), (reduce_each, False, True)]
            for bn, bk, w, st in configs]


@triton.jit
def _load_input(x_ptr, idx, mask, K, nw_ptr, NORM: tl.constexpr, GLU: tl.constexpr):
    """(x'[idx], x[idx]) in float32. NORM: x' = x * nw, the RMSNorm without its scale, which the
    caller applies to the finished dot product (rs * W (x * nw) = W (rmsnorm(x) * nw)), so no pass
    over x has to come before the weights stream in; the unfused model rounds x * rs to x's dtype
    first, a difference below that rounding. GLU: x' = silu(x[:K]) * x[K:] (x: [2K]), rounded to
    x's dtype where the unfused model rounds."""
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    xp = x
    if NORM:
        xp = x * tl.load(nw_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if GLU:
        up = tl.load(x_ptr + K + idx, mask=mask, other=0.0).to(tl.float32)
        xp = _swiglu(x, up, dt).to(tl.float32)
    return xp, x


@triton.jit
def _block(row_ptrs, idx, row_ok, limit):
    """Weights row_ptrs[:, None] + idx[None, :] ([BN, len(idx)]), zero past `limit` and outside the rows."""
    return tl.load(row_ptrs + idx[None, :], mask=row_ok[:, None] & (idx < limit)[None, :], other=0.0)


@triton.jit
def _wait_for_previous_kernel(PDL: tl.constexpr, USE_ASM: tl.constexpr):
    """kernels.gdc.wait_for_previous, after the first weights are loaded and before x or the
    residual is read; no-op under the interpreter (no PTX)."""
    if USE_ASM:
        wait_for_previous(PDL)


@triton.jit
def _swiglu(gate, up, dt: tl.constexpr):
    """silu(gate) * up in dt, from float32 gate/up already rounded to dt: the SiLU rounded to dt
    before the product, as the unfused model computes F.silu(gate) * up in dt."""
    return ((gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up).to(dt)


@triton.jit
def _program_rows(N, BLOCK_N: tl.constexpr, GLU_OUT: tl.constexpr):
    """(rows [BN] of w this program reads, which are real, output index [BN]). With GLU_OUT, w is a
    fused gate/up ([gate; up], N = 2 I rows) and the program takes BN/2 gate rows and the same BN/2
    up rows, so it can finish silu(gate) * up itself: outputs i in [0, I)."""
    lane = tl.arange(0, BLOCK_N)
    if GLU_OUT:
        out = tl.program_id(0) * (BLOCK_N // 2) + lane % (BLOCK_N // 2)
        return out + (lane >= BLOCK_N // 2).to(tl.int32) * (N // 2), out < N // 2, out
    rows = tl.program_id(0) * BLOCK_N + lane
    return rows, rows < N, rows


@triton.jit
def _store_output(y, rows, row_ok, r_ptr, y_ptr, N, RESIDUAL: tl.constexpr, GLU_OUT: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Store the finished products y: [BN] (float32) of rows: y + r (RESIDUAL), or with GLU_OUT
    (rows from _program_rows: BN/2 gate rows, then their up rows) silu(gate) * up at the BN/2
    outputs, rounded where the unfused model rounds (the gate/up output, the SiLU, the product)."""
    dt = y_ptr.dtype.element_ty
    if GLU_OUT:
        gate, up = tl.split(tl.trans(tl.reshape(y.to(dt).to(tl.float32), [2, BLOCK_N // 2])))  # [BN/2] each
        out = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + out, _swiglu(gate, up, dt), mask=out < N // 2)
    else:
        if RESIDUAL:
            y = y.to(dt).to(tl.float32) + tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(dt), mask=row_ok)


@triton.jit
def _int8_float(w, USE_ASM: tl.constexpr):
    """int8 -> float32 without I2F (a quarter-rate instruction): the byte, offset to 0..255 by
    flipping its sign bit, is placed in the mantissa of 2^23, read as a float, and 2^23 + 128
    subtracted (exact). On the GPU one XOR flips the 4 bytes of a 32-bit register at once and one
    PRMT a byte builds its float (bytes: the weight's, 0, 0, 0x4B): 1.25 instructions a weight
    before the subtraction, where extracting the byte and OR-ing in the exponent took 2."""
    if USE_ASM:
        bits = tl.inline_asm_elementwise(
            """{
            .reg .b32 t;
            xor.b32 t, $4, 0x80808080;
            prmt.b32 $0, t, 0x4B000000, 0x7440;
            prmt.b32 $1, t, 0x4B000000, 0x7441;
            prmt.b32 $2, t, 0x4B000000, 0x7442;
            prmt.b32 $3, t, 0x4B000000, 0x7443;
            }""", "=r,=r,=r,=r,r", [w], dtype=tl.int32, is_pure=True, pack=4)
    else:
        bits = (w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _gemv_step(w, x_ptr, k, K, nw_ptr, acc, acc_rows, ss, NORM: tl.constexpr, GLU: tl.constexpr,
               REDUCE_EACH: tl.constexpr, USE_ASM: tl.constexpr, A8: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, H16: tl.constexpr = False, I16: tl.constexpr = False):
    """One block of _gemv_kernel: weights w: [BN, BK] times x'[k] (k: [BK]) into acc: [BN, BK]
    (or acc_rows: [BN] with REDUCE_EACH); ss: [BK] sums x^2 for NORM. Returns (acc, acc_rows, ss).
    A8, H16 and I16: w: [BN, BK/4] int32 words of int8 weights, acc: [BN, BK/16] (see _int8_a8_dot,
    _int8_h16_dot, _int8_i16_dot)."""
    x, x_raw = _load_input(x_ptr, k, k < K, K, nw_ptr, NORM, GLU)  # [BK]
    if NORM:
        ss += x_raw * x_raw
    if A8:
        acc += _int8_a8_dot(w, x, USE_ASM, BLOCK_N, BLOCK_K)
    elif H16:
        acc += _int8_h16_dot(w, x, USE_ASM, BLOCK_N, BLOCK_K)
    elif I16:
        acc += _int8_i16_dot(w, x, USE_ASM, BLOCK_N, BLOCK_K)
    else:
        if w.dtype == tl.int8:
            prod = _int8_float(w, USE_ASM) * x[None, :]
        else:
            prod = w.to(tl.float32) * x[None, :]
        if REDUCE_EACH:  # fewer registers (more programs a multiprocessor), a cross-thread sum an iteration
            acc_rows += tl.sum(prod, axis=1)
        else:
            acc += prod
    return acc, acc_rows, ss


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, nw_ptr, r_ptr, y_ptr, N, K, eps, HAS_SCALE: tl.constexpr,
                 NORM: tl.constexpr, GLU: tl.constexpr, RESIDUAL: tl.constexpr, USE_ASM: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr = False,
                 GLU_OUT: tl.constexpr = False, REDUCE_EACH: tl.constexpr = False, PDL: tl.constexpr = False,
                 A8: tl.constexpr = False, H16: tl.constexpr = False, I16: tl.constexpr = False):
    # y[n] = sum_k w[n, k] x'[k] (* s[n]) (+ r[n]); w: [N, K] row-major, 16-bit or int8 with scales s: [N]
    #   x' = x                                  x: [K]
    #   x' = rmsnorm(x) * nw          (NORM)    the layer's RMSNorm folded in, nw: [K]
    #   x' = silu(x[:K]) * x[K:]      (GLU)     SwiGLU of a fused gate/up output, x: [2K]
    # (see _load_input for where it rounds); one program per BLOCK_N rows; PREFETCH loads the next
    # block of weights while this one is multiplied (registers for two blocks); REDUCE_EACH sums
    # each block's products across threads at once instead of keeping a [BN, BK] accumulator;
    # GLU_OUT: w is a fused gate/up and y: [N // 2] = silu(gate) * up (see _program_rows);
    # PDL: the first block of weights is loaded before waiting for the previous kernel and its
    # iteration is peeled off, so the loop itself is the same as without PDL;
    # A8 (int8 weights, K % 32 == 0): the weights are read as int32 words of 4 and x is rounded to
    # int8 per 32 columns, one DP4A a word (see _int8_a8_dot); H16 (the same layout): x scaled by a
    # power of two per 32 columns and multiplied in packed fp16 (see _int8_h16_dot); I16 (the same
    # layout): x in 16-bit fixed point per 32 columns, two DP2A a word (see _int8_i16_dot)
    WORDS: tl.constexpr = A8 or H16 or I16  # weights read as int32 words of 4
    WK: tl.constexpr = BLOCK_K // 4 if WORDS else BLOCK_K  # weight elements of a row a block
    rows, row_ok, out = _program_rows(N, BLOCK_N, GLU_OUT)  # [BN]
    cols = tl.arange(0, BLOCK_K)  # [BK]
    if WORDS:
        w_cols = tl.arange(0, WK)  # [WK]
        w_len = tl.multiple_of(K // 4, 8)  # words a row
        w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * w_len  # [BN, 1]
    else:
        w_cols = cols
        w_len = K
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K  # [BN, 1]
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)  # NORM: sum of x^2
    if WORDS:
        acc = tl.zeros([BLOCK_N, BLOCK_K // 16], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_rows = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_start = 0
    if PREFETCH:
        w_next = _block(w_rows, w_cols, row_ok, w_len)  # [BN, WK]
        _wait_for_previous_kernel(PDL, USE_ASM)
    elif PDL:
        w_first = _block(w_rows, w_cols, row_ok, w_len)  # [BN, WK]
        _wait_for_previous_kernel(PDL, USE_ASM)
        acc, acc_rows, ss = _gemv_step(w_first, x_ptr, cols, K, nw_ptr, acc, acc_rows, ss, NORM, GLU, REDUCE_EACH,
                                       USE_ASM, A8, BLOCK_N, BLOCK_K, H16, I16)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        k = k0 + cols
        if WORDS:
            wk = k0 // 4 + w_cols  # [WK] the block's words
        else:
            wk = k
        if PREFETCH:
            w = w_next
            w_next = _block(w_rows, wk + WK, row_ok, w_len)
        else:
            w = _block(w_rows, wk, row_ok, w_len)  # [BN, WK]
        acc, acc_rows, ss = _gemv_step(w, x_ptr, k, K, nw_ptr, acc, acc_rows, ss, NORM, GLU, REDUCE_EACH, USE_ASM, A8,
                                       BLOCK_N, BLOCK_K, H16, I16)
    y = acc_rows if REDUCE_EACH and not WORDS else tl.sum(acc, axis=1)  # [BN] (A8/H16/I16 sum into acc only)
    if NORM:
        y = y * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    if HAS_SCALE:
        y = y * tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    _store_output(y, out, row_ok, r_ptr, y_ptr, N, RESIDUAL, GLU_OUT, BLOCK_N)


def _prune_gemv(configs, named_args, **kwargs):
    """With int8 inputs (A8), fp16 arithmetic (H16) or int16 inputs (I16) REDUCE_EACH changes
    nothing (the sums are per 16 columns already): its candidates twin plain ones, and only the
    first of each twin is timed."""
    words = kwargs.get("A8") or kwargs.get("H16") or kwargs.get("I16")
    kept, seen = [], set()
    for c in configs:
        twin = (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["PREFETCH"], c.num_warps, c.num_stages)
        if not words or twin not in seen:
            seen.add(twin)
            kept.append(c)
    return kept


# cache_results: the choice per shape is kept in Triton's cache, so later processes skip the tuning
_gemv_tuned = triton.autotune(configs=_bf16_configs(),
                              key=["N", "K", "HAS_SCALE", "NORM", "GLU", "RESIDUAL", "USE_ASM", "GLU_OUT", "PDL", "A8", "H16",
                                   "I16"],
                              prune_configs_by={"early_config_prune": _prune_gemv},
                              cache_results=True)(_gemv_kernel)


FIXED_BLOCKS = False  # tests: the fixed config on the GPU too (no autotuning), as under the interpreter
GEMV_FIXED = {"BLOCK_N": 64, "BLOCK_K": 64, "PREFETCH": False, "REDUCE_EACH": False}  # the 16-bit/int8 kernel's fixed config


def _launch(tuned, kernel, args: tuple, fixed_config: dict, outputs: int, glu_out: bool, pdl: bool, pins: str,
            fixed: bool, pin_key: tuple, kind: str = "gemv", **flags) -> None:
    """The kernel with its pinned config (kernels.pinned: `pins` names the table, kind ("gemv" or
    "int4") and pin_key the launch), else autotuned, on a GPU; one fixed config under the CPU interpreter and where
    `fixed` (the self-check, which should not pay for tuning). One program per BLOCK_N rows of the
    weight, which with glu_out give BLOCK_N // 2 of the `outputs`. pdl: a programmatic dependent
    launch (a fixed config's own PDL runs the kernel's PDL code without the launch). flags: more
    of the kernel's constexpr switches."""

    def grid(meta):
        return (triton.cdiv(outputs, meta["BLOCK_N"] // 2 if glu_out else meta["BLOCK_N"]),)

    launch = {"GLU_OUT": glu_out, **flags} | pdl_launch(pdl)
    if interpreted() or fixed or FIXED_BLOCKS:
        kernel[grid(fixed_config)](*args, **(launch | fixed_config))
        return
    config = pinned.pick(pins, kind, pin_key, tuned.configs)
    if config is not None:
        kernel[grid(config.kwargs)](*args, **config.all_kwargs(), **launch)
    else:
        tuned[grid](*args, **launch)


def run_gemv(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
             glu: bool = False, glu_out: bool = False, inputs: str = "float", pdl: bool = False, pins: str = "",
             fixed: bool = False) -> torch.Tensor:
    """`gemv` as a plain function; fixed: one fixed config, no autotuning (the self-check)."""
    n, k = w.shape
    arith = switches(inputs)
    if inputs != "float" and (w.dtype != torch.int8 or k % 32):
        raise ValueError(f"{inputs} inputs need int8 weights with whole 32-column blocks, not {w.dtype} [{n}, {k}]")
    y = torch.empty(n // 2 if glu_out else n, dtype=x.dtype, device=x.device)
    key = (n, k, scales is not None, norm_weight is not None, glu, residual is not None, glu_out, pdl, inputs,
           str(x.dtype).removeprefix("torch."))
    _launch(_gemv_tuned, _gemv_kernel,
            (x, w, w if scales is None else scales, x if norm_weight is None else norm_weight,
             x if residual is None else residual, y, n, k, eps, scales is not None, norm_weight is not None, glu,
             residual is not None, not interpreted()), GEMV_FIXED, y.numel(), glu_out, pdl, pins, fixed, key, **arith)
    return y


@torch.library.custom_op("llamactl::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
         eps: float = 1e-6, residual: torch.Tensor | None = None, glu: bool = False,
         glu_out: bool = False, inputs: str = "float", pdl: bool = False, pins: str = "") -> torch.Tensor:
    """w: [N, K] (16-bit, or int8 with scales [N]) times x: [K] ([2K] with glu) -> y: [N] in x's dtype,
    with the RMSNorm of x (norm_weight [K], eps), SwiGLU (glu) and a residual [N] folded in; glu_out:
    w is a fused [gate; up] and y: [N // 2] = silu(gate) * up; inputs (int8 w, K % 32 == 0 for all
    but "float"): what x is multiplied as (kernels.arith); pdl: launch with programmatic dependent
    launch; pins: the id of a kernels.pinned table ("": autotune)."""
    return run_gemv(x, w, scales, norm_weight, eps, residual, glu, glu_out, inputs, pdl, pins)


@gemv.register_fake
def _(x, w, scales=None, norm_weight=None, eps=1e-6, residual=None, glu=False, glu_out=False, inputs="float",
      pdl=False, pins=""):
    return x.new_empty(w.shape[0] // 2 if glu_out else w.shape[0])


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [K], w: [N, K] 16-bit -> y: [N]."""
    return gemv(x, w)


def gemv_int8(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x: [K], w: [N, K] int8, scales: [N] -> y = (w x) * scales: [N] in x's dtype."""
    return gemv(x, w, scales)

