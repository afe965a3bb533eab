"""The GEMVs' int8-input arithmetic (A8, LLAMACTL_QUANT_INPUTS=int8; see kernels.gemv): a block of
x rounded to int8 per 32 columns (127 / max |x|) and multiplied with int4 or int8 weights in
integers by DP4A, exact, with one float scale per 32 columns."""

import triton
import triton.language as tl

from llamactl.kernels.high_bits import with_high


@triton.jit
def _int4_a8_dot(p, x0, x1, x2, x3, x4, x5, x6, x7, z, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                 WORDS: tl.constexpr, h=None, h0=None, h1=None, h2=None, h3=None, HI: tl.constexpr = 0):
    """sum over each quad's 32 columns of (code - z) x, as [BN, W/4] floats, with x rounded to int8
    per quad: v = round(x * 127 / max |x|) (4 consecutive words share one scale, as they share a
    group). Words p: [BN, W], x_j: [W] the slices x[8 w + j], z: [BN, W/4] the quads' zero points.
    The even nibbles of a word are its bytes masked with 0x0F0F0F0F, the odd ones those of the word
    shifted by 4; one DP4A each multiplies them with the matching 4 int8 inputs and adds. HI > 0:
    5- or 6-bit codes, their high bits added to the bytes (kernels.high_bits): 5 bits from h0..h3,
    [BN, W/4] each quad's words' (quad_high), 6 bits from h, [BN, W] each word's."""
    qmax = _quad_max(x0, x1, x2, x3, x4, x5, x6, x7, WORDS)  # [W/4]
    inv = _int8_inv(qmax)  # [W/4]
    inv_w = _repeat(inv, 4, WORDS // 4)  # [W] each word's quad's
    v0, v1, v2, v3 = _round(x0, inv_w, USE_ASM), _round(x1, inv_w, USE_ASM), _round(x2, inv_w, USE_ASM), _round(
        x3, inv_w, USE_ASM)  # [W] int32
    v4, v5, v6, v7 = _round(x4, inv_w, USE_ASM), _round(x5, inv_w, USE_ASM), _round(x6, inv_w, USE_ASM), _round(
        x7, inv_w, USE_ASM)
    x_even = (v0 & 0xFF) | ((v2 & 0xFF) << 8) | ((v4 & 0xFF) << 16) | ((v6 & 0xFF) << 24)  # [W] 4 int8 a word
    x_odd = (v1 & 0xFF) | ((v3 & 0xFF) << 8) | ((v5 & 0xFF) << 16) | ((v7 & 0xFF) << 24)
    vsum = _quad_sum(v0, v1, v2, v3, v4, v5, v6, v7, WORDS)  # [W/4]
    # a quad's 4 words (one thread's 16-byte load): 8 DP4A chained, [BN, W/4] each
    e0, e1, e2, e3, o0, o1, o2, o3 = _code_quads(p, h, h0, h1, h2, h3, HI, BLOCK_N, WORDS)
    xe0, xe1, xe2, xe3 = _quad_words(tl.broadcast_to(x_even[None, :], [BLOCK_N, WORDS]), BLOCK_N, WORDS)
    xo0, xo1, xo2, xo3 = _quad_words(tl.broadcast_to(x_odd[None, :], [BLOCK_N, WORDS]), BLOCK_N, WORDS)
    dot = _dp4a(e0, xe0, tl.zeros([BLOCK_N, WORDS // 4], tl.int32), USE_ASM)
    dot = _dp4a(o0, xo0, dot, USE_ASM)
    dot = _dp4a(e1, xe1, dot, USE_ASM)
    dot = _dp4a(o1, xo1, dot, USE_ASM)
    dot = _dp4a(e2, xe2, dot, USE_ASM)
    dot = _dp4a(o2, xo2, dot, USE_ASM)
    dot = _dp4a(e3, xe3, dot, USE_ASM)
    dot = _dp4a(o3, xo3, dot, USE_ASM)  # [BN, W/4] sum over the quad of code v, exact
    return (dot.to(tl.float32) - z * vsum.to(tl.float32)[None, :]) * (qmax * (1.0 / 127.0))[None, :]


@triton.jit
def _quad_max(x0, x1, x2, x3, x4, x5, x6, x7, WORDS: tl.constexpr):
    """The largest |x| of each quad (4 words: 32 columns), [W/4], from the slices x_j: [W]."""
    amax = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                      tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))  # [W]
    return tl.max(tl.reshape(amax, [WORDS // 4, 4]), axis=1)


@triton.jit
def _quad_sum(v0, v1, v2, v3, v4, v5, v6, v7, WORDS: tl.constexpr):
    """The sum of each quad's 32 values, [W/4], from the slices v_j: [W]."""
    return tl.sum(tl.reshape(v0 + v1 + v2 + v3 + v4 + v5 + v6 + v7, [WORDS // 4, 4]), axis=1)


@triton.jit
def _repeat(v, TIMES: tl.constexpr, N: tl.constexpr):
    """v: [N] -> [N * TIMES], each value TIMES times in a row (a block's scale for each of its parts)."""
    return tl.reshape(tl.broadcast_to(v[:, None], [N, TIMES]), [N * TIMES])


@triton.jit
def _int8_inv(qmax):
    """127 / qmax (0 where qmax is 0: a block of zeros), the scale that rounds a block of x whose
    largest magnitude is qmax to int8; correctly rounded (div.rn), so the GPU rounds x as the
    references do (Triton's `/` is an approximate division on the GPU)."""
    return tl.where(qmax > 0, tl.math.div_rn(tl.full(qmax.shape, 127.0, tl.float32), tl.maximum(qmax, 1e-30)), 0.0)


@triton.jit
def _code_quads(p, h, h0, h1, h2, h3, HI: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """Words p: [BN, W] -> the code bytes of each quad's 4 words, even columns (0, 2, 4, 6) then odd
    ones (1, 3, 5, 7), [BN, W/4] each (e0..e3, o0..o3): nibbles masked in place, and for 5- or 6-bit
    codes their high bits added (kernels.high_bits: 6 bits from h [BN, W], a half word a word; 5
    bits from h0..h3 [BN, W/4], quad_high's)."""
    even = p & 0x0F0F0F0F  # [BN, W] nibbles 0, 2, 4, 6 as bytes
    odd = (p >> 4) & 0x0F0F0F0F  # nibbles 1, 3, 5, 7
    if HI == 2:
        even, odd = with_high(even, odd, h, HI)
    e0, e1, e2, e3 = _quad_words(even, BLOCK_N, WORDS)
    o0, o1, o2, o3 = _quad_words(odd, BLOCK_N, WORDS)
    if HI == 1:
        e0, o0 = with_high(e0, o0, h0, HI)
        e1, o1 = with_high(e1, o1, h1, HI)
        e2, o2 = with_high(e2, o2, h2, HI)
        e3, o3 = with_high(e3, o3, h3, HI)
    return e0, e1, e2, e3, o0, o1, o2, o3


@triton.jit
def _quad_words(t, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """t: [BN, W] as the 4 words of each quad, [BN, W/4] each (within a thread: no data moves)."""
    a, b = tl.split(tl.reshape(t, [BLOCK_N, WORDS // 4, 2, 2]))  # [BN, W/4, 2]: words 0, 2 / 1, 3
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _round(x, inv, USE_ASM: tl.constexpr):
    """x * inv (float32, |x * inv| < 2^22) rounded to the nearest integer (ties to even) as int32,
    the product rounded once, exactly: one FMA adds 1.5 * 2^23, which leaves the integer in the
    low mantissa bits (as the compiler had fused it all along; rounding the float32 product first
    lands one step off for some bf16 inputs whose exact product lies just past a half).
    The interpreter computes the product in float64 (exact) instead."""
    if USE_ASM:
        t = tl.fma(x, inv, 12582912.0)
    else:
        t = (x.to(tl.float64) * inv.to(tl.float64) + 12582912.0).to(tl.float32)
    return t.to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _int_op(op: tl.constexpr, a, b, c):
    """One PTX instruction `op` on int32 registers: $0 = op($1, $2, $3) (dp4a, dp2a)."""
    return tl.inline_asm_elementwise(op, "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _dp4a(a, b, c, USE_ASM: tl.constexpr, A_SIGNED: tl.constexpr = False):
    """c + the sum of the 4 products of a's bytes (unsigned, or signed with A_SIGNED) and b's bytes
    (signed), int32 (PTX dp4a)."""
    if USE_ASM:
        if A_SIGNED:
            return _int_op("dp4a.s32.s32 $0, $1, $2, $3;", a, b, c)
        return _int_op("dp4a.u32.s32 $0, $1, $2, $3;", a, b, c)
    for i in tl.static_range(4):
        ai = (a >> (8 * i)) & 0xFF
        if A_SIGNED:
            ai = (ai ^ 0x80) - 0x80
        c += ai * ((((b >> (8 * i)) & 0xFF) ^ 0x80) - 0x80)
    return c


@triton.jit
def _int8_a8_dot(w, x, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over each 16 columns of w x as [BN, BK/16] floats, with x rounded to int8 per 32 columns
    (as in _int4_a8_dot). w: [BN, BK/4] int32, each 4 consecutive int8 weights (little-endian);
    x: [BK] float32. One DP4A a word, chained over a thread's 4 words (one 16-byte load: 16
    columns, half a block), so the weights never leave the registers they were loaded into (a
    32-column chain moved every block of weights through shared memory: 14 barriers an iteration)."""
    xb = tl.reshape(x, [BLOCK_K // 32, 32])
    qmax = tl.max(tl.abs(xb), axis=1)  # [BK/32]
    inv = _int8_inv(qmax)  # [BK/32]
    v = tl.reshape(_round(xb, tl.broadcast_to(inv[:, None], [BLOCK_K // 32, 32]), USE_ASM) & 0xFF,
                   [BLOCK_K // 4, 2, 2])  # [BK/4, 2, 2]: column 4 w + 2 i + j
    v_even, v_odd = tl.split(v)  # [BK/4, 2]: columns 4 w + 2 i, 4 w + 2 i + 1
    v0, v2 = tl.split(v_even)  # [BK/4]
    v1, v3 = tl.split(v_odd)
    xw = v0 | (v1 << 8) | (v2 << 16) | (v3 << 24)  # [BK/4] 4 int8 a word, as the weights
    w0, w1, w2, w3 = _quad_words(w, BLOCK_N, BLOCK_K // 4)  # [BN, BK/16] each
    x0, x1, x2, x3 = _quad_words(tl.broadcast_to(xw[None, :], [BLOCK_N, BLOCK_K // 4]), BLOCK_N, BLOCK_K // 4)
    dot = _dp4a(w0, x0, tl.zeros([BLOCK_N, BLOCK_K // 16], tl.int32), USE_ASM, A_SIGNED=True)
    dot = _dp4a(w1, x1, dot, USE_ASM, A_SIGNED=True)
    dot = _dp4a(w2, x2, dot, USE_ASM, A_SIGNED=True)
    dot = _dp4a(w3, x3, dot, USE_ASM, A_SIGNED=True)  # [BN, BK/16] exact
    scale = _repeat(qmax * (1.0 / 127.0), 2, BLOCK_K // 32)  # [BK/16] each 16 columns' block's
    return dot.to(tl.float32) * scale[None, :]
