"""The fifth and sixth bits of 5- and 6-bit codes, for the int4 GEMV (kernels.gemv).

A 5- or 6-bit weight is its low 4 bits in the int4 layout (nibble j of word w: column 8 w + j)
plus a high plane (layers.planes): per int4 word one byte (5 bits: bit j is column j's bit 4) or
one 16-bit half word (6 bits: bits 2 j and 2 j + 1 are column j's bits 4 and 5). The integer
products (I16, A8) take a word's codes as two words of bytes, the even columns (0, 2, 4, 6) and the
odd ones (1, 3, 5, 7), nibbles masked in place; `spread` moves the high bits of the even columns
to bits 4 (and 5) of their bytes with one multiply, so a byte holds the whole code (< 64); for 5 bits
those products load the high plane a quad (4 words) at a time as int32 (quad_high), for 6 bits a
half word a word. The float product adds the high bits' share with the same trick as the nibbles
(_high_dot); the dequantizing and split-K kernels take column j's high bits as `column_high`.
"""

import triton
import triton.language as tl


@triton.jit
def spread(h, HI: tl.constexpr):
    """The high bits of columns 0, 2, 4, 6 of h (int32 holding a word's byte or half word) at bits
    4 (and 5) of bytes 0..3. One bit a column: bit 2 m times 2^(6 m + 4) lands at 8 m + 4, and no
    other product of the multiply reaches those bits (a + 3 b = 4 m only for a = b). Two bits:
    columns m = 0, 2 and m = 1, 3 in two multiplies, whose other products fall between the targets."""
    if HI == 1:
        return ((h & 0x55) * 0x410410) & 0x10101010
    return (((h & 0x0303) * 0x1010) & 0x00300030) | (((h & 0x3030) * 0x10100) & 0x30003000)


@triton.jit
def with_high(even, odd, h, HI: tl.constexpr):
    """A word's code bytes (even: columns 0, 2, 4, 6; odd: 1, 3, 5, 7; nibbles masked in place) with
    the word's high bits h (int32, the byte or half word in the low bits) added: whole codes."""
    return even | spread(h, HI), odd | spread(h >> HI, HI)


@triton.jit
def quad_high(h_rows, k0, quads, row_ok, K):
    """5 bits: the high bits of the 4 words of each quad (32 columns) of the block at k0, as 4
    [BN, W/4] int32 (word i's byte in the low bits; the bits above are masked by `spread`), from
    one 4-byte load a quad of the high plane's words (h_rows: [BN, 1] int32 pointers). (6 bits
    load a half word a word: two strided 4-byte loads a quad decoded 0.68x slower on the H200.)"""
    idx = k0 // 32 + quads  # [W/4]
    hw = tl.load(h_rows + idx[None, :], mask=row_ok[:, None] & (idx < K // 32)[None, :], other=0)
    return hw, hw >> 8, hw >> 16, hw >> 24


@triton.jit
def column_high(h, j, HI: tl.constexpr):
    """Column j's high bits (j: a number, or a tensor of them) of a word's entry h (int32), in
    place above its nibble (<< 4): the code is nibble | column_high."""
    return ((h >> (j * HI)) & ((1 << HI) - 1)) << 4


@triton.jit
def _high_dot(h, x0, x1, x2, x3, x4, x5, x6, x7, HI: tl.constexpr):
    """sum_j hi_j 16 x_j as [BN, W] floats, hi_j the high bits of column j of h: [BN, W] int32;
    x_j: [W]. Each masked in place and OR-ed into 2^23's mantissa (as _nibble_float does)."""
    part = _high_term(h, 0, x0, HI)
    part += _high_term(h, 1, x1, HI)
    part += _high_term(h, 2, x2, HI)
    part += _high_term(h, 3, x3, HI)
    part += _high_term(h, 4, x4, HI)
    part += _high_term(h, 5, x5, HI)
    part += _high_term(h, 6, x6, HI)
    return part + _high_term(h, 7, x7, HI)


@triton.jit
def _high_term(h, j: tl.constexpr, xj, HI: tl.constexpr):
    bits = (h & (((1 << HI) - 1) << (HI * j))) | 0x4B000000
    return (bits.to(tl.float32, bitcast=True) - 8388608.0) * (xj * (16.0 / (1 << (HI * j))))[None, :]
