"""Compile every variant of llamactl's Triton kernels to sm_90 (Hopper) cubins, without a GPU.

Triton's bundled ptxas does the work; each kernel is specialized as the runtime would (16-byte
aligned pointers, N and K multiples of 16). Catches what the CPU interpreter cannot: inline PTX,
type errors in branches the interpreter runs as Python, register spills (reported).
Usage: python scripts/compile_kernels.py   (tests/kernels/test_kernels.py runs it)
"""

from __future__ import annotations

import itertools
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the interpreter does not compile kernels")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from llamactl.kernels import attention, fp8, gemv, gemv_int4, int4_layout, multirow, prefill_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
GEMV = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "nw_ptr": "*bf16", "r_ptr": "*bf16", "y_ptr": "*bf16",
        "N": "i32", "K": "i32", "eps": "fp32"}
INT4 = {"x_ptr": "*bf16", "q_ptr": "*i32", "h_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "nw_ptr": "*bf16", "r_ptr": "*bf16",
        "y_ptr": "*bf16", "N": "i32", "K": "i32", "eps": "fp32"}
ATTN = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "o_ptr": "*bf16",
        "kn_ptr": "*bf16", "vn_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "S": "i32", "scale": "fp32",
        "q_row": "i32", "kn_row": "i32", "vn_row": "i32"}


def compile_one(fn, signature: dict, constexprs: dict, warps: int = 4):
    names = fn.arg_names
    sig = {n: signature.get(n, "constexpr") for n in names}
    # ASTSource does not apply a constexpr's default value as a launch would
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | constexprs
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in ("N", "K")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps})


def cases():
    flags = list(itertools.product([False, True], repeat=3))  # NORM, GLU, RESIDUAL
    for w_type, (norm, glu, res) in itertools.product(["*bf16", "*i8"], flags):
        if norm and glu:
            continue  # never both: a norm feeds qkv/gate_up, SwiGLU feeds down_proj
        for prefetch, reduce_each, pdl in ((False, False, False), (True, False, False), (False, True, False),
                                           (False, False, True), (True, False, True), (False, True, True)):
            yield (f"gemv {w_type[1:]} norm={norm} glu={glu} residual={res} prefetch={prefetch} reduce_each={reduce_each}"
                   f" pdl={pdl}", gemv._gemv_kernel, dict(GEMV, w_ptr=w_type),
                   dict(HAS_SCALE=w_type == "*i8", NORM=norm, GLU=glu, RESIDUAL=res, USE_ASM=True, BLOCK_N=8, BLOCK_K=512,
                        PREFETCH=prefetch, REDUCE_EACH=reduce_each, PDL=pdl))
    for (norm, glu, res), (prefetch, x_contig), pdl in itertools.product(
            flags, [(False, False), (True, False), (False, True)], [False, True]):
        if not (norm and glu):
            yield (f"gemv int4 norm={norm} glu={glu} residual={res} prefetch={prefetch} x_contig={x_contig} pdl={pdl}",
                   gemv_int4._gemv_int4_kernel, INT4,
                   dict(G=128, NORM=norm, GLU=glu, RESIDUAL=res, USE_ASM=True, BLOCK_N=32, BLOCK_K=1024,
                        PREFETCH=prefetch, PDL=pdl, X_CONTIG=x_contig))
    for (norm, glu, res), prefetch, reduce_each, pdl in itertools.product(flags, [False, True], [False, True],
                                                                         [False, True]):
        if not (norm and glu) and not (prefetch and reduce_each):  # int8 weights and inputs (A8): DP4A
            yield (f"gemv i8 a8 norm={norm} glu={glu} residual={res} prefetch={prefetch} reduce_each={reduce_each}"
                   f" pdl={pdl}", gemv._gemv_kernel, dict(GEMV, w_ptr="*i8"),
                   dict(HAS_SCALE=True, NORM=norm, GLU=glu, RESIDUAL=res, USE_ASM=True, BLOCK_N=8, BLOCK_K=512,
                        PREFETCH=prefetch, REDUCE_EACH=reduce_each, PDL=pdl, A8=True))
    for w_type in ("*bf16", "*i8"):  # SwiGLU of a fused [gate; up] output, the norm before it
        yield (f"gemv {w_type[1:]} norm=True glu_out=True", gemv._gemv_kernel, dict(GEMV, w_ptr=w_type),
               dict(HAS_SCALE=w_type == "*i8", NORM=True, GLU=False, RESIDUAL=False, USE_ASM=True, BLOCK_N=8,
                    BLOCK_K=512, PREFETCH=False, GLU_OUT=True))
    yield ("gemv int4 norm=True glu_out=True", gemv_int4._gemv_int4_kernel, INT4,
           dict(G=128, NORM=True, GLU=False, RESIDUAL=False, USE_ASM=True, BLOCK_N=32, BLOCK_K=1024, PREFETCH=False,
                GLU_OUT=True))
    for (norm, glu, res), x_contig, pdl in itertools.product(flags, [False, True], [False, True]):
        if not (norm and glu):  # int8 inputs (A8): DP4A
            yield (f"gemv int4 a8 norm={norm} glu={glu} residual={res} x_contig={x_contig} pdl={pdl}",
                   gemv_int4._gemv_int4_kernel, INT4,
                   dict(G=128, NORM=norm, GLU=glu, RESIDUAL=res, USE_ASM=True, BLOCK_N=32, BLOCK_K=1024,
                        PREFETCH=False, PDL=pdl, X_CONTIG=x_contig, A8=True))
    for (norm, glu, res), pdl, arith in itertools.product(flags, [False, True], ["H16", "I16"]):
        if not (norm and glu):  # packed fp16 arithmetic (H16), int16 inputs (I16): int4 and int8 weights
            yield (f"gemv int4 {arith.lower()} norm={norm} glu={glu} residual={res} pdl={pdl}", gemv_int4._gemv_int4_kernel,
                   INT4, dict(G=128, NORM=norm, GLU=glu, RESIDUAL=res, USE_ASM=True, BLOCK_N=16, BLOCK_K=1024,
                              PREFETCH=False, PDL=pdl, **{arith: True}))
            yield (f"gemv i8 {arith.lower()} norm={norm} glu={glu} residual={res} pdl={pdl}", gemv._gemv_kernel,
                   dict(GEMV, w_ptr="*i8"),
                   dict(HAS_SCALE=True, NORM=norm, GLU=glu, RESIDUAL=res, USE_ASM=True, BLOCK_N=8, BLOCK_K=512,
                        PREFETCH=False, REDUCE_EACH=False, PDL=pdl, **{arith: True}))
    # 5- and 6-bit codes (a high plane beside the nibbles), at the norm's and SwiGLU's sites
    for (norm, glu, res), hi, arith in itertools.product([(True, False, False), (False, True, True)], [1, 2],
                                                         ["", "A8", "I16"]):
        yield (f"gemv int{4 + hi} {arith.lower() or 'float'} norm={norm} glu={glu} residual={res}",
               gemv_int4._gemv_int4_kernel, INT4,
               dict(G=128, NORM=norm, GLU=glu, RESIDUAL=res, USE_ASM=True, BLOCK_N=16, BLOCK_K=1024,
                    PREFETCH=False, PDL=True, HI=hi, **({arith: True} if arith else {})))
    for hi in (0, 1, 2):
        yield (f"dequantize int{4 + hi}", int4_layout._dequant_int4_kernel,
               {"q_ptr": "*i32", "h_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "w_ptr": "*bf16", "words": "i32"},
               dict(G=128, BLOCK=512, HI=hi))
    for rope, (r, d), pdl, splits in itertools.product([False, True], [(1, 128), (4, 128), (8, 64)], [False, True],
                                                       [8, 1]):  # one split: the output stored in the kernel
        yield (f"decode attention rope={rope} R={r} D={d} pdl={pdl} splits={splits}", attention._split_kernel, ATTN,
               dict(R=r, SPLITS=splits, CHUNK=64 if splits > 1 else 512, D=d, BLOCK_R=16, BLOCK_S=64, ROPE=rope,
                    PRECISION="tf32", PDL=pdl))
    # over the paged pool (a server's steps; a mixed step's decode rows: rope=False), both split plans
    for rope, row_chunks, splits in itertools.product([False, True], [False, True], [4, 1]):
        yield (f"paged decode attention rope={rope} row_chunks={row_chunks} splits={splits}", attention._split_kernel,
               dict(ATTN, table_ptr="*i32", T_ROW="i32"),
               dict(R=4, SPLITS=splits, CHUNK=64 if splits > 1 else 512, D=128, BLOCK_R=16, BLOCK_S=64, ROPE=rope,
                    PRECISION="tf32", HKV=8, ROW_POS=True, PAGED=True, BS=16, ROW_CHUNKS=row_chunks))
    # an 8-bit cache (int8, fp8 e4m3) with float16 scales: static and paged, with the quantizing write and without
    # (ASM: the values converted by inline PTX, as on a GPU; without: Triton's conversions)
    for (kv, int8), rope, paged, asm in itertools.product([("*i8", True), ("*fp8e4nv", False)], [False, True],
                                                          [False, True], [True, False]):
        if asm or not (rope or paged):
            yield (f"decode attention {kv[1:]} cache rope={rope} paged={paged} asm={asm}", attention._split_kernel,
                   dict(ATTN, k_ptr=kv, v_ptr=kv, ks_ptr="*fp16", vs_ptr="*fp16",
                        **({"table_ptr": "*i32", "T_ROW": "i32"} if paged else {})),
                   dict(R=4, SPLITS=4, CHUNK=64, D=128, BLOCK_R=16, BLOCK_S=64, ROPE=rope, PRECISION="tf32", HKV=8,
                        ROW_POS=True, PAGED=paged, BS=16, KV8=True, INT8=int8, QMAX=127.0 if int8 else 448.0, ASM=asm))
    ragged = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "table_ptr": "*i32", "T_ROW": "i32",
              "tile_seq_ptr": "*i32", "tile_m_ptr": "*i32", "q_start_ptr": "*i32", "q_len_ptr": "*i32", "ctx_ptr": "*i32",
              "row_ptr": "*i32", "scale": "fp32", "q_tok": "i32", "q_head": "i32"}
    for kv in ("*bf16", "*i8", "*fp8e4nv"):
        yield (f"packed prefill attention {kv[1:]} cache", prefill_attention._ragged_kernel,
               dict(ragged, k_ptr=kv, v_ptr=kv, **({"ks_ptr": "*fp16", "vs_ptr": "*fp16"} if kv != "*bf16" else {})),
               dict(H=32, HKV=8, D=128, BS=16, BLOCK_M=64, BLOCK_N=prefill_attention.BLOCK_N, PRECISION="tf32",
                    KV8=kv != "*bf16", INT8=kv == "*i8", ASM=kv != "*bf16"))
    rows = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "z_ptr": "*u8", "y_ptr": "*bf16", "M": "i32",
            "N": "i32", "K": "i32"}
    for kind, w_type, s_type in ((multirow.W16, "*bf16", "*bf16"), (multirow.W8, "*i8", "*bf16"),
                                 (multirow.W4, "*i32", "*fp16")):
        yield (f"multirow kind={kind}", multirow._multirow_kernel, dict(rows, w_ptr=w_type, s_ptr=s_type),
               dict(G=128, KIND=kind, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128))
    for (unpack, block_m), hi in itertools.product(((False, 16), (True, 32)), (0, 1, 2)):
        if hi == 2 and unpack:
            continue  # the unpacked 6-bit decode is the 5-bit one's code with another mask (compiled above)
        yield (f"multirow int{4 + hi} split-K unpack={unpack}", multirow._int4_splitk_kernel,
               dict(rows, w_ptr="*i32", h_ptr="*i32", s_ptr="*fp16", y_ptr="*fp32"),
               dict(G=128, UNPACK=unpack, SPLIT=2, BLOCK_M=block_m, BLOCK_N=64, HI=hi))
    for norm, glu in ((False, False), (True, False), (False, True)):  # plain, the RMSNorm or SwiGLU folded in
        yield (f"fp8 row quantization norm={norm} glu={glu}", fp8._quant_rows_kernel,
               {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "w_ptr": "*bf16", "K": "i32", "x_row": "i32",
                "eps": "fp32"}, dict(QMAX=fp8.E4M3_MAX, TINY_=fp8.TINY, BLOCK_=fp8.BLOCK, NORM=norm, GLU=glu))
    for pdl in (False, True):
        yield (f"attention merge pdl={pdl}", attention._merge_kernel,
               {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "o_ptr": "*bf16"}, dict(R=4, SPLITS=8, D=128, BLOCK_R=16, PDL=pdl))


def main() -> None:
    for name, fn, sig, const in cases():
        kernel = compile_one(fn, sig, const)
        ptx = kernel.asm["ptx"]
        if const.get("USE_ASM") and (fn is gemv_int4._gemv_int4_kernel or sig.get("w_ptr") == "*i8"):
            int4 = fn is gemv_int4._gemv_int4_kernel
            asm = (("dp4a.u32.s32" if int4 else "dp4a.s32.s32") if const.get("A8") else "fma.rn.f16x2"
                   if const.get("H16") else ("dp2a.hi.s32.u32" if int4 else "dp2a.hi.s32.s32") if const.get("I16")
                   else "lop3.b32" if int4 else "prmt.b32")
            assert asm in ptx, f"{name}: the inline PTX ({asm}) is missing"
        waits = ptx.count("griddepcontrol.wait")
        assert waits == (1 if const.get("PDL") else 0), f"{name}: {waits} griddepcontrol.wait, PDL={const.get('PDL')}"
        print(f"{name}: {len(kernel.asm['cubin'])} bytes of sm_90 code")
    print("all compiled")


if __name__ == "__main__":
    main()
