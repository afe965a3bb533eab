"""The batch-1 matrix-vector product of 4-bit weights (and 5/6-bit ones with a high plane) in Triton.

The same scheme as kernels.gemv's 16-bit/int8 kernel (a few whole rows a program, streamed along
K, tuned per shape, the RMSNorm, SwiGLU and residual folded in, launched through gemv._launch),
for llamactl's 4-bit layout, built at load from GPTQ/RTN checkpoints (kernels.int4_layout):
  qweight [N, K // 8] int32   nibble j of word i is the code of input column 8 i + j
  scales  [N, K // G] fp16    zeros [N, K // G] uint8
  w[n, k] = (code - zero) * scale, with the group g = k // G.
Act-order checkpoints have their columns sorted by group at load and x gathered in that order.
What x is multiplied as (float, int8, fp16 or int16 inputs): kernels.arith, as in kernels.gemv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llamactl.kernels.arith import switches
from llamactl.kernels.device import interpreted
from llamactl.kernels.gemv import _block, _launch, _load_input, _program_rows, _store_output, _wait_for_previous_kernel
from llamactl.kernels.half_math import _int4_h16_dot
from llamactl.kernels.high_bits import _high_dot, quad_high
from llamactl.kernels.int4_layout import _whole_groups, dequantize_int4, pack_int4  # noqa: F401 (with the product)
from llamactl.kernels.int8_inputs import _int4_a8_dot
from llamactl.kernels.int16_inputs import _int4_i16_dot


def _int4_configs():
    # chosen from the instruction count of the main loop (sm_90 SASS, compiled here): 4.2-6.1
    # instructions a weight (more rows a program: x's unpacking is shared by more weights, but
    # fewer programs for narrow layers; 64 x 1024 and 64 x 2048 spill ~10 registers since all of
    # an iteration's loads come first); the autotuner picks per shape on the GPU
    # PREFETCH (the next block's weights in registers) only where two blocks fit: 64 rows of 1024
    # columns already take 254 registers a thread
    plain = [(64, 1024, 4), (64, 2048, 8),  # 4.2 a weight: wide layers (qkv, gate_up)
             (32, 1024, 4), (32, 2048, 4), (32, 512, 2), (64, 1024, 8), (64, 512, 4), (16, 1024, 4), (16, 2048, 8),
             (16, 1024, 2), (16, 512, 2), (8, 2048, 4), (8, 1024, 2), (8, 512, 2)]
    prefetch = [(32, 1024, 4), (32, 512, 2), (16, 1024, 4), (16, 1024, 2), (16, 512, 2), (8, 1024, 2)]
    # X_CONTIG for the blocks the autotuner chooses most: fewer sm_90 instructions a weight
    x_contig = [(16, 1024, 2), (16, 1024, 4), (8, 2048, 4), (16, 2048, 8), (8, 1024, 2)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "PREFETCH": pf, "X_CONTIG": xc}, num_warps=w, num_stages=1)
            for configs, pf, xc in [(plain, False, False), (prefetch, True, False), (x_contig, False, True)]
            for bn, bk, w in configs]


def _prune_int4(configs, named_args, **kwargs):
    """Blocks of whole groups (in fp16, H16, which loads x in one piece, the X_CONTIG candidates
    twin plain ones and are left out). 5- and 6-bit codes (HI): the X_CONTIG candidates only, which
    the H200's int4 pins chose for every llama2-7b shape (fewer compiles to tune a new shape)."""
    g = named_args["G"]
    kept = [c for c in configs if c.kwargs["BLOCK_K"] % g == 0 and not (kwargs.get("H16") and c.kwargs["X_CONTIG"])
            and (c.kwargs["X_CONTIG"] or not kwargs.get("HI"))]
    return kept or [
        triton.Config({"BLOCK_N": 8, "BLOCK_K": g}, num_warps=4, num_stages=1)]


@triton.jit
def _nibble_float(p, mask, USE_ASM: tl.constexpr):
    """(p & mask) | 0x4B000000 as int32: one LOP3 on the GPU (lop3 with table 0xEA = a & b | c)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [p, tl.full(p.shape, mask, tl.int32), tl.full(p.shape, 0x4B000000, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return (p & mask) | 0x4B000000


@triton.jit
def _gemv_int4_kernel(x_ptr, q_ptr, h_ptr, s_ptr, z_ptr, nw_ptr, r_ptr, y_ptr, N, K, eps, G: tl.constexpr,
                      NORM: tl.constexpr, GLU: tl.constexpr, RESIDUAL: tl.constexpr, USE_ASM: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr = False,
                      GLU_OUT: tl.constexpr = False, PDL: tl.constexpr = False, X_CONTIG: tl.constexpr = False,
                      A8: tl.constexpr = False, H16: tl.constexpr = False, I16: tl.constexpr = False,
                      HI: tl.constexpr = 0):
    # x: [K] ([2K] with GLU), q: [N, K // 8] int32, s: [N, K // G] fp16, z: [N, K // G] uint8, y: [N];
    # HI = 1 or 2: 5- or 6-bit codes, q their low 4 bits and h: [N, K // 8] uint8 / int16 (given as
    # int32 words) the high ones (kernels.high_bits); HI = 0: 4 bits, h unused.
    # NORM, GLU, RESIDUAL and GLU_OUT fold in the same steps as _gemv_kernel
    # K % G == 0 and BLOCK_K % G == 0 (the launcher picks such blocks); a K tail is masked by word.
    # Codes become floats without int-to-float conversions: nibble j, masked in place, OR-ed into
    # the mantissa of 2^23 and read as a float32, is 2^23 + code * 16^j; subtracting 2^23 is exact,
    # and x[8 i + j] is pre-scaled by 16^-j. Nibbles 5..7 are taken from the word shifted by 12.
    # Each word's 8 products are scaled by its group's scale and zero point in place, so nothing is
    # reduced across threads until the end: about 3 instructions a weight (LOP3, FADD, FFMA).
    # Every load of an iteration (weights, the 8 slices of x, scales, zeros) is issued before its
    # arithmetic, so their latencies overlap; PREFETCH also loads the next iteration's weights
    # (registers for two blocks: an autotune choice for the narrower blocks). PDL: as in _gemv_kernel
    # (the first iteration peeled off).
    # X_CONTIG: x's block is loaded in one contiguous piece and split into its 8 slices (fewer
    # layout conversions through shared memory than 8 strided loads; see _input_slices)
    # A8: x is rounded to int8 per 32 columns and each word's 8 products are summed in integers by
    # two DP4A instructions (see _int4_a8_dot): 1.5-3.2 sm_90 instructions a weight, not 4.1-6.6
    # H16: x scaled by a power of two per 32 columns and multiplied in packed fp16, two weights an
    # instruction (see kernels.half_math); X_CONTIG is implied
    # I16: x in 16-bit fixed point per 32 columns, a word's 8 products summed by 4 DP2A (see
    # kernels.int16_inputs)
    WORDS: tl.constexpr = BLOCK_K // 8
    # words a row; K % G == 0 makes it a multiple of G // 8 (16 for G = 128), which Triton cannot
    # know from K's own divisibility (16): with it, 16-byte weight loads instead of 8-byte ones
    KW = tl.multiple_of(K // 8, G // 8)
    tl.static_assert(HI == 0 or not H16, "packed fp16 arithmetic takes 4-bit codes only")
    rows, row_ok, out = _program_rows(N, BLOCK_N, GLU_OUT)  # [BN]
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * KW  # [BN, 1]
    if HI == 1 and (A8 or I16):  # the integer products take a 5-bit high plane a quad at a time (quad_high)
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * (K * HI // 32)  # [BN, 1] int32 words
    elif HI == 1:
        h_rows = h_ptr.to(tl.pointer_type(tl.uint8)) + rows.to(tl.int64)[:, None] * KW  # [BN, 1] a byte a word
    elif HI == 2:
        h_rows = h_ptr.to(tl.pointer_type(tl.int16)) + rows.to(tl.int64)[:, None] * KW  # [BN, 1] a half word a word
    else:
        h_rows = q_rows
    g_rows = rows.to(tl.int64)[:, None] * (K // G)  # [BN, 1]
    words = tl.arange(0, WORDS)  # [W]
    quads = tl.arange(0, WORDS // 4)  # [W/4]
    ss = tl.zeros([WORDS], dtype=tl.float32)  # NORM: sum of x^2
    acc = tl.zeros([BLOCK_N, WORDS // 4], dtype=tl.float32)
    k_start = 0
    if PREFETCH:
        p_next = _block(q_rows, words, row_ok, KW)  # [BN, W] int32
        _wait_for_previous_kernel(PDL, USE_ASM)
    elif PDL:
        p_first = _block(q_rows, words, row_ok, KW)  # [BN, W] int32
        _wait_for_previous_kernel(PDL, USE_ASM)
        acc, ss = _int4_step(p_first, 0, acc, ss, x_ptr, h_rows, s_ptr, z_ptr, g_rows, row_ok, K, KW, nw_ptr, words,
                             quads, G, NORM, GLU, USE_ASM, X_CONTIG, BLOCK_N, WORDS, A8, H16, I16, HI)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        word = k0 // 8 + words  # [W] word index along K
        if PREFETCH:
            p = p_next
            p_next = _block(q_rows, word + WORDS, row_ok, KW)
        else:
            p = _block(q_rows, word, row_ok, KW)  # [BN, W] int32
        acc, ss = _int4_step(p, k0, acc, ss, x_ptr, h_rows, s_ptr, z_ptr, g_rows, row_ok, K, KW, nw_ptr, words, quads,
                             G, NORM, GLU, USE_ASM, X_CONTIG, BLOCK_N, WORDS, A8, H16, I16, HI)
    y = tl.sum(acc, axis=1)  # [BN]
    if NORM:
        y = y * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    _store_output(y, out, row_ok, r_ptr, y_ptr, N, RESIDUAL, GLU_OUT, BLOCK_N)


@triton.jit
def _int4_step(p, k0, acc, ss, x_ptr, h_rows, s_ptr, z_ptr, g_rows, row_ok, K, KW, nw_ptr, words, quads,
               G: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, USE_ASM: tl.constexpr, X_CONTIG: tl.constexpr,
               BLOCK_N: tl.constexpr, WORDS: tl.constexpr, A8: tl.constexpr = False, H16: tl.constexpr = False,
               I16: tl.constexpr = False, HI: tl.constexpr = 0):
    """One block of _gemv_int4_kernel: the words p: [BN, W] at columns k0 .. k0 + 8 W, with their
    groups' scales and zeros, their high bits (HI > 0: from h_rows) and x's slices, into acc:
    [BN, W/4]; ss: [W] sums x^2 for NORM. Returns (acc, ss)."""
    word = k0 // 8 + words  # [W] word index along K
    w_ok = word < KW
    h, h0, h1, h2, h3 = p, p, p, p, p  # HI = 0: unused
    if HI > 0:
        if HI == 1 and (A8 or I16):
            h0, h1, h2, h3 = quad_high(h_rows, k0, quads, row_ok, K)  # [BN, W/4] each
        else:
            h = _block(h_rows, word, row_ok, KW).to(tl.int32)  # [BN, W] each word's high bits
    group = k0 // G + quads // (G // 32)  # [W/4] each quad's group (4 consecutive words share one)
    g_ok = row_ok[:, None] & (group < K // G)[None, :]
    s = tl.load(s_ptr + g_rows + group[None, :], mask=g_ok, other=0.0).to(tl.float32)  # [BN, W/4]
    z = tl.load(z_ptr + g_rows + group[None, :], mask=g_ok, other=0).to(tl.float32)
    if H16:
        k = k0 + tl.arange(0, 8 * WORDS)
        xk, rk = _load_input(x_ptr, k, k < K, K, nw_ptr, NORM, GLU)  # [8W]
        if NORM:
            ss += tl.sum(tl.reshape(rk * rk, [WORDS, 8]), axis=1)
        dot, xsum = _int4_h16_dot(p, xk, USE_ASM, BLOCK_N, WORDS)  # [BN, W/4], [W/4]
        return acc + s * (dot - (z - 8.0) * xsum[None, :]), ss
    if X_CONTIG:
        x0, x1, x2, x3, x4, x5, x6, x7, sq = _input_slices(x_ptr, k0, K, nw_ptr, NORM, GLU, WORDS)
    else:
        x0, r0 = _load_input(x_ptr, word * 8 + 0, w_ok, K, nw_ptr, NORM, GLU)  # [W] each: x[8 w + j]
        x1, r1 = _load_input(x_ptr, word * 8 + 1, w_ok, K, nw_ptr, NORM, GLU)
        x2, r2 = _load_input(x_ptr, word * 8 + 2, w_ok, K, nw_ptr, NORM, GLU)
        x3, r3 = _load_input(x_ptr, word * 8 + 3, w_ok, K, nw_ptr, NORM, GLU)
        x4, r4 = _load_input(x_ptr, word * 8 + 4, w_ok, K, nw_ptr, NORM, GLU)
        x5, r5 = _load_input(x_ptr, word * 8 + 5, w_ok, K, nw_ptr, NORM, GLU)
        x6, r6 = _load_input(x_ptr, word * 8 + 6, w_ok, K, nw_ptr, NORM, GLU)
        x7, r7 = _load_input(x_ptr, word * 8 + 7, w_ok, K, nw_ptr, NORM, GLU)
        sq = r0 * r0 + r1 * r1 + r2 * r2 + r3 * r3 + r4 * r4 + r5 * r5 + r6 * r6 + r7 * r7  # [W]
    if NORM:
        ss += sq
    if A8:
        part = _int4_a8_dot(p, x0, x1, x2, x3, x4, x5, x6, x7, z, USE_ASM, BLOCK_N, WORDS, h, h0, h1, h2, h3,
                            HI)  # [BN, W/4]
    elif I16:
        part = _int4_i16_dot(p, x0, x1, x2, x3, x4, x5, x6, x7, z, USE_ASM, BLOCK_N, WORDS, h, h0, h1, h2, h3,
                             HI)
    else:
        part = _int4_float_dot(p, x0, x1, x2, x3, x4, x5, x6, x7, z, USE_ASM, BLOCK_N, WORDS, h, HI)
    return acc + s * part, ss


@triton.jit
def _int4_float_dot(p, x0, x1, x2, x3, x4, x5, x6, x7, z, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                    WORDS: tl.constexpr, h=None, HI: tl.constexpr = 0):
    """sum over each quad's 32 columns of (code - z) x, as [BN, W/4] floats (see _gemv_int4_kernel):
    words p: [BN, W], x_j: [W] the slices x[8 w + j], z: [BN, W/4] the quads' zero points; h: [BN, W]
    the words' high bits (HI > 0)."""
    xsum = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7  # [W] sum_j x[8w + j]
    p_hi = p >> 12
    part = _nibble_dot(p, 0, x0, USE_ASM)  # [BN, W] sum_j code[8w + j] x[8w + j]
    part += _nibble_dot(p, 1, x1, USE_ASM)
    part += _nibble_dot(p, 2, x2, USE_ASM)
    part += _nibble_dot(p, 3, x3, USE_ASM)
    part += _nibble_dot(p, 4, x4, USE_ASM)
    part += _nibble_dot(p_hi, 2, x5, USE_ASM)
    part += _nibble_dot(p_hi, 3, x6, USE_ASM)
    part += _nibble_dot(p_hi, 4, x7, USE_ASM)
    if HI > 0:
        part += _high_dot(h, x0, x1, x2, x3, x4, x5, x6, x7, HI)
    # 4 consecutive words (one 16-byte load, one thread) share a group: sum them, then scale
    part = tl.sum(tl.reshape(part, [BLOCK_N, WORDS // 4, 4]), axis=2)  # [BN, W/4]
    xsum = tl.sum(tl.reshape(xsum, [WORDS // 4, 4]), axis=1)  # [W/4]
    return part - z * xsum[None, :]


@triton.jit
def _input_slices(x_ptr, k0, K, nw_ptr, NORM: tl.constexpr, GLU: tl.constexpr, WORDS: tl.constexpr):
    """x'[8 w + j] for the block's words w, as 8 vectors [W] (j = 0..7), and sum_j x[8 w + j]^2
    [W], from one contiguous load of the block's 8 W inputs (16-byte loads) split in registers."""
    k = k0 + tl.arange(0, 8 * WORDS)
    xk, rk = _load_input(x_ptr, k, k < K, K, nw_ptr, NORM, GLU)  # [8W]
    even, odd = tl.split(tl.reshape(xk, [WORDS, 4, 2]))  # [W, 4] each: j = 0, 2, 4, 6 / 1, 3, 5, 7
    x04, x26 = tl.split(tl.reshape(even, [WORDS, 2, 2]))  # [W, 2]: j = 0, 4 / 2, 6
    x15, x37 = tl.split(tl.reshape(odd, [WORDS, 2, 2]))
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    return x0, x1, x2, x3, x4, x5, x6, x7, tl.sum(tl.reshape(rk * rk, [WORDS, 8]), axis=1)


@triton.jit
def _nibble_dot(p, j: tl.constexpr, xj, USE_ASM: tl.constexpr):
    """code_j(p) * x_j as [BN, W] floats, for nibble j (0..4) of words p: [BN, W] and x_j: [W]."""
    bits = _nibble_float(p, 0xF << (4 * j), USE_ASM)
    return (bits.to(tl.float32, bitcast=True) - 8388608.0) * (xj * (1.0 / (1 << (4 * j))))[None, :]


_gemv_int4_tuned = triton.autotune(configs=_int4_configs(),
                                   key=["N", "K", "G", "NORM", "GLU", "RESIDUAL", "USE_ASM", "GLU_OUT", "PDL", "A8",
                                        "H16", "I16", "HI"],
                                   prune_configs_by={"early_config_prune": _prune_int4},
                                   cache_results=True)(_gemv_int4_kernel)


INT4_FIXED = {"BLOCK_N": 64, "PREFETCH": False}  # the fixed config (BLOCK_K: two groups unless set; gemv.FIXED_BLOCKS)


def run_gemv_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                  glu: bool = False, glu_out: bool = False, inputs: str = "float", pdl: bool = False, pins: str = "",
                  fixed: bool = False, high: torch.Tensor | None = None, high_bits: int = 0) -> torch.Tensor:
    """`gemv_int4` as a plain function; fixed: one fixed config, no autotuning (the self-check)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    _whole_groups(k, group_size)
    if high_bits not in (0, 1, 2) or (high_bits and (high is None or high.shape != (n, k * high_bits // 32)
                                                     or inputs == "fp16")):
        raise ValueError(f"high planes of 1 or 2 bits a column, [{n}, {k} x bits / 32] int32, and inputs other than "
                         f"fp16, not {high_bits} bits, {None if high is None else tuple(high.shape)}, {inputs}")
    arith = switches(inputs)
    y = torch.empty(n // 2 if glu_out else n, dtype=x.dtype, device=x.device)
    key = (n, k, group_size, norm_weight is not None, glu, residual is not None, glu_out, pdl, inputs,
           str(x.dtype).removeprefix("torch.")) + ((f"hi{high_bits}",) if high_bits else ())
    _launch(_gemv_int4_tuned, _gemv_int4_kernel,
            (x, qweight, qweight if high is None else high, scales, zeros, x if norm_weight is None else norm_weight,
             x if residual is None else residual, y, n, k, eps, group_size, norm_weight is not None, glu,
             residual is not None, not interpreted()),
            {"BLOCK_K": 2 * group_size, **INT4_FIXED}, y.numel(), glu_out, pdl, pins, fixed, key, "int4",
            HI=high_bits, **arith)
    return y


@torch.library.custom_op("llamactl::gemv_int4", mutates_args=())
def gemv_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
              glu: bool = False, glu_out: bool = False, inputs: str = "float", pdl: bool = False,
              pins: str = "", high: torch.Tensor | None = None, high_bits: int = 0) -> torch.Tensor:
    """x: [K] ([2K] with glu) -> y: [N] ([N // 2] with glu_out) in x's dtype, for the 4-bit layout of
    this module's docstring, with the RMSNorm, SwiGLU and residual folded in as in `gemv`; inputs,
    pdl and pins as in `gemv`. high, high_bits (1 or 2): 5- or 6-bit codes, qweight their low 4
    bits and high: [N, K * high_bits / 32] int32 the high plane (kernels.high_bits; not with fp16
    inputs)."""
    return run_gemv_int4(x, qweight, scales, zeros, group_size, norm_weight, eps, residual, glu, glu_out, inputs,
                         pdl, pins, high=high, high_bits=high_bits)


@gemv_int4.register_fake
def _(x, qweight, scales, zeros, group_size, norm_weight=None, eps=1e-6, residual=None, glu=False, glu_out=False,
      inputs="float", pdl=False, pins="", high=None, high_bits=0):
    return x.new_empty(qweight.shape[0] // 2 if glu_out else qweight.shape[0])
