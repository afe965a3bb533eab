"""Reading a tile of a KV cache inside the attention kernels (kernels.attention's split-KV decode,
kernels.prefill_attention's packed prefill): the scores of query rows against a tile of keys,
and the softmax weights times a tile of values, from a 16-bit cache or an 8-bit one
(runtime.kv_format: int8 or e4m3 values, a float16 scale per position and head).

An 8-bit cache is read in float16 dots, its values converted in registers by inline PTX (four a
32-bit word; Triton's own conversions on the interpreter and where KV8_ASM is off): the query goes
to float16 divided by a power of two that keeps it in range, each position's scale is multiplied
into its score (keys) and its weight (values), and the scales are loaded a tile ahead. The values
are read as 16-bit words of two neighbouring columns and multiplied in two dots, the even
columns' and the odd columns', so that the dot's operand with the positions innermost comes
through transposing 16-bit matrix loads, not byte gathers (docs/decisions/2026-12-07-kv8.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llamactl.kernels.device import interpreted

# An 8-bit cache's values converted by inline PTX (off: Triton's own conversions, for comparison)
KV8_ASM = True


def _to_f16(int8: bool, pairs: tuple[str, str]) -> tl.constexpr:
    """Inline PTX taking a 32-bit word of four 8-bit values ($2) to two float16 pairs ($0, $1):
    pairs names the bytes of each (prmt selectors). int8: q biased under fp16's 1024 (0x64qq is
    1024 + 128 + q), less 1152; e4m3: the hardware's pair conversion of the bytes gathered."""
    if int8:
        body = (".reg .b32 u, c;\nxor.b32 u, $2, 0x80808080;\nmov.b32 c, 0x64806480;\n"
                f"prmt.b32 $0, u, 0x64646464, {pairs[0]};\nprmt.b32 $1, u, 0x64646464, {pairs[1]};\n"
                "sub.f16x2 $0, $0, c;\nsub.f16x2 $1, $1, c;\n")
    else:  # the first pair's bytes to the low half, the second's to the high one (the selectors'
        # nibbles 0 and 2 name a pair's bytes); in order, no permute
        sel = "0x" + pairs[1][-3] + pairs[1][-1] + pairs[0][-3] + pairs[0][-1]
        gather = "mov.b32 t, $2;\n" if sel == "0x3210" else f"prmt.b32 t, $2, 0, {sel};\n"
        body = (".reg .b32 t;\n.reg .b16 lo, hi;\n" + gather + "mov.b32 {lo, hi}, t;\n"
                "cvt.rn.f16x2.e4m3x2 $0, lo;\ncvt.rn.f16x2.e4m3x2 $1, hi;\n")
    return tl.constexpr("{\n" + body + "}")


# Four values from a word in order (the keys: bytes 0, 1 and 2, 3); the values are read as 16-bit
# words of two neighbouring columns (kv_accumulate): from two words (two positions), their low
# bytes (bytes 0, 2: the even columns) and their high bytes (1, 3: the odd columns)
_I8_F16, _E4M3_F16 = _to_f16(True, ("0x4140", "0x4342")), _to_f16(False, ("0x4140", "0x4342"))
_I8_F16_SPLIT, _E4M3_F16_SPLIT = _to_f16(True, ("0x4240", "0x4341")), _to_f16(False, ("0x4240", "0x4341"))


@triton.jit
def kv8_as(x, dtype: tl.constexpr, INT8: tl.constexpr, ASM: tl.constexpr):
    """8-bit cache values (int8 or e4m3: exact in every float type of 16 bits or more) in dtype;
    float16 with ASM four a 32-bit word by inline PTX (not in Triton's interpreter)."""
    if ASM and dtype == tl.float16:
        if INT8:
            y = tl.inline_asm_elementwise(_I8_F16, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        else:
            y = tl.inline_asm_elementwise(_E4M3_F16, "=r,=r,r", [x.to(tl.int8, bitcast=True)], dtype=tl.float16,
                                          is_pure=True, pack=4)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def kv8_split(w, INT8: tl.constexpr, ASM: tl.constexpr):
    """16-bit words w [..] of an 8-bit cache (each two neighbouring columns' values: the low byte
    the even column's) -> (the even columns', the odd columns') values in float16, each [..]."""
    if ASM:
        if INT8:
            even, odd = tl.inline_asm_elementwise(_I8_F16_SPLIT, "=r,=r,r", [w], dtype=(tl.float16, tl.float16),
                                                  is_pure=True, pack=2)
        else:
            even, odd = tl.inline_asm_elementwise(_E4M3_F16_SPLIT, "=r,=r,r", [w], dtype=(tl.float16, tl.float16),
                                                  is_pure=True, pack=2)
    elif INT8:  # the bytes sign-extended
        even = ((w << 8) >> 8).to(tl.float16)
        odd = (w >> 8).to(tl.float16)
    else:
        even = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        odd = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even, odd


@triton.jit
def kv8_query(q, KV8: tl.constexpr):
    """(the query the kernels' dots take, the factor its scores owe): for an 8-bit cache a 16-bit
    query in float16 (the 8-bit values' dot type: their conversion to it is four values from one
    word), scaled by a power of two that keeps its largest magnitude in float16's range (1 for any
    real model's); otherwise q as it is (float32 stays float32)."""
    if KV8 and q.dtype != tl.float32:
        amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
        f = tl.exp2(tl.ceil(tl.log2(tl.maximum(amax / 16384.0, 1.0))))  # a power of two >= 1
        q16 = (q.to(tl.float32) / f).to(tl.float16)
    else:
        f = 1.0
        q16 = q
    return q16, f


@triton.jit
def kv8_scales(ks_ptr, vs_ptr, at, ok, D: tl.constexpr, KV8: tl.constexpr):
    """The scales (float32 [BS]) of an 8-bit cache's keys and values at offsets at [BS] (ok: the
    ones to read; at ks_ptr/vs_ptr + at // D); (1, 1) for a 16-bit cache. The loops load a tile's
    scales a tile ahead: a load of a few bytes a thread is not pipelined by Triton, and one issued
    in the tile that uses it stalls the tile for the memory's latency."""
    if KV8:
        ks = tl.load(ks_ptr + at // D, mask=ok, other=0.0).to(tl.float32)
        vs = tl.load(vs_ptr + at // D, mask=ok, other=0.0).to(tl.float32)
    else:
        ks = 1.0
        vs = 1.0
    return ks, vs


@triton.jit
def kv_scores(q, k_ptr, ks, at, d, ok, scale, PRECISION: tl.constexpr, KV8: tl.constexpr, INT8: tl.constexpr,
              ASM: tl.constexpr):
    """q [BR, D] (kv8_query's) against the keys at offsets at [BS] (ok: the ones to read): scaled
    scores [BR, BS], float32 (scale includes kv8_query's factor). KV8: the keys are 8-bit (INT8:
    int8, else e4m3), their scales ks [BS] (kv8_scales) multiplied into the scores."""
    k = tl.load(k_ptr + at[:, None] + d[None, :], mask=ok[:, None], other=0.0)  # [BS, D]
    if KV8:  # (one return after both branches: Triton compiles what follows a constexpr branch's return)
        s = tl.dot(q, tl.trans(kv8_as(k, q.dtype, INT8, ASM)), input_precision=PRECISION) * (ks[None, :] * scale)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    return s


@triton.jit
def kv_acc(BR: tl.constexpr, D: tl.constexpr, KV8: tl.constexpr):
    """The attention output's accumulators for kv_accumulate: (acc [BR, D], unused) float32 zeros;
    for an 8-bit cache of D >= 32 (the even columns' [BR, D / 2], the odd columns')."""
    if KV8 and D >= 32:
        acc = tl.zeros([BR, D // 2], tl.float32)
        odd = tl.zeros([BR, D // 2], tl.float32)
    else:
        acc = tl.zeros([BR, D], tl.float32)
        odd = tl.zeros([BR, 1], tl.float32)
    return acc, odd


@triton.jit
def kv_accumulate(acc, odd, alpha, p, v_ptr, vs, at, d, ok, dtype, PRECISION: tl.constexpr, KV8: tl.constexpr,
                  INT8: tl.constexpr, ASM: tl.constexpr):
    """(acc, odd) (kv_acc's) times alpha [BR] plus p [BR, BS] (float32 softmax weights) times the
    values at offsets at [BS]. KV8: 8-bit values, their scales vs [BS] (kv8_scales) folded into
    the weights, the dots in dtype (kv8_query's). At D >= 32 they are read as 16-bit words of two
    columns, so the dot's operand (positions innermost) comes from shared memory a word pair at a
    time, not a byte at a time: one dot for the even columns, one for the odd."""
    if KV8 and d.shape[0] >= 32:
        j = tl.arange(0, d.shape[0] // 2)
        words = v_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        w = tl.load(words + (at // 2)[:, None] + j[None, :], mask=ok[:, None], other=0)  # [BS, D / 2]
        even, odd_v = kv8_split(w, INT8, ASM and dtype == tl.float16)
        pv = (p * vs[None, :]).to(dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, even.to(dtype), input_precision=PRECISION)
        odd = odd * alpha[:, None] + tl.dot(pv, odd_v.to(dtype), input_precision=PRECISION)
    elif KV8:
        v = tl.load(v_ptr + at[:, None] + d[None, :], mask=ok[:, None], other=0.0)  # [BS, D]
        acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(dtype), kv8_as(v, dtype, INT8, ASM),
                                            input_precision=PRECISION)
    else:
        v = tl.load(v_ptr + at[:, None] + d[None, :], mask=ok[:, None], other=0.0)  # [BS, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, odd


@triton.jit
def kv_output(acc, odd, D: tl.constexpr, KV8: tl.constexpr):
    """kv_accumulate's accumulators as the output [BR, D] (an 8-bit cache's columns interleaved)."""
    if KV8 and D >= 32:
        acc = tl.reshape(tl.join(acc, odd), (acc.shape[0], D))
    return acc


def kv8_args(cache: torch.Tensor, scales: tuple[torch.Tensor | None, torch.Tensor | None]) -> dict:
    """The attention kernels' 8-bit arguments for a cache tensor of dtype int8 or float8_e4m3fn
    with its (k_scale, v_scale); none for a 16-bit cache."""
    if scales[0] is None:
        return {}
    int8 = cache.dtype == torch.int8
    qmax = float(torch.iinfo(cache.dtype).max if int8 else torch.finfo(cache.dtype).max)  # 127, 448 (e4m3)
    return {"ks_ptr": scales[0], "vs_ptr": scales[1], "KV8": True, "INT8": int8, "QMAX": qmax,
            "ASM": KV8_ASM and not interpreted()}
