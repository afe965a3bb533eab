"""The GEMVs' 16-bit fixed-point arithmetic (I16, LLAMACTL_QUANT_INPUTS=int16; see kernels.gemv):
each block of 32 inputs is scaled by a power of two, 2^(14 - e) with 2^e <= max |x| < 2^(e + 1),
and rounded to int16 (|v| < 2^15), then multiplied with the int8 or int4 weights in integers by
DP2A (two 16-bit inputs times two bytes, added to an int32), exactly; one float scale, 2^(e - 14),
per block.

What it rounds: a bf16 input has 8 significant bits, so every input within 2^7 of its block's
largest is exact; smaller ones are rounded to a multiple of 2^(e - 14), an error of at most
2^-15 of the block's largest (bf16's own rounding of the largest is 2^-9 of it). The sums are
exact integers (|sum| < 2^27), converted to float32 once per 16 or 32 columns. Packed fp16 (H16)
keeps x exact but rounds its sums to 11 bits; int8 inputs (A8) round x to 2^-7 of the largest.

Instructions: int8 weights, 2 DP2A a word (0.5 a weight, against XOR/PRMT/HSUB2/HFMA2 for two
weights in H16); int4 weights, a word's even and odd nibbles as bytes (LOP3; SHF and LOP3), then
4 DP2A (7 for 8 weights, against 13 in H16).
"""

import triton
import triton.language as tl

from llamactl.kernels.int8_inputs import _code_quads, _int_op, _quad_max, _quad_sum, _quad_words, _repeat, _round


@triton.jit
def _int16_scale(amax):
    """amax: [B] a block's largest |x| -> (2^(e - 14), 2^(14 - e)) as float32 [B] each, with
    2^e <= amax < 2^(e + 1) (e taken as at least -112, so that both are normal floats; a block of
    zeros gets 2^-126 and 2^126, and its products are 0 either way)."""
    e_bits = tl.maximum(amax.to(tl.int32, bitcast=True) & 0x7F800000, 15 << 23)  # e + 127 in the exponent field
    down = (e_bits - (14 << 23)).to(tl.float32, bitcast=True)
    up = (0x7F000000 - e_bits + (14 << 23)).to(tl.float32, bitcast=True)
    return down, up


@triton.jit
def _round16(x, up, USE_ASM: tl.constexpr):
    """x * up rounded to the nearest integer as int32, at most 32767: |x * up| < 2^15, but a float32
    input (an RMSNorm folded in) just under it may round up to 2^15, which int16 cannot hold."""
    return tl.minimum(_round(x, up, USE_ASM), 32767)


@triton.jit
def _pairs(lo, hi):
    """int32 lo, hi (|.| < 2^15) -> one int32 holding them as two int16 (lo in the low half)."""
    return (lo & 0xFFFF) | (hi << 16)


@triton.jit
def _dp2a(a, b, c, HI: tl.constexpr, B_SIGNED: tl.constexpr, USE_ASM: tl.constexpr):
    """c + a.lo * b.byte(2 HI) + a.hi * b.byte(2 HI + 1): a holds two int16, b four bytes (signed
    with B_SIGNED, else unsigned); int32 (PTX dp2a)."""
    if USE_ASM:
        if HI:
            if B_SIGNED:
                return _int_op("dp2a.hi.s32.s32 $0, $1, $2, $3;", a, b, c)
            return _int_op("dp2a.hi.s32.u32 $0, $1, $2, $3;", a, b, c)
        if B_SIGNED:
            return _int_op("dp2a.lo.s32.s32 $0, $1, $2, $3;", a, b, c)
        return _int_op("dp2a.lo.s32.u32 $0, $1, $2, $3;", a, b, c)
    for i in tl.static_range(2):
        bi = (b >> (8 * (2 * HI + i))) & 0xFF
        if B_SIGNED:
            bi = (bi ^ 0x80) - 0x80
        c += bi * ((((a >> (16 * i)) & 0xFFFF) ^ 0x8000) - 0x8000)
    return c


@triton.jit
def _int8_i16_dot(w, x, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over each 16 columns of w x as [BN, BK/16] floats, with x in 16-bit fixed point per 32
    columns (module docstring). w: [BN, BK/4] int32, each 4 consecutive int8 weights (little-endian);
    x: [BK] float32. A thread's 4 words (one 16-byte load) are one chain of 8 DP2A."""
    xb = tl.reshape(x, [BLOCK_K // 32, 32])
    down, up = _int16_scale(tl.max(tl.abs(xb), axis=1))  # [BK/32] each
    v = tl.reshape(_round16(xb, tl.broadcast_to(up[:, None], [BLOCK_K // 32, 32]), USE_ASM),
                   [BLOCK_K // 4, 2, 2])  # [BK/4, 2, 2] int32: column 4 w + 2 i + j
    lo, hi = tl.split(tl.permute(v, (0, 2, 1)))  # [BK/4, 2] each: columns 4 w + j, 4 w + 2 + j
    x0, x1 = tl.split(lo)  # [BK/4]
    x2, x3 = tl.split(hi)
    lo_pair = _pairs(x0, x1)  # [BK/4] (x[4 w], x[4 w + 1])
    hi_pair = _pairs(x2, x3)  # [BK/4] (x[4 w + 2], x[4 w + 3])
    w0, w1, w2, w3 = _quad_words(w, BLOCK_N, BLOCK_K // 4)  # [BN, BK/16] each
    a0, a1, a2, a3 = _quad_words(tl.broadcast_to(lo_pair[None, :], [BLOCK_N, BLOCK_K // 4]), BLOCK_N, BLOCK_K // 4)
    b0, b1, b2, b3 = _quad_words(tl.broadcast_to(hi_pair[None, :], [BLOCK_N, BLOCK_K // 4]), BLOCK_N, BLOCK_K // 4)
    dot = _dp2a(a0, w0, tl.zeros([BLOCK_N, BLOCK_K // 16], tl.int32), False, True, USE_ASM)
    dot = _dp2a(b0, w0, dot, True, True, USE_ASM)
    dot = _dp2a(a1, w1, dot, False, True, USE_ASM)
    dot = _dp2a(b1, w1, dot, True, True, USE_ASM)
    dot = _dp2a(a2, w2, dot, False, True, USE_ASM)
    dot = _dp2a(b2, w2, dot, True, True, USE_ASM)
    dot = _dp2a(a3, w3, dot, False, True, USE_ASM)
    dot = _dp2a(b3, w3, dot, True, True, USE_ASM)  # [BN, BK/16] exact
    scale = _repeat(down, 2, BLOCK_K // 32)  # [BK/16] each 16 columns' block's
    return dot.to(tl.float32) * scale[None, :]


@triton.jit
def _int4_i16_dot(p, x0, x1, x2, x3, x4, x5, x6, x7, z, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                  WORDS: tl.constexpr, h=None, h0=None, h1=None, h2=None, h3=None, HI: tl.constexpr = 0):
    """sum over each quad's 32 columns of (code - z) x, as [BN, W/4] floats, with x in 16-bit fixed
    point per quad (module docstring). Words p: [BN, W], x_j: [W] the slices x[8 w + j], z: [BN, W/4]
    the quads' zero points. A word's even nibbles as bytes (0, 2, 4, 6) take x's pairs (0, 2) and
    (4, 6) in two DP2A, its odd ones (shifted by 4) the pairs (1, 3) and (5, 7); a quad is one chain.
    HI > 0: 5- or 6-bit codes, their high bits added to the bytes (kernels.high_bits): 5 bits from h0..h3,
    [BN, W/4] each quad's words' (quad_high), 6 bits from h, [BN, W] each word's."""
    down, up = _int16_scale(_quad_max(x0, x1, x2, x3, x4, x5, x6, x7, WORDS))  # [W/4] each
    up_w = _repeat(up, 4, WORDS // 4)  # [W] each word's quad's
    v0, v1, v2, v3 = _round16(x0, up_w, USE_ASM), _round16(x1, up_w, USE_ASM), _round16(x2, up_w, USE_ASM), \
        _round16(x3, up_w, USE_ASM)  # [W] int32 in int16's range
    v4, v5, v6, v7 = _round16(x4, up_w, USE_ASM), _round16(x5, up_w, USE_ASM), _round16(x6, up_w, USE_ASM), \
        _round16(x7, up_w, USE_ASM)
    vsum = _quad_sum(v0, v1, v2, v3, v4, v5, v6, v7, WORDS)  # [W/4]
    e0, e1, e2, e3, o0, o1, o2, o3 = _code_quads(p, h, h0, h1, h2, h3, HI, BLOCK_N, WORDS)  # [BN, W/4] each
    a0, a1, a2, a3 = _word_pairs(v0, v2, BLOCK_N, WORDS)  # [BN, W/4] each: x's pairs by word of the quad
    b0, b1, b2, b3 = _word_pairs(v4, v6, BLOCK_N, WORDS)
    c0, c1, c2, c3 = _word_pairs(v1, v3, BLOCK_N, WORDS)
    d0, d1, d2, d3 = _word_pairs(v5, v7, BLOCK_N, WORDS)
    dot = _nibbles_i16(e0, o0, a0, b0, c0, d0, tl.zeros([BLOCK_N, WORDS // 4], tl.int32), USE_ASM)
    dot = _nibbles_i16(e1, o1, a1, b1, c1, d1, dot, USE_ASM)
    dot = _nibbles_i16(e2, o2, a2, b2, c2, d2, dot, USE_ASM)
    dot = _nibbles_i16(e3, o3, a3, b3, c3, d3, dot, USE_ASM)  # [BN, W/4] sum over the quad of code v, exact
    if HI > 0:  # codes up to 63: dot and z * vsum up to 2^26, so their difference is taken in integers
        return (dot - z.to(tl.int32) * vsum[None, :]).to(tl.float32) * down[None, :]
    # dot and z * vsum are integers below 2^24 (32 x 15 x 2^15), exact in float32
    return (dot.to(tl.float32) - z * vsum.to(tl.float32)[None, :]) * down[None, :]


@triton.jit
def _word_pairs(va, vb, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """va, vb: [W] int16 values -> their pairs for each word of a quad, [BN, W/4] each."""
    pair = tl.broadcast_to(_pairs(va, vb)[None, :], [BLOCK_N, WORDS])
    return _quad_words(pair, BLOCK_N, WORDS)


@triton.jit
def _nibbles_i16(even, odd, x02, x46, x13, x57, dot, USE_ASM: tl.constexpr):
    """dot + one word's 8 products code * v: even/odd its nibbles as bytes, x..: x's pairs."""
    dot = _dp2a(x02, even, dot, False, False, USE_ASM)
    dot = _dp2a(x46, even, dot, True, False, USE_ASM)
    dot = _dp2a(x13, odd, dot, False, False, USE_ASM)
    return _dp2a(x57, odd, dot, True, False, USE_ASM)
