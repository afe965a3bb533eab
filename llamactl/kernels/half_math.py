"""The int4 and int8 GEMVs' packed half-precision arithmetic (H16, LLAMACTL_QUANT_INPUTS=fp16;
see kernels.gemv): two weights a 32-bit register, so about half the instructions a weight of the
float32 loop (int4: LOP3, HSUB2, HFMA2 for every two weights, against LOP3, FADD, FFMA for each;
int8: see _WORDS_ASM). Below, the int4 form.

x is not rounded to fewer bits: each block of 32 inputs (a quad: 4 words, one group's quarter) is
scaled by a power of two, 2^-e with 2^e <= max |x| < 2^(e+1), and converted to fp16, exact for
bf16 inputs down to 2^-14 of the block's largest (smaller ones lose bits as fp16 subnormals).
A weight's nibble, OR-ed into the mantissa of fp16 1024 (0x6400), is 1024 + code; subtracting
1032 gives code - 8 exactly (centred, so the sums stay small), and each pair of products is added
to a half2 sum of the quad in fp16 (|sum| <= 16 x 8 x 2 = 256 a half; rounded to 11 bits each
step), which is converted to float32 and multiplied by 2^e; the caller subtracts (z - 8) sum x in
float32 and applies the group's scale. Nibbles 1, 3, 5 and 7 sit 4 bits higher (1024 + 16 code)
and their inputs are pre-divided by 16 (exact).

Pairs: word bits (0-3, 16-19) are nibbles (0, 4); (4-7, 20-23) are (1, 5); the word shifted by 8
gives (2, 6) and (3, 7) the same way. x's pair p of word i is (x[8 i + p], x[8 i + 4 + p]).
"""

import triton
import triton.language as tl

from llamactl.kernels.int8_inputs import _quad_words, _repeat


def _half2_chain(setup: str, body: str) -> tl.constexpr:
    """Inline PTX that adds products into one half2 sum, `acc` (setup: more registers and
    constants; body: the products, with scratch register t), then returns its two halves' sum as
    float32 in $0."""
    return tl.constexpr("{\n.reg .b32 t, acc;\n.reg .b16 lo, hi;\n.reg .f32 flo, fhi;\nmov.b32 acc, 0;\n" + setup + body
                        + "mov.b32 {lo, hi}, acc;\ncvt.f32.f16 flo, lo;\ncvt.f32.f16 fhi, hi;\nadd.f32 $0, flo, fhi;\n}")


# one quad: words $1-$4, x's pairs $5-$20 (word by word, pairs 0-3); $0: the quad's sum of
# (code - 8) x' as float32 (1032 = 0x6408, 1024 + 16 x 8 = 1152 = 0x6480)
_QUAD_ASM = _half2_chain(".reg .b32 s, m8, m128;\nmov.b32 m8, 0x64086408;\nmov.b32 m128, 0x64806480;\n", "".join(
    f"""lop3.b32 t, ${w}, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, m8;
fma.rn.f16x2 acc, t, ${5 + 4 * (w - 1)}, acc;
lop3.b32 t, ${w}, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t, t, m128;
fma.rn.f16x2 acc, t, ${6 + 4 * (w - 1)}, acc;
shr.u32 s, ${w}, 8;
lop3.b32 t, s, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, m8;
fma.rn.f16x2 acc, t, ${7 + 4 * (w - 1)}, acc;
lop3.b32 t, s, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t, t, m128;
fma.rn.f16x2 acc, t, ${8 + 4 * (w - 1)}, acc;
""" for w in range(1, 5)))


@triton.jit
def _int4_h16_dot(p, xk, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """(sum over each quad's 32 columns of (code - 8) x as [BN, W/4] floats, in packed fp16 (see the
    module docstring), and the quads' sums of x [W/4]): the caller subtracts (z - 8) times the
    second, in float32, so the zero points need no half2 registers in the layout of the words.
    Words p: [BN, W], xk: [8W] the block's inputs x' (column 8 w + j, float32)."""
    Q: tl.constexpr = WORDS // 4
    xq = tl.reshape(xk, [Q, 32])  # [Q, 32] a quad's inputs
    unit_bits, inv = _pow2_scale(xq)  # [Q] each
    c = tl.arange(0, 32)
    pre = tl.where(c % 2 == 1, 1.0 / 16, 1.0)  # [32] odd nibbles sit 4 bits higher
    xh = tl.reshape(xq * inv[:, None] * pre[None, :], [Q, 4, 2, 4])  # [Q, word, half, pair]
    lo, hi = tl.split(tl.permute(xh, (0, 1, 3, 2)))  # [Q, word, pair] each
    pairs = tl.reshape(_pack_half2(lo, hi, USE_ASM), [Q, 16])  # [Q, 4 word + pair] int32
    w0, w1, w2, w3 = _quad_words(p, BLOCK_N, WORDS)  # [BN, Q] each
    x = tl.broadcast_to(pairs[None, :, :], [BLOCK_N, Q, 16])
    a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33 = _sixteen(x, BLOCK_N, Q)
    if USE_ASM:
        dot = tl.inline_asm_elementwise(_QUAD_ASM, "=r" + ",r" * 20,
                                        [w0, w1, w2, w3, a00, a01, a02, a03, a10, a11, a12, a13,
                                         a20, a21, a22, a23, a30, a31, a32, a33],
                                        dtype=tl.float32, is_pure=True, pack=1)
    else:  # the same arithmetic, rounded to fp16 where the GPU rounds (CPU interpreter)
        acc_lo = tl.zeros([BLOCK_N, Q], tl.float32)
        acc_hi = tl.zeros([BLOCK_N, Q], tl.float32)
        acc_lo, acc_hi = _word_h16(w0, a00, a01, a02, a03, acc_lo, acc_hi)
        acc_lo, acc_hi = _word_h16(w1, a10, a11, a12, a13, acc_lo, acc_hi)
        acc_lo, acc_hi = _word_h16(w2, a20, a21, a22, a23, acc_lo, acc_hi)
        acc_lo, acc_hi = _word_h16(w3, a30, a31, a32, a33, acc_lo, acc_hi)
        dot = acc_lo + acc_hi
    return dot * unit_bits.to(tl.float32, bitcast=True)[None, :], tl.sum(xq, axis=1)


@triton.jit
def _pow2_scale(xb):
    """xb: [B, 32] -> (2^e as float32 bits, int32, and 2^-e, exact), [B] each, with 2^e <= max |x| <
    2^(e + 1) per row: the exponent bits of the largest magnitude (0 and 2^127 for a row of zeros,
    whose products are 0 either way)."""
    unit_bits = tl.max(tl.abs(xb), axis=1).to(tl.int32, bitcast=True) & 0x7F800000
    return unit_bits, (0x7F000000 - unit_bits).to(tl.float32, bitcast=True)


@triton.jit
def _sixteen(t, BLOCK_N: tl.constexpr, Q: tl.constexpr):
    """t: [BN, Q, 16] as its 16 slices t[:, :, 4 i + p], [BN, Q] each, in the order (i, p)."""
    even, odd = tl.split(tl.reshape(t, [BLOCK_N, Q, 4, 2, 2]))  # [BN, Q, 4, 2]: p = 0, 2 / 1, 3
    p0, p2 = tl.split(even)  # [BN, Q, 4] over i
    p1, p3 = tl.split(odd)
    a00, a10, a20, a30 = _four(p0, BLOCK_N, Q)
    a01, a11, a21, a31 = _four(p1, BLOCK_N, Q)
    a02, a12, a22, a32 = _four(p2, BLOCK_N, Q)
    a03, a13, a23, a33 = _four(p3, BLOCK_N, Q)
    return a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33


@triton.jit
def _four(t, BLOCK_N: tl.constexpr, Q: tl.constexpr):
    """t: [BN, Q, 4] as t[:, :, 0..3], [BN, Q] each."""
    a, b = tl.split(tl.reshape(t, [BLOCK_N, Q, 2, 2]))  # [BN, Q, 2]: 0, 2 / 1, 3
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _pack_half2(lo, hi, USE_ASM: tl.constexpr):
    """float32 lo, hi -> int32 bits of the half2 (lo in the low 16 bits), rounded to nearest."""
    if USE_ASM:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return _half_bits(lo) | (_half_bits(hi) << 16)


@triton.jit
def _half_bits(t):
    """float32 -> the fp16 bits (rounded to nearest) as int32 in 0..65535."""
    return t.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _halves(bits):
    """int32 bits of a half2 -> (low, high) as float32."""
    lo = (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((bits >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pair_h16(bits, sub: tl.constexpr, xp, acc_lo, acc_hi):
    """One pair as the asm computes it (interpreter): (bits - sub) * xp + acc in fp16 per half, bits:
    a half2 built in the mantissa of 1024 (0x6400)."""
    b_lo, b_hi = _halves(bits)
    x_lo, x_hi = _halves(xp)
    acc_lo = ((b_lo - sub) * x_lo + acc_lo).to(tl.float16).to(tl.float32)
    acc_hi = ((b_hi - sub) * x_hi + acc_hi).to(tl.float16).to(tl.float32)
    return acc_lo, acc_hi


@triton.jit
def _word_h16(w, xa, xb, xc, xd, acc_lo, acc_hi):
    """One word's four pairs as _QUAD_ASM computes them (interpreter)."""
    s = (w >> 8) & 0xFFFFFF
    acc_lo, acc_hi = _pair_h16((w & 0x000F000F) | 0x64006400, 1032.0, xa, acc_lo, acc_hi)
    acc_lo, acc_hi = _pair_h16((w & 0x00F000F0) | 0x64006400, 1152.0, xb, acc_lo, acc_hi)
    acc_lo, acc_hi = _pair_h16((s & 0x000F000F) | 0x64006400, 1032.0, xc, acc_lo, acc_hi)
    acc_lo, acc_hi = _pair_h16((s & 0x00F000F0) | 0x64006400, 1152.0, xd, acc_lo, acc_hi)
    return acc_lo, acc_hi


# int8 weights, one thread's 16-byte load (4 words, 16 columns): words $1-$4, x's pairs (x[4 i],
# x[4 i + 2]) in $5-$8 and (x[4 i + 1], x[4 i + 3]) in $9-$12 for word i; $0: the sum of w x' over
# the 16 columns as float32. A word's bytes, sign bits flipped (128 + w), sit in the mantissas of
# two fp16 1024s (PRMT with 0x64 bytes), so subtracting 1152 leaves w exactly.
_WORDS_ASM = _half2_chain(".reg .b32 a, m;\nmov.b32 m, 0x64806480;\n", "".join(
    f"""xor.b32 t, ${w}, 0x80808080;
prmt.b32 a, t, 0x64646464, 0x4240;
sub.f16x2 a, a, m;
fma.rn.f16x2 acc, a, ${4 + w}, acc;
prmt.b32 a, t, 0x64646464, 0x4341;
sub.f16x2 a, a, m;
fma.rn.f16x2 acc, a, ${8 + w}, acc;
""" for w in range(1, 5)))


@triton.jit
def _int8_h16_dot(w, x, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over each 16 columns of w x as [BN, BK/16] floats, in packed fp16 with x scaled by a
    power of two per 32 columns (as _int4_h16_dot). w: [BN, BK/4] int32, each 4 consecutive int8
    weights (little-endian); x: [BK] float32. A thread's 4 words (one 16-byte load) are one chain,
    as in int8_inputs._int8_a8_dot, so the weights stay in the registers they were loaded into."""
    xb = tl.reshape(x, [BLOCK_K // 32, 32])
    unit_bits, inv = _pow2_scale(xb)  # [BK/32] each
    xh = tl.reshape(xb * inv[:, None], [BLOCK_K // 4, 2, 2])  # [BK/4, 2, 2]: column 4 w + 2 i + j
    even, odd = tl.split(xh)  # [BK/4, 2]: columns 4 w + 2 i / 4 w + 2 i + 1
    x0, x2 = tl.split(even)  # [BK/4]
    x1, x3 = tl.split(odd)
    p02 = tl.broadcast_to(_pack_half2(x0, x2, USE_ASM)[None, :], [BLOCK_N, BLOCK_K // 4])
    p13 = tl.broadcast_to(_pack_half2(x1, x3, USE_ASM)[None, :], [BLOCK_N, BLOCK_K // 4])
    w0, w1, w2, w3 = _quad_words(w, BLOCK_N, BLOCK_K // 4)  # [BN, BK/16] each
    a0, a1, a2, a3 = _quad_words(p02, BLOCK_N, BLOCK_K // 4)
    b0, b1, b2, b3 = _quad_words(p13, BLOCK_N, BLOCK_K // 4)
    if USE_ASM:
        dot = tl.inline_asm_elementwise(_WORDS_ASM, "=r" + ",r" * 12, [w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3],
                                        dtype=tl.float32, is_pure=True, pack=1)
    else:  # the same arithmetic, rounded to fp16 where the GPU rounds (CPU interpreter)
        acc_lo = tl.zeros([BLOCK_N, BLOCK_K // 16], tl.float32)
        acc_hi = tl.zeros([BLOCK_N, BLOCK_K // 16], tl.float32)
        acc_lo, acc_hi = _int8_word_h16(w0, a0, b0, acc_lo, acc_hi)
        acc_lo, acc_hi = _int8_word_h16(w1, a1, b1, acc_lo, acc_hi)
        acc_lo, acc_hi = _int8_word_h16(w2, a2, b2, acc_lo, acc_hi)
        acc_lo, acc_hi = _int8_word_h16(w3, a3, b3, acc_lo, acc_hi)
        dot = acc_lo + acc_hi
    unit = _repeat(unit_bits.to(tl.float32, bitcast=True), 2, BLOCK_K // 32)  # [BK/16] each 16 columns' 2^e
    return dot * unit[None, :]


@triton.jit
def _int8_word_h16(w, x02, x13, acc_lo, acc_hi):
    """One word of int8 weights as _WORDS_ASM computes it (interpreter)."""
    t = w ^ -0x7F7F7F80  # 0x80808080 as int32: each byte's sign bit flipped
    b02 = (t & 0xFF) | (((t >> 16) & 0xFF) << 16) | 0x64006400  # bytes 0 and 2 in two fp16 1024s
    b13 = ((t >> 8) & 0xFF) | (((t >> 24) & 0xFF) << 16) | 0x64006400
    acc_lo, acc_hi = _pair_h16(b02, 1152.0, x02, acc_lo, acc_hi)
    return _pair_h16(b13, 1152.0, x13, acc_lo, acc_hi)
